"""On a CPU: what storing the weights column-major (``specula.tune_cpu_layout``) does to decoding speed.

Loads the model twice, as stored (``as-is``) and after ``tune_cpu_layout`` (``tuned``; the CLI and
``specula.hf.loading.load_model`` do this on a CPU), then runs ``specula bench``'s harness over both in one process,
methods interleaved per prompt: model.generate greedy, HF prompt lookup and specula with PromptLookup.
Speedups are against model.generate greedy on the as-is model. The script also prints which weight shapes the
tuning changed and what a pass over 1..11 tokens costs in each layout.

Usage: python examples/cpu_layout.py [--model PATH] [--dtype fp32] [--only code_edit,rag] [--limit 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import load_workloads
from specula.tools.bench import format_table, hf_method, run_bench, specula_method
from specula.verifier.cache_names import cache_parameter

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
PASS_LENGTHS = (1, 2, 4, 8, 11)


@torch.no_grad()
def pass_costs(model, context: int = 600, repeats: int = 7) -> dict[int, float]:
    """Median milliseconds of a pass over n tokens after a ``context``-token prompt."""
    cache = DynamicCache(config=model.config)
    named = {cache_parameter(inspect.signature(model.forward).parameters): cache}  # (cache=, or past_key_values=)
    model(torch.randint(0, 1000, (1, context)), **named, use_cache=True)
    costs = {}
    for n in PASS_LENGTHS:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(torch.randint(0, 1000, (1, n)), **named, use_cache=True)
            times.append(time.perf_counter() - started)
            cache.crop(-n)
        costs[n] = 1000 * statistics.median(times)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--only", default="code_edit,rag")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    as_is, tokenizer = load_model(args.model, dtype=dtype, tune_layout=False)
    tuned, _ = load_model(args.model, dtype=dtype, tune_layout=False)
    started = time.perf_counter()
    changed = specula.tune_cpu_layout(tuned)
    shapes = sorted({tuple(w.shape) for w in tuned.parameters() if w.dim() == 2 and w.stride() == (1, w.shape[0])})
    print(f"tune_cpu_layout: {changed} weights column-major {shapes} ({time.perf_counter() - started:.1f}s)")
    for label, model in (("as-is", as_is), ("tuned", tuned)):
        costs = pass_costs(model)
        print(
            f"{label:<6} pass over n tokens: "
            + "  ".join(f"{n}: {ms:.1f} ms ({ms / costs[1]:.2f}x)" for n, ms in costs.items())
        )

    methods = {}
    for label, model in (("as-is", as_is), ("tuned", tuned)):
        methods[f"hf-greedy{'' if label == 'as-is' else '-tuned'}"] = hf_method(model)
        methods[f"hf-prompt-lookup-{label}"] = hf_method(model, prompt_lookup_num_tokens=10)
        methods[f"specula-pl-{label}"] = specula_method(model, specula.PromptLookup)
    workloads = load_workloads(args.workloads, args.limit, args.only.split(","))
    rows = run_bench(methods, tokenizer, workloads, args.max_new_tokens, args.repeats)
    print(format_table(rows))


if __name__ == "__main__":
    main()
