"""Files of requests replayed in one batch on a fake clock: what the draft policy gains over plain passes.

Each file's requests are decoded once without drafts (their greedy outputs; kept in ``--cache``), then replayed as
the loop runs them in one batch of as many rows: PromptLookup's draft at each point of each output, the policy
(:class:`specula.policy.adaptive.AdaptiveDrafts`, its acceptance learnt as it goes) sizing each flat pass, each row
advancing by the tokens of its draft the output has next, plus one. A pass is priced by a fake clock: ``--plain-ms``
+ ``--row-ms`` a row, and ``--token-ms`` each draft token (the defaults: flat passes of SmolLM2-135M bf16 after about
1,000 keys on the 2-core AMD EPYC with AVX512_BF16; 0.2 for an accelerator's), and the policy knows those costs
exactly: what is left is what its acceptance and its choices make of them. Three runs a file: plain passes, the
policy counting every row's tokens alike (a server's), and the policy once the batch drains (a file's, the default:
``finishing_worth``). ``--alone`` replays each request alone instead.

Usage::

    python examples/replay_batches.py ../shared/workloads/code_edit.jsonl:1-8 ../shared/workloads/summarize.jsonl:1-8 \
        [--max-new-tokens 128] [--token-ms 2.5] [--deeper 1.0] [--alone] [--cache outputs.json]

``FILE:FIRST-LAST`` takes those lines of FILE (counted from 1); ``--deeper`` sets
:data:`specula.policy.acceptance.DEEPER` (1.0: untried positions taken to do as well as the one before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
from main_job import lines_of

import specula
from specula.decoding.driver import decode_all
from specula.hf.generate import prepare_jobs
from specula.hf.loading import load_model
from specula.jobs.requests import Request, encode, read_requests
from specula.policy import acceptance
from specula.policy.adaptive import AdaptiveDrafts
from specula.policy.kept_costs import ROWS, KeptCosts, widths
from specula.policy.protocol import Pass

DEPTH = 64  # the longest draft (the loop's MAX_DRAFT)


def outputs(spec: str, max_new_tokens: int, cache: dict, loaded: list) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) token ids of the requests of ``spec``, decoded in one batch without drafts (kept in
    ``cache`` by ``spec`` and length; ``loaded``: the default model and its tokenizer, loaded on first use)."""
    key = f"{spec}/{max_new_tokens}"
    if key not in cache:
        if not loaded:
            loaded.extend(load_model(None))
        model, tokenizer = loaded
        with tempfile.TemporaryDirectory() as folder:
            requests = [r for _, r in read_requests(lines_of(spec, Path(folder))) if isinstance(r, Request)]
        prompts = [encode(tokenizer, request) for request in requests]
        jobs = [job for prompt in prompts for job in prepare_jobs(model, prompt, max_new_tokens=max_new_tokens)]
        for number, job in enumerate(jobs):
            job.key = number
        rows = decode_all(specula.Decoder(model, None, slots=len(jobs)), jobs)
        cache[key] = [(job.prompt.tolist(), rows[job.key].output.tolist()) for job in jobs]
    return cache[key]


def drafts_along(prompt: list[int], output: list[int]) -> list[tuple[np.ndarray, int]]:
    """PromptLookup's draft after each token of ``output`` so far, and how many of its first tokens come next."""
    text, proposer, along = np.array(prompt + output), specula.PromptLookup(), []
    for made in range(len(output)):
        draft = proposer.propose(text[: len(prompt) + made], DEPTH).tokens.numpy()
        coming = text[len(prompt) + made : len(prompt) + made + len(draft)]
        along.append((draft, int(np.argmin(np.append(draft[: len(coming)] == coming, False)))))
    return along


def replay(rows: list[tuple[list[int], list]], args, drafts: bool = True, makespan: bool = True) -> float:
    """Seconds on the fake clock to decode ``rows`` (each its output and :func:`drafts_along` it) in one batch."""

    def pass_ms(count: int, tokens: int) -> float:
        return args.plain_ms + args.row_ms * count + args.token_ms * tokens

    def table(count: int) -> KeptCosts:  # (what the policy knows: the clock's costs, as a kept table holds them)
        most = min((rows for rows in ROWS if rows >= count), default=ROWS[-1])
        costs = KeptCosts(count, count * (DEPTH + 1) + 1, widths(most)[-1])
        for width in widths(most):
            costs.record(count * width, pass_ms(count, count * (width - 1)) / pass_ms(count, 0))
        return costs

    tables: dict[int, KeptCosts] = {}
    policy = AdaptiveDrafts(DEPTH, timed=False, costs=lambda count: tables.setdefault(count, table(count)))
    live = [[output, along, 0, policy.start()] for output, along in rows]  # (+ tokens made, its policy state)
    seconds = 0.0
    while live:
        states = [state for *_, state in live]
        proposed = sent = [specula.Draft.empty()] * len(live)
        if drafts:
            room = [len(output) - made - 1 for output, _, made, _ in live]
            policy.flat, policy.draining = True, room if makespan and len(live) > 1 else None
            asks = policy.budgets(states, room)
            proposed = [
                specula.Draft(along[made][0][:ask]) if ask and len(along[made][0]) else specula.Draft.empty()
                for (_, along, made, _), ask in zip(live, asks)
            ]
            picks = policy.trim(states, proposed, [0.0 if ask else None for ask in asks])
            sent = [draft.select(pick) for draft, pick in zip(proposed, picks)]
        new = [
            output[made : made + min(len(draft), along[made][1]) + 1]
            for (output, along, made, _), draft in zip(live, sent)
        ]
        seconds += pass_ms(len(live), sum(map(len, sent))) / 1000
        policy.learn(Pass(states, proposed, sent, new, len(live) + sum(map(len, sent)), None))
        for entry, tokens in zip(live, new):
            entry[2] += len(tokens)
        live = [entry for entry in live if entry[2] < len(entry[0])]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="request files (FILE or FILE:FIRST-LAST)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--plain-ms", type=float, default=60.0)
    parser.add_argument("--row-ms", type=float, default=1.5)
    parser.add_argument("--token-ms", type=float, default=2.5)
    parser.add_argument("--deeper", type=float, default=acceptance.DEEPER)
    parser.add_argument("--alone", action="store_true", help="replay each request alone")
    parser.add_argument("--cache", type=Path, help="a JSON file keeping the recorded outputs")
    args = parser.parse_args()
    acceptance.DEEPER = args.deeper
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    loaded: list = []
    ratios: dict[str, list[float]] = {"rows alike": [], "draining": []}
    for spec in args.files:
        recorded = outputs(spec, args.max_new_tokens, cache, loaded)
        rows = [(output, drafts_along(prompt, output)) for prompt, output in recorded]
        if args.cache:
            args.cache.write_text(json.dumps(cache))
        batches = [[row] for row in rows] if args.alone else [rows]
        plain = sum(replay(batch, args, drafts=False) for batch in batches)
        line = f"{spec}: plain {plain:.2f} s"
        for name, makespan in (("rows alike", False), ("draining", True)):
            seconds = sum(replay(batch, args, makespan=makespan) for batch in batches)
            ratios[name].append(plain / seconds)
            line += f", {name} {seconds:.2f} s ({plain / seconds:.3f}x)"
        print(line, flush=True)
    for name, values in ratios.items():
        print(f"{name}: worst {min(values):.3f}x, geometric mean {statistics.geometric_mean(values):.3f}x")


if __name__ == "__main__":
    main()
