"""How good are a proposer's drafts? An offline replay over real outputs, with a step-cost table.

Each prompt's greedy output is generated once (``--outputs`` caches them), then walked through as
``specula.generate`` does (:mod:`specula.tools.replay`): drafts asked of the proposer, sized by the loop's own policy
(:mod:`specula.policy.adaptive`) or sent as proposed (``--fixed``), advancing by accepted + 1. The step costs come
from ``--costs`` (a pass over n = 1, 2, ... tokens, relative to one token; the default is SmolLM2-135M bf16 on a
2-core CPU), so the estimated speedup over one-token decoding is printed too.

Usage: python examples/draft_replay.py --outputs outputs.json [--proposers copy-bound,prompt-lookup,...] [--fixed]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import specula
from specula.decoding.loop import MAX_DRAFT
from specula.hf.registry import PROPOSER_NAMES, proposer_factory
from specula.policy.adaptive import AdaptiveDrafts, FixedDrafts
from specula.policy.costs import PassCosts
from specula.proposers.kernels import lookup_candidates
from specula.tools.replay import Replay, recorded_outputs, walk

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
BF16_COSTS = "1.00,0.99,1.02,0.97,1.03,1.04,1.04,1.04,1.10,1.15,1.19,1.20,1.21,1.22,1.23,1.25,1.28,1.31,1.34,1.37"


class CopyBound(Replay):
    """The copy bound: at each step, of ALL earlier occurrences of the sequence's last token (however short the
    match), the continuation that agrees longest with the real output. What copying from prompt + output can reach
    at best; PromptLookup bets on one occurrence, its trees on several."""

    def propose(self, context_ids, max_tokens):
        truth = super().propose(context_ids, max_tokens).tokens.tolist()
        continuations, _ = lookup_candidates(context_ids, 1, 1, len(truth), len(context_ids))  # every occurrence
        agree = [
            next((j for j, (a, b) in enumerate(zip(c, truth)) if a != b), len(truth)) for c in continuations.tolist()
        ]
        best = int(np.argmax(agree)) if agree else 0
        return specula.Draft(continuations[best, : agree[best]] if agree else [])


def policy(adaptive: bool):
    """The loop's draft-length policy, its pass costs replayed (``walk`` charges them) rather than measured."""
    if not adaptive:
        return FixedDrafts(MAX_DRAFT)
    costs = PassCosts(1, MAX_DRAFT + 2)
    return AdaptiveDrafts(MAX_DRAFT, True, lambda rows: costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--outputs", type=Path, required=True, help="cache of outputs (JSON), made when missing")
    parser.add_argument(
        "--proposers",
        default="copy-bound,prompt-lookup,prompt-lookup-tree,ngram,oracle",
        help=f"comma-separated: {', '.join(PROPOSER_NAMES)}, oracle[:K], copy-bound[:K] (K: most "
        "draft tokens, default 10; the copy bound is always sent whole)",
    )
    parser.add_argument("--costs", default=BF16_COSTS, help="relative cost of a pass over n = 1, 2, ... tokens")
    parser.add_argument("--fixed", action="store_true", help="send every draft as proposed (FixedDrafts)")
    args = parser.parse_args()

    runs = recorded_outputs(args.workloads, args.limit, args.max_new_tokens, args.outputs, args.model)
    costs = np.array([float(c) for c in args.costs.split(",")])
    print(
        f"tokens per target pass / estimated speedup, {args.limit} prompts per workload, "
        f"{'drafts as proposed' if args.fixed else 'AdaptiveDrafts'}"
    )
    print(f"{'proposer':<24}" + "".join(f"{w:>14}" for w in runs))
    for spec in args.proposers.split(","):
        cells = []
        for pairs in runs.values():
            tokens = passes = seconds = 0
            for prompt, output in pairs:
                if spec.startswith(("oracle", "copy-bound")):
                    kind = Replay if spec.startswith("oracle") else CopyBound
                    proposer = kind([prompt + output], int(spec.partition(":")[2] or 10))
                else:
                    proposer = proposer_factory(spec, None, torch.float32, "cpu")()
                p, _, t = walk(proposer, prompt, output, policy(not args.fixed and spec != "copy-bound"), costs)
                tokens, passes, seconds = tokens + len(output), passes + p, seconds + t
            cells.append(f"{tokens / passes:.2f}/{tokens / seconds:.2f}x")
        print(f"{spec:<24}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
