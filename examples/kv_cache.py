"""What a one-token step costs with specula's preallocated KV cache and with transformers' ``DynamicCache``.

Both caches hold the same random prompt; steps alternate between them in rounds (10 steps each, the order flipped
every round) so that a noisy machine affects both alike, and the medians per step are printed. The two give the
same logits (``tests/verifier/test_cached_model.py``); this measures only what ``DynamicCache``'s per-step ``torch.cat``
of the whole cache costs.

Usage: python examples/kv_cache.py [--model PATH] [--dtype fp32] [--contexts 600,2000] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specula.hf.loading import load_model
from specula.verifier.runner import OneSequence


@torch.inference_mode()
def step_costs(model: torch.nn.Module, context: int, rounds: int, steps: int = 10) -> dict[str, float]:
    """Median milliseconds of a one-token step after ``context`` tokens, per cache."""
    prompt = torch.randint(0, model.config.vocab_size, (context,))
    caches = {"preallocated": OneSequence(model, rollback=True, capacity=context + rounds * steps)}
    caches["DynamicCache"] = OneSequence(model, rollback=True)
    caches["DynamicCache"].cache = DynamicCache(config=model.config)
    for cached in caches.values():
        cached.forward(prompt, num_logits=1)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for round_ in range(rounds):
        for name, cached in sorted(caches.items(), reverse=round_ % 2 == 1):
            started = time.perf_counter()
            for _ in range(steps):
                cached.forward(torch.tensor([100]), num_logits=1)
            times[name].append(1000 * (time.perf_counter() - started) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--contexts", default="600,2000")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    model, _ = load_model(args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    for context in (int(c) for c in args.contexts.split(",")):
        costs = step_costs(model, context, args.rounds)
        print(
            f"{args.dtype}, {context} tokens of context: "
            + ", ".join(f"{name} {ms:.1f} ms" for name, ms in costs.items())
        )


if __name__ == "__main__":
    main()
