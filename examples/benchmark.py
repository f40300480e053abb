"""specula vs HF generate on SmolLM2-135M-Instruct over the public workloads, fp32 and bf16, in one run.

Methods, interleaved per prompt: hf-greedy (model.generate), hf-prompt-lookup (prompt_lookup_num_tokens=10),
specula-none (specula's loop without drafts), specula-prompt-lookup and specula-ngram (PromptLookup and
NGramPredictor with their defaults, a fresh one per prompt); with --draft PATH also hf-assisted
(model.generate(assistant_model=...)), specula-draft (SmallModelDrafter with its defaults),
specula-draft-schedule (without the confidence stop) and specula-draft-fixed (5 drafts per step).

With --temperature T > 0 every method samples (top_k/top_p: --top-k, --top-p, HF's defaults otherwise) and the
baseline is hf-sample (model.generate(do_sample=True)); outputs are then not compared.

Usage: python examples/benchmark.py [--limit 4] [--max-new-tokens 128] [--repeats 3] [--dtypes fp32,bf16]
                                    [--methods hf-greedy,...] [--workloads DIR] [--only code_edit,...]
                                    [--temperature 0.7] [--model PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import load_workloads
from specula.tools.bench import format_table, hf_method, run_bench, specula_method

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    parser.add_argument("--limit", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=None, help="draft model folder or .gguf: adds hf-assisted and specula-draft")
    parser.add_argument(
        "--methods", default="hf-greedy,hf-prompt-lookup,specula-none,specula-prompt-lookup,specula-ngram"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    workloads = load_workloads(args.workloads, args.limit, args.only.split(",") if args.only else None)
    sampling = {}
    if args.temperature > 0:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
        sampling = {name: value for name, value in sampling.items() if value is not None}
    baseline = "hf-sample" if sampling else "hf-greedy"
    all_rows = []
    for dtype_name in args.dtypes.split(","):
        model, tokenizer = load_model(args.model, dtype=DTYPES[dtype_name])
        drafters = {}
        if args.draft:
            draft_model, draft_tokenizer = load_model(args.draft, dtype=DTYPES[dtype_name])
            variants = {  # the default, its draft-length schedule alone, and a fixed length of 5
                "specula-draft": {},
                "specula-draft-schedule": {"min_confidence": 0.0},
                "specula-draft-fixed": {"min_confidence": 0.0, "adaptive": False},
            }
            drafters = {"hf-assisted": hf_method(model, assistant_model=draft_model, **sampling)}
            for name, options in variants.items():
                make = functools.partial(specula.SmallModelDrafter, draft_model, tokenizer=draft_tokenizer, **options)
                drafters[name] = specula_method(model, make, **sampling)
        available = {
            baseline: hf_method(model, **sampling),
            "hf-prompt-lookup": hf_method(model, prompt_lookup_num_tokens=10, **sampling),
            "specula-none": specula_method(model, lambda: None, **sampling),
            "specula-prompt-lookup": specula_method(model, specula.PromptLookup, **sampling),
            "specula-ngram": specula_method(model, specula.NGramPredictor, **sampling),
            **drafters,
        }
        methods = {name: available[name] for name in args.methods.replace("hf-greedy", baseline).split(",")}
        rows = run_bench(
            methods,
            tokenizer,
            workloads,
            args.max_new_tokens,
            args.repeats,
            baseline=baseline,
            progress=lambda message: print(f"[{dtype_name}] {message}", file=sys.stderr, flush=True),
            compare_outputs=not sampling,
        )
        print(
            f"\n{dtype_name}, {args.limit} prompts per workload, {args.max_new_tokens} new tokens, "
            f"median of {args.repeats}, {torch.get_num_threads()} threads, speedup vs {baseline}"
            + (f", sampling {sampling}" if sampling else "")
        )
        print(format_table(rows), flush=True)
        all_rows += [dict(row.as_dict(), dtype=dtype_name) for row in rows]
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1))


if __name__ == "__main__":
    main()
