"""On a GPU: what a verification step costs with and without cuDNN's attention kernel, against one-token steps.

specula runs its multi-token passes on CUDA with every scaled-dot-product-attention backend except cuDNN's
(``specula/verifier/runner.py``): cuDNN prepares an execution plan for each new query/key shape, and a verification pass
has a new shape every step. This script times, per prompt, plain decoding through specula's loop and PromptLookup
with that choice (``no-cudnn``, the default) and with cuDNN allowed again (``cudnn``), as milliseconds per target
step and per new token, median of ``--repeats``.

Usage: python examples/gpu_attention.py [--model PATH] [--only code_edit,rag] [--limit 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import encode, load_workloads
from specula.verifier import runner

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
BACKENDS = {
    "no-cudnn": runner._VERIFY_BACKENDS,
    "cudnn": runner._VERIFY_BACKENDS + [SDPBackend.CUDNN_ATTENTION],
}


def timed(model, prompt: torch.Tensor, proposer, max_new_tokens: int, repeats: int) -> tuple[float, object]:
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = specula.generate(model, prompt, proposer() if proposer else None, max_new_tokens=max_new_tokens)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs[1:]), out.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--only", default="code_edit,rag")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("This measurement needs a CUDA GPU.")

    model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    for workload, rows in load_workloads(args.workloads, args.limit, args.only.split(",")).items():
        for row in rows:
            prompt = encode(tokenizer, row).cuda()
            for label, backends in BACKENDS.items():
                runner._VERIFY_BACKENDS = backends
                cells = []
                for name, proposer in (("none", None), ("prompt-lookup", specula.PromptLookup)):
                    seconds, stats = timed(model, prompt, proposer, args.max_new_tokens, args.repeats)
                    cells.append(
                        f"{name} {1000 * seconds / stats.passes:5.1f} ms/step "
                        f"{1000 * seconds / stats.new_tokens:5.1f} ms/token"
                    )
                print(f"{workload:<10} {prompt.shape[1]:>5} prompt tokens  {label:<9} " + " | ".join(cells))
    runner._VERIFY_BACKENDS = BACKENDS["no-cudnn"]


if __name__ == "__main__":
    main()
