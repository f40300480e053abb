"""NGramPredictor speed: Numba tables against the pure-Python reference of the tests, in the same run.

Feeds a synthetic token stream (``--stream phrases``: 200 random phrases recurring 70% of the time between random
tokens; ``random``: uniformly random tokens, every n-gram new, so the tables fill and age as fast as they can;
vocabulary 49152) and reports updates per second and the latency of an 8-token prediction, median of several
repeats, for:
  numba        specula's kernels, compiled;
  interpreted  the very same table code run by the Python interpreter (NUMBA_DISABLE_JIT=1, in a subprocess);
  dict         the independent pure-Python reference of the tests (Python dicts: a different, faster structure).

Usage: python examples/ngram_microbench.py [--tokens 200000] [--repeats 5] [--stream phrases|random]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import specula

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_ngram import ReferenceNGram  # noqa: E402  (the reference lives with the tests)


def stream(length: int, kind: str = "phrases", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 49152, length).astype(np.int64)
    phrases = [rng.integers(0, 49152, rng.integers(5, 40)) for _ in range(200)]
    parts, total = [], 0
    while total < length:
        part = phrases[rng.integers(len(phrases))] if rng.random() < 0.7 else rng.integers(0, 49152, 10)
        parts.append(part)
        total += len(part)
    return np.concatenate(parts)[:length].astype(np.int64)


def median_of(repeats: int, run) -> float:
    return statistics.median(run() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream", choices=["phrases", "random"], default="phrases")
    parser.add_argument("--interpreted-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = stream(args.tokens, args.stream)
    specula.NGramPredictor().update(tokens[:100])  # compile (or load the cached machine code)

    # Steady state, as in a long generation or a kept predictor: learn the first half, time the second half,
    # fed in blocks of 64 tokens as generation feeds it.
    half = len(tokens) // 2
    blocks = np.array_split(tokens[half:], max(1, (len(tokens) - half) // 64))

    def numba_update() -> float:
        predictor = specula.NGramPredictor()
        predictor.update(tokens[:half])
        started = time.perf_counter()
        for block in blocks:
            predictor.update(block)
        return time.perf_counter() - started

    reference_tokens = tokens.tolist()
    reference_blocks = [block.tolist() for block in blocks]  # the same blocks: ageing included

    def reference_update() -> float:
        reference = ReferenceNGram(4, 1 << 15, [2, 1, 1], [0.5] * 3)
        reference.update(reference_tokens[:half])
        started = time.perf_counter()
        for block in reference_blocks:
            reference.update(block)
        return time.perf_counter() - started

    if args.interpreted_child:  # the same kernels, interpreted: time a tenth of the blocks
        timed = blocks[: len(blocks) // 10]
        predictor = specula.NGramPredictor()
        predictor.update(tokens[:half])
        started = time.perf_counter()
        for block in timed:
            predictor.update(block)
        print(sum(map(len, timed)) / (time.perf_counter() - started))
        return
    child = [
        sys.executable,
        "-W",
        "ignore",
        __file__,
        "--interpreted-child",
        "--tokens",
        str(args.tokens),
        "--stream",
        args.stream,
    ]
    environment = dict(os.environ, NUMBA_DISABLE_JIT="1")
    timings = []
    for _ in range(args.repeats):  # interleaved: these machines are shared and noisy
        interpreted = float(subprocess.run(child, env=environment, capture_output=True, text=True, check=True).stdout)
        timings.append((numba_update(), reference_update(), interpreted))
    fast = sum(map(len, blocks)) / statistics.median(t for t, _, _ in timings)
    dict_rate = sum(map(len, reference_blocks)) / statistics.median(t for _, t, _ in timings)
    interpreted_rate = statistics.median(rate for _, _, rate in timings)
    print(
        f"update: numba {fast:,.0f} tokens/s; same tables interpreted {interpreted_rate:,.0f} tokens/s "
        f"({fast / interpreted_rate:.0f}x); dict reference {dict_rate:,.0f} tokens/s ({fast / dict_rate:.0f}x)"
    )

    predictor = specula.NGramPredictor(min_count=1)
    predictor.update(tokens)
    reference = ReferenceNGram(4, 1 << 15, [1, 1, 1], [0.5] * 3)
    reference.update(tokens.tolist())
    contexts = [tokens[i - 3 : i] for i in range(1000, 1000 + 2000)]
    drafted = sum(len(predictor.predict(c, 8)) for c in contexts)

    def latency(call) -> float:
        started = time.perf_counter()
        for context in contexts:
            call(context)
        return (time.perf_counter() - started) / len(contexts) * 1e6

    kernel = median_of(args.repeats, lambda: latency(lambda c: predictor._predict(c, 8)))
    method = median_of(args.repeats, lambda: latency(lambda c: predictor.propose(c, 8)))
    python = median_of(args.repeats, lambda: latency(lambda c: reference.predict(c.tolist(), 8)))
    print(
        f"predict 8 tokens: kernel {kernel:.1f} us, NGramPredictor.propose {method:.1f} us, "
        f"python reference {python:.1f} us (mean draft {drafted / len(contexts):.1f} tokens)"
    )


if __name__ == "__main__":
    main()
