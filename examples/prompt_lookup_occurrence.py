"""Which earlier occurrence should prompt lookup copy from? An offline replay over real greedy outputs.

Greedy decoding is deterministic, so how many tokens a proposer would have gained can be replayed without the
model: generate each prompt's greedy output once (fp32, SmolLM2-135M-Instruct by default), then walk through it as the
verifier would, asking each drafting rule for up to K tokens at every step and advancing by accepted + 1.

Rules compared (longest n-gram first in all of them):
  recent      the most recent earlier occurrence, copy may overlap the draft (specula's PromptLookup)
  recent-cut  the most recent occurrence, copy stops at the end of the sequence
  earliest    the first occurrence in the sequence (HF's leftmost, vLLM's earliest)

Usage: python examples/prompt_lookup_occurrence.py [--limit 12] [--max-new-tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import encode, load_workloads

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def find_start(tokens: list[int], n: int, rule: str) -> int | None:
    suffix = tokens[-n:]
    starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
    if not starts:
        return None
    return starts[0] if rule == "earliest" else starts[-1]


def draft(tokens: list[int], rule: str, min_ngram: int, max_ngram: int, k: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        start = find_start(tokens, n, rule)
        if start is not None:
            source = start + n
            if rule == "recent-cut":
                return tokens[source : source + k]
            extended = list(tokens)
            for j in range(k):
                extended.append(extended[source + j])
            return extended[len(tokens) :]
    return []


def replay(prompt: list[int], output: list[int], rule: str, min_ngram: int, max_ngram: int, k: int):
    """Target steps and drafted tokens the verifier would spend on ``output`` with this drafting rule."""
    steps = drafted = 0
    position = 1  # the prefill produced output[0]
    while position < len(output):
        guess = draft(prompt + output[:position], rule, min_ngram, max_ngram, min(k, len(output) - position - 1))
        accepted = 0
        while accepted < len(guess) and guess[accepted] == output[position + accepted]:
            accepted += 1
        steps, drafted, position = steps + 1, drafted + len(guess), position + accepted + 1
    return steps + 1, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft", type=int, default=10)
    parser.add_argument("--model", default=None)
    parser.add_argument("--outputs", type=Path, default=None, help="cache of greedy outputs (JSON)")
    args = parser.parse_args()

    cached = json.loads(args.outputs.read_text()) if args.outputs and args.outputs.exists() else {}
    model = tokenizer = None
    runs: dict[str, list[tuple[list[int], list[int]]]] = {}
    for workload, rows in load_workloads(args.workloads, args.limit).items():
        for row in rows:
            if row["id"] not in cached:
                if model is None:
                    model, tokenizer = load_model(args.model, dtype=torch.float32)
                prompt = encode(tokenizer, row)
                out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=args.max_new_tokens)
                cached[row["id"]] = [prompt[0].tolist(), out.sequences[0, prompt.shape[1] :].tolist()]
            runs.setdefault(workload, []).append(cached[row["id"]])
    if args.outputs:
        args.outputs.write_text(json.dumps(cached))

    settings = [(rule, 1, 3) for rule in ("recent", "recent-cut", "earliest")]
    settings += [("recent", lo, hi) for lo, hi in ((2, 3), (1, 2), (1, 5), (2, 5), (3, 5))]
    print(f"tokens per target step (acceptance rate), K={args.num_draft}, {args.limit} prompts per workload")
    print(f"{'rule':<12}{'ngram':<7}" + "".join(f"{w:>17}" for w in runs))
    for rule, lo, hi in settings:
        cells = []
        for pairs in runs.values():
            tokens = steps = drafted = 0
            for prompt, output in pairs:
                s, d = replay(prompt, output, rule, lo, hi, args.num_draft)
                tokens, steps, drafted = tokens + len(output), steps + s, drafted + d
            accepted = tokens - steps
            cells.append(f"{tokens / steps:.2f} ({accepted / max(drafted, 1):.0%})")
        print(f"{rule:<12}{f'{lo}-{hi}':<7}" + "".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
