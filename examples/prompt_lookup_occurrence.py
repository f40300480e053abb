"""Which earlier occurrence should prompt lookup copy from? An offline replay over real greedy outputs.

Each prompt's greedy output is generated once (fp32, SmolLM2-135M-Instruct by default; ``--outputs`` caches them),
then walked through as the verifier would (:mod:`specula.tools.replay`), every rule asked for up to K tokens at
every step, advancing by accepted + 1.

Rules compared (longest n-gram first in all of them):
  recent      the most recent earlier occurrence, copy may overlap the draft (specula's PromptLookup)
  recent-cut  the most recent occurrence, copy stops at the end of the sequence
  earliest    the first occurrence in the sequence (HF's leftmost, vLLM's earliest)

Usage: python examples/prompt_lookup_occurrence.py [--limit 12] [--max-new-tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import specula
from specula.policy.adaptive import FixedDrafts
from specula.tools.replay import recorded_outputs, walk

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


class Rule(specula.Proposer):
    """Copies what followed the longest earlier n-gram (``max_ngram`` down to ``min_ngram`` tokens) that matches the
    end of the context, from the occurrence ``rule`` picks."""

    def __init__(self, rule: str, min_ngram: int, max_ngram: int) -> None:
        self.rule, self.min_ngram, self.max_ngram = rule, min_ngram, max_ngram

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        tokens = context_ids.tolist()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
            if starts:
                source = (starts[0] if self.rule == "earliest" else starts[-1]) + n
                if self.rule == "recent-cut":
                    return specula.Draft(tokens[source : source + max_tokens])
                for j in range(max_tokens):  # (the copy may run into the tokens it copies)
                    tokens.append(tokens[source + j])
                return specula.Draft(tokens[len(context_ids) :])
        return specula.Draft.empty()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft", type=int, default=10)
    parser.add_argument("--model", default=None)
    parser.add_argument("--outputs", type=Path, default=None, help="cache of greedy outputs (JSON)")
    args = parser.parse_args()

    runs = recorded_outputs(args.workloads, args.limit, args.max_new_tokens, args.outputs, args.model, torch.float32)
    settings = [(rule, 1, 3) for rule in ("recent", "recent-cut", "earliest")]
    settings += [("recent", lo, hi) for lo, hi in ((2, 3), (1, 2), (1, 5), (2, 5), (3, 5))]
    print(f"tokens per target pass (acceptance rate), K={args.num_draft}, {args.limit} prompts per workload")
    print(f"{'rule':<12}{'ngram':<7}" + "".join(f"{w:>17}" for w in runs))
    for rule, lo, hi in settings:
        cells = []
        for pairs in runs.values():
            tokens = passes = drafted = 0
            for prompt, output in pairs:
                p, d, _ = walk(Rule(rule, lo, hi), prompt, output, FixedDrafts(args.num_draft), np.ones(1))
                tokens, passes, drafted = tokens + len(output), passes + p, drafted + d
            cells.append(f"{tokens / passes:.2f} ({(tokens - passes) / max(drafted, 1):.0%})")
        print(f"{rule:<12}{f'{lo}-{hi}':<7}" + "".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
