"""The main job timed as a user times it: `specula generate` against `--proposer none` and HF's batched generate.

For each request file: one `specula generate` run first (it measures what the kept tables need; not counted), then
``--rounds`` rounds, each running `specula generate` with the defaults, again with `--proposer none`, and HF's
``model.generate`` on left-padded batches, each in a process of its own, timed by the run itself (model loading
apart: the summary line's seconds; HF's from its first batch to its last). Prints each run as it ends, then per
file the medians, the default against none as measured and as its summary estimated, the default against HF's
batches, and whether the default's answers were none's in every round (what invariant and exact verification
promise).

Usage::

    python examples/main_job.py                      # README's requests (examples/requests.jsonl)
    python examples/main_job.py ../shared/workloads/code_edit.jsonl:9-16 ../shared/workloads/summarize.jsonl:9-16 \
        --max-new-tokens 128 [--rounds 3] [--batch-size 8] [--dtype fp32] [--exact]

``FILE:FIRST-LAST`` takes those lines of FILE (counted from 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specula.hf.loading import load_model
from specula.jobs.requests import Request, encode, read_requests
from specula.tools.bench import hf_batch_method

README_REQUESTS = Path(__file__).resolve().parent / "requests.jsonl"
SUMMARY = re.compile(r"([\d.]+) tok/s\), ([\d.]+) tokens per pass(?:.*?~([\d.]+)x plain)?")


def lines_of(spec: str, folder: Path) -> Path:
    """The request file ``spec`` names: a path, or ``path:FIRST-LAST`` (those lines, written to ``folder``)."""
    path, _, span = spec.partition(":")
    if not span:
        return Path(path)
    first, _, last = span.partition("-")
    chosen = Path(path).read_text().splitlines()[int(first) - 1 : int(last or first)]
    out = folder / f"{Path(path).stem}-{first}-{last or first}.jsonl"
    out.write_text("\n".join(chosen) + "\n")
    return out


def specula_run(requests: Path, args, proposer: list[str]) -> dict:
    """One `specula generate` process over ``requests``: its seconds, tokens per pass, estimate, answers."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "answers.jsonl"
        command = [sys.executable, "-m", "specula.cli", "generate", "--input", str(requests), "--output", str(out)]
        command += ["--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, *args.more, *proposer]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        summary = done.stderr.strip().splitlines()[-1]
        match = SUMMARY.search(summary)
        if match is None:
            raise SystemExit(f"no tokens/s and tokens per pass in the summary line of {' '.join(command)}: {summary}")
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    texts, tokens = json.dumps([row.get("text") for row in rows]), sum(row["stats"]["new_tokens"] for row in rows)
    return {
        "seconds": tokens / float(match[1]),  # (the summary's tokens/s has more digits than its seconds)
        "tokens": tokens,
        "per_pass": float(match[2]),
        "estimate": None if match[3] is None else float(match[3]),
        "answers": hashlib.md5(texts.encode()).hexdigest()[:8],
    }


def hf_run(requests: Path, args) -> dict:
    """HF's batched ``model.generate`` over ``requests`` in a process of its own (this script with ``--hf``)."""
    command = [sys.executable, __file__, "--hf", str(requests), "--max-new-tokens", str(args.max_new_tokens)]
    done = subprocess.run(command + ["--batch-size", str(args.batch_size), "--dtype", args.dtype], capture_output=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr.decode()[-2000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def hf_batches(requests: Path, args) -> None:
    """``--hf``: decode ``requests`` with HF's batched generate, print its seconds and tokens as JSON."""
    dtypes = {"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    model, tokenizer = load_model(None, dtype=dtypes[args.dtype])
    prompts = [encode(tokenizer, request)[0] for _, request in read_requests(requests) if isinstance(request, Request)]
    prompts = [torch.as_tensor(prompt) for prompt in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, seconds, _ = hf_batch_method(model, pad)(prompts, args.max_new_tokens, args.batch_size)
    print(json.dumps({"seconds": seconds, "tokens": sum(map(len, rows))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=[str(README_REQUESTS)], help="request files (FILE:FIRST-LAST)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="as `specula generate`'s default")
    parser.add_argument("--batch-size", type=int, default=8, help="HF's batches (specula's: its own choice)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto")
    parser.add_argument("--exact", action="store_const", const=["--exact"], default=[], dest="more")
    parser.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf:
        return hf_batches(args.hf, args)
    with tempfile.TemporaryDirectory() as folder:
        for spec in args.files:
            requests = lines_of(spec, Path(folder))
            specula_run(requests, args, [])  # (the kept tables measured, as a user's first run measures them)
            runs = {"default": [], "none": [], "hf": []}
            for round_ in range(1, args.rounds + 1):
                for name in runs:
                    started = time.perf_counter()
                    proposer = [] if name == "default" else ["--proposer", "none"]
                    run = hf_run(requests, args) if name == "hf" else specula_run(requests, args, proposer)
                    runs[name].append(run)
                    shown = {key: round(value, 2) if isinstance(value, float) else value for key, value in run.items()}
                    print(f"{spec} round {round_} {name}: {shown} ({time.perf_counter() - started:.0f} s)", flush=True)
            rate = {
                name: statistics.median(run["tokens"] / run["seconds"] for run in done) for name, done in runs.items()
            }
            estimates = [run["estimate"] for run in runs["default"] if run["estimate"] is not None]
            same = all(d["answers"] == n["answers"] for d, n in zip(runs["default"], runs["none"]))
            print(
                f"{spec}: default {rate['default']:.1f} tok/s, none {rate['none']:.1f}, HF batches of "
                f"{args.batch_size} {rate['hf']:.1f} (medians of {args.rounds}); default over none "
                f"{rate['default'] / rate['none']:.2f}x measured, "
                f"{statistics.median(estimates) if estimates else float('nan'):.2f}x its summary (median); "
                f"over HF's batches {rate['default'] / rate['hf']:.2f}x; "
                f"answers {'the same as' if same else 'not always'} none's",
                flush=True,
            )


if __name__ == "__main__":
    main()
