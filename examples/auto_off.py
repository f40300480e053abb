"""Never slower: a proposer whose every draft token is wrong, against plain decoding, in one interleaved run.

The proposer drafts, at every position, a token other than the one the target will produce (it knows the output of
an earlier run). With the cost model (``adaptive_draft=True``, the default) the loop learns within a few steps that
its drafts are never accepted and stops sending them; it keeps asking for a one-token draft it does not send, to
notice if the proposer improves. ``always-wrong-fixed`` sends every draft as proposed, for comparison.

Usage: python examples/auto_off.py [--dtype bf16] [--limit 3] [--repeats 5] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import load_workloads
from specula.tools.bench import Replay, format_table, hf_method, run_bench, specula_method

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class AlwaysWrong(Replay):
    """Drafts the token after the right one in the vocabulary: never accepted."""

    def __init__(self, prompt_length: int, output: list[int], vocab_size: int) -> None:
        super().__init__(prompt_length, output, num_draft=10)
        self.vocab_size = vocab_size

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        done = len(context_ids) - self.prompt_length
        right = self.output[done : done + min(self.num_draft, max_tokens)]
        return specula.Draft((right + 1) % self.vocab_size)


def always_wrong_method(model, adaptive: bool):
    outputs: dict[tuple, list[int]] = {}

    def run(prompt: torch.Tensor, max_new_tokens: int, prediction=None):
        key = (tuple(prompt[0].tolist()), max_new_tokens)
        if key not in outputs:
            outputs[key] = (
                specula.generate(model, prompt, None, max_new_tokens=max_new_tokens)
                .sequences[0, prompt.shape[1] :]
                .tolist()
            )
        proposer = AlwaysWrong(prompt.shape[1], outputs[key], model.get_output_embeddings().weight.shape[0])
        out = specula.generate(model, prompt, proposer, max_new_tokens=max_new_tokens, adaptive_draft=adaptive)
        return out.sequences[0, prompt.shape[1] :].tolist(), out.stats.wall_time_s, out.stats

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--only", default="chat,code", help="comma-separated workload names")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    methods = {
        "specula-none": specula_method(model, lambda: None),
        "always-wrong": always_wrong_method(model, adaptive=True),
        "always-wrong-fixed": always_wrong_method(model, adaptive=False),
        "hf-greedy": hf_method(model),
    }
    workloads = load_workloads(args.workloads, args.limit, args.only.split(","))
    rows = run_bench(methods, tokenizer, workloads, args.max_new_tokens, args.repeats, baseline="specula-none")
    print(
        f"{args.dtype}, {args.limit} prompts per workload, {args.max_new_tokens} new tokens, median of "
        f"{args.repeats}; speedup vs specula-none (plain decoding through the same loop); accept/tok-step show "
        "what was sent"
    )
    print(format_table(rows).replace("speedup", "vs none"))
    for row in rows:
        if row.method.startswith("always-wrong"):
            print(
                f"{row.workload} {row.method}: {row.speedup_vs_hf_greedy:.3f}x plain decoding's speed, "
                f"{row.drafted} draft tokens sent for {row.new_tokens} new tokens"
            )


if __name__ == "__main__":
    main()
