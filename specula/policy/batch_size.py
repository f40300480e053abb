"""How many requests ``specula generate`` decodes at once: the batch size that runs fastest on this model and device,
measured, not a constant that suits one machine."""

from __future__ import annotations

import torch

from ..machine import store
from ..machine.memory import spare_bytes
from ..machine.profile import profile_of
from ..machine.timing import lower_median, time_pass
from ..verifier.exactness import choose, model_key
from ..verifier.runner import CachedModel
from ..verifier.support import UnsupportedModelError, context_limit, model_device, vocab_size


@torch.inference_mode()
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
    weighed against a one-row pass timed just before (3 rounds, the lower median of the ratios), so that load on the
    machine, which slows both, does not
    favour one size over another. Doubling goes on while it gains at least ``gain`` in tokens per second and that many
    rows of
    ``context_per_row`` tokens of KV cache fit in a quarter of the free memory. 1 for models that cannot be batched.
    Measured once per model, or ``again`` (what it takes: ``docs/hardware.md``)."""
    if largest < 2:
        return 1
    profile = profile_of(model)
    if not again and profile.batch_size is not None and profile.batch_size[0] >= largest:
        return profile.batch_size[1]
    device = model_device(model)
    exact = choose(model, None).exact
    limit = context_limit(model) or context + 16 * largest + 2
    step = max(0, min(16, (limit - 2 - context) // largest))  # (tokens each row has over the one before)
    context = max(1, min(context, limit - 2 - step * largest))
    try:
        target = CachedModel(
            model,
            None,
            None,
            rollback=True,
            capacity=context + step * largest + 1,
            row_exact=exact,
            slots=largest,
            cheap_steps=not exact,
        )
    except UnsupportedModelError:
        return 1
    text = torch.randint(0, vocab_size(model), (context + step * largest,), generator=torch.Generator().manual_seed(0))
    spare = spare_bytes(device)
    alone = CachedModel(
        model,
        None,
        None,
        rollback=True,
        capacity=context + step * largest + 1,
        row_exact=exact,
        ragged=True,
        cheap_steps=not exact,
    )  # (what each size is weighed against)
    alone.start_row(0, text.to(device))
    best, best_rate, size = 1, 0.0, 1
    target.start_row(0, text.to(device))  # the longest row, whose prefixes the others take
    while True:
        for index in range(target.batch, size):
            if target.rows_state is None:
                target.copy_prefix(0, index, context + step * index)
            else:  # (recurrent state holds no prefix of a row: computed)
                target.start_row(index, text[: context + step * index].to(device))
        kv_per_token = sum(
            t.nbytes
            for layer in target.cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        ) / (size * target.cached_tokens)  # (recurrent state: none)
        if spare is not None and size * kv_per_token * context_per_row > spare / 4:
            break
        rate = _relative_rate(target, alone, text[:1].to(device))
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
    must not follow the load of the moment, so every run on the machine takes the same."""
    weight = next(model.parameters())
    key = store.key(
        weight.device, "batch size", model_key(model), weight.dtype, model.config._attn_implementation, largest
    )
    return store.shared().get(key, lambda: fastest_batch_size(model, largest, again=True))


def _relative_rate(target: CachedModel, alone: CachedModel, token: torch.Tensor, rounds: int = 3) -> float:
    """Tokens per second of plain passes over ``target``'s rows, in those of a one-row pass of ``alone`` timed just
    before each (load on the machine slows both): the lower median over ``rounds`` rounds, after one that warms up."""
    ratios = []
    for _ in range(rounds + 1):
        one = _pass_seconds(alone, [token])
        ratios.append(target.batch * one / _pass_seconds(target, [token] * target.batch))
    return lower_median(ratios[1:])


def _pass_seconds(target: CachedModel, blocks: list[torch.Tensor]) -> float:
    """The time of a plain pass over ``blocks`` (one token a row); the cache is left as it was."""
    seconds = time_pass(lambda: target.forward_rows(blocks, [1] * len(blocks)), target.device)
    target.keep_rows([0] * len(blocks))  # (forgotten again)
    return seconds
