"""How good are a proposer's drafts? An offline replay over real outputs, with a step-cost table.

Greedy decoding is deterministic, so what a proposer would gain can be replayed without the model: generate each
prompt's output once (``--outputs`` caches them), then walk through it as ``specula.generate`` does, asking the
proposer for drafts, choosing how many to send with the same policy (``specula.policy.adaptive``), and advancing by accepted + 1.
The step costs come from ``--costs`` (seconds of a pass over n = 1, 2, ... tokens, relative to one token; the
default is SmolLM2-135M bf16 on a 2-core CPU), so the estimated speedup over one-token decoding is printed too.

Usage: python examples/draft_replay.py --outputs outputs.json [--proposers copy-bound,prompt-lookup,...] [--fixed]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import specula
from specula.policy.adaptive import AdaptiveDrafts, FixedDrafts
from specula.policy.protocol import Step
from specula.proposers.kernels import lookup_candidates
from specula.core.loop import MAX_DRAFT
from specula.hf.loading import load_model
from specula.proposers.registry import PROPOSER_NAMES, proposer_factory
from specula.jobs.requests import encode, load_workloads

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
BF16_COSTS = "1.00,0.99,1.02,0.97,1.03,1.04,1.04,1.04,1.10,1.15,1.19,1.20,1.21,1.22,1.23,1.25,1.28,1.31,1.34,1.37"


def replay(proposer: specula.Proposer, prompt: list[int], output: list[int], costs: np.ndarray, adaptive: bool):
    """(target steps, drafted tokens, estimated seconds) to produce ``output`` with ``proposer``, its drafts sized
    by the loop's own policy (``adaptive``) or sent as proposed."""
    tables = {tree: np.full(MAX_DRAFT + 2, np.nan) for tree in (False, True)}  # (replayed costs: alike)
    policy = AdaptiveDrafts(MAX_DRAFT, True, lambda rows, tree: tables[tree]) if adaptive else FixedDrafts(MAX_DRAFT)
    states = [policy.start()]
    proposer.begin(np.asarray(prompt, dtype=np.int64), specula.Sampling())
    context = list(prompt)
    steps = drafted = 0
    seconds = 0.0
    while len(context) - len(prompt) < len(output):
        done = len(context) - len(prompt)
        remaining = len(output) - done - 1
        budget = policy.budgets(states, [remaining])[0]
        proposed = specula.Draft.empty()
        if budget:
            proposed = proposer.propose(np.asarray(context, dtype=np.int64), budget).cut(budget)
        sent = proposed.select(policy.trim(states, [proposed], [None])[0])  # (drafting time: not replayed)
        accepted = len(sent.path(output[done:]))
        new = output[done : done + accepted + 1]
        cost = costs[min(len(sent), len(costs) - 1)]
        policy.learn(Step(states, [proposed], [sent], [new], len(sent) + 1, cost))
        proposer.observe(new, accepted)
        context += new
        steps, drafted, seconds = steps + 1, drafted + len(sent), seconds + cost
    return steps, drafted, seconds


class Oracle(specula.Proposer):
    """Proposes the known output: the upper bound of any proposer."""

    def __init__(self, prompt_length: int, output: list[int], num_draft: int) -> None:
        self.prompt_length, self.output, self.num_draft = prompt_length, output, num_draft

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_length
        return specula.Draft(self.output[start : start + min(max_tokens, self.num_draft)])


class CopyBound(Oracle):
    """The copy bound: at each step, of ALL earlier occurrences of the sequence's last token (however short the
    match), the continuation that agrees longest with the real output. What copying from prompt + output can reach
    at best; PromptLookup bets on one occurrence, its trees on several."""

    def propose(self, context_ids, max_tokens):
        start, length = len(context_ids) - self.prompt_length, min(max_tokens, self.num_draft)
        truth = self.output[start : start + length]
        continuations, _ = lookup_candidates(context_ids, 1, 1, length, len(context_ids))  # every occurrence
        agree = [next((j for j, (a, b) in enumerate(zip(c, truth)) if a != b), len(truth)) for c in continuations.tolist()]
        best = int(np.argmax(agree)) if agree else 0
        return specula.Draft(continuations[best, : agree[best]] if agree else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--outputs", type=Path, required=True, help="cache of outputs (JSON), made when missing")
    parser.add_argument("--proposers", default="copy-bound,prompt-lookup,prompt-lookup-tree,ngram,oracle",
                        help=f"comma-separated: {', '.join(PROPOSER_NAMES)}, oracle[:K], copy-bound[:K] (K: most "
                             "draft tokens, default 10; the copy bound is always sent whole)")
    parser.add_argument("--costs", default=BF16_COSTS, help="relative cost of a pass over n = 1, 2, ... tokens")
    parser.add_argument("--fixed", action="store_true", help="send every draft as proposed (FixedDrafts)")
    args = parser.parse_args()

    cached = json.loads(args.outputs.read_text()) if args.outputs.exists() else {}
    model = tokenizer = None
    runs: dict[str, list[tuple[list[int], list[int]]]] = {}
    for workload, rows in load_workloads(args.workloads, args.limit).items():
        for row in rows:
            key = f"{workload}/{row['id']}"
            if key not in cached:
                if model is None:
                    model, tokenizer = load_model(args.model, dtype=torch.bfloat16)
                prompt = encode(tokenizer, row)
                out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=args.max_new_tokens)
                cached[key] = [prompt[0].tolist(), out.sequences[0, prompt.shape[1] :].tolist()]
                args.outputs.write_text(json.dumps(cached))
            runs.setdefault(workload, []).append(cached[key])
    costs = np.array([float(c) for c in args.costs.split(",")])

    print(f"tokens per target step / estimated speedup, {args.limit} prompts per workload, "
          f"{'drafts as proposed' if args.fixed else 'AdaptiveDrafts'}")
    print(f"{'proposer':<24}" + "".join(f"{w:>14}" for w in runs))
    for spec in args.proposers.split(","):
        cells = []
        for pairs in runs.values():
            tokens = steps = seconds = 0
            for prompt, output in pairs:
                if spec.startswith(("oracle", "copy-bound")):
                    kind = Oracle if spec.startswith("oracle") else CopyBound
                    proposer = kind(len(prompt), output, int(spec.partition(":")[2] or 10))
                else:
                    proposer = proposer_factory(spec, None, torch.float32, "cpu")()
                s, _, t = replay(proposer, prompt, output, costs, adaptive=not args.fixed and spec != "copy-bound")
                tokens, steps, seconds = tokens + len(output), steps + s, seconds + t
            cells.append(f"{tokens / steps:.2f}/{tokens / seconds:.2f}x")
        print(f"{spec:<24}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
