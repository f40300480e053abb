"""How many requests ``specula generate`` decodes at once: the batch size that runs fastest on this model and device,
measured, not a constant that suits one machine."""

from __future__ import annotations

import torch

from ..machine import store
from ..machine.memory import spare_bytes
from ..machine.profile import profile_of
from ..verifier.exactness import choose, model_key
from ..verifier.support import UnsupportedModelError, context_limit, model_device
from ..verifier.timed import BatchRates


@torch.no_grad()
def fastest_batch_size(
    model: torch.nn.Module,
    largest: int = 32,
    context: int = 128,
    gain: float = 1.1,
    context_per_row: int = 4096,
    again: bool = False,
) -> int:
    """The batch size (1, 2, 4 ... up to ``largest``) whose plain decoding passes, as specula's loop runs them, make
    the most tokens per second.

    Rows of ``context + 16 * largest``, ``context + 16``, ``context + 32`` ... tokens of cache (different lengths, as
    real requests have; fewer where the model's positions end) get one token each. Each size's tokens per second is
    weighed against a one-row pass timed just before (3 rounds, the lower median of the ratios:
    :class:`~specula.verifier.timed.BatchRates`), so that load on the machine, which slows both, does not favour one
    size over another. Doubling goes on while it gains at least ``gain`` in tokens per second and that many rows of
    ``context_per_row`` tokens of KV cache fit in a quarter of the free memory. 1 for models that cannot be batched.
    Measured once per model, or ``again`` (what it takes: ``docs/hardware.md``)."""
    if largest < 2:
        return 1
    profile = profile_of(model)
    if not again and profile.batch_size is not None and profile.batch_size[0] >= largest:
        return profile.batch_size[1]
    try:
        rates = BatchRates(
            model, largest, context, choose(model, None).exact, context_limit(model) or context + 16 * largest + 2
        )
    except UnsupportedModelError:
        return 1
    spare = spare_bytes(model_device(model))
    best, best_rate, size = 1, 0.0, 1
    while True:
        kv_per_token = rates.grow(size)
        if spare is not None and size * kv_per_token * context_per_row > spare / 4:
            break
        rate = rates.rate()
        if rate < gain * best_rate:
            break
        best, best_rate = size, rate
        if size == largest:
            break
        size = min(2 * size, largest)
    profile.batch_size = (largest, best)
    return best


def kept_batch_size(model: torch.nn.Module, largest: int = 32) -> int:
    """:func:`fastest_batch_size`, measured once per machine and model and kept with the calibrations: where the
    batch size changes what a request decodes to (ordinary bf16/fp16 verification rounds by the rows of a pass), it
    must not follow the load of the moment, so every run on the machine takes the same (``largest`` where other
    programs take the CPUs as it would be measured: not kept, and the cache's memory budget still bounds it)."""
    weight = next(model.parameters())
    key = store.key(
        weight.device, "batch size", model_key(model), weight.dtype, model.config._attn_implementation, largest
    )
    return store.shared().get(key, lambda: fastest_batch_size(model, largest, again=True), busy=lambda: largest)
