"""Weight layout for verification passes on a CPU.

``nn.Linear`` keeps its weight as ``(out_features, in_features)``, row-major, and computes ``x @ weight.T``. For
a few rows of ``x`` (a pass over the last token and a handful of draft tokens), MKL's kernel for that transposed
operand can re-read the weight for every two or three rows. Stored the other way round (the same values with
column-major strides, ``weight.t().contiguous().t()``) the weight is read once. Which layout is faster depends on
the CPU, the dtype and the BLAS build (measurements: ``docs/hardware.md``), so :func:`tune_cpu_layout` times the
model in both layouts and keeps the faster.
"""

from __future__ import annotations

import torch
from torch import nn

from ..machine import store
from ..machine.timing import seconds_of

TIMED_LENGTHS = (1, 8)  # a one-token step, and a pass over the last token and 7 draft tokens
MIN_GAIN = 0.9  # column-major must make the two together at least 10% cheaper


def _row_major_linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """Each distinct row-major 2-D floating-point ``nn.Linear`` weight once (tied weights share one entry)."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, nn.Linear)
            and isinstance(weight, torch.Tensor)
            and weight.is_floating_point()
            and weight.dim() == 2
            and weight.is_contiguous()
        ):
            seen.setdefault(id(weight), weight)
    return list(seen.values())


def _pass_cost_ms(model: nn.Module, repeats: int) -> float:
    """Fastest of ``repeats`` forward passes over each of ``TIMED_LENGTHS`` tokens, summed."""
    inputs = [torch.zeros(1, length, dtype=torch.long) for length in TIMED_LENGTHS]
    return sum(seconds_of(lambda: model(ids, use_cache=False), repeats=repeats) for ids in inputs) * 1e3


def _store(weights: list[nn.Parameter], column_major: bool) -> None:
    for w in weights:
        w.data = w.data.t().contiguous().t() if column_major else w.data.contiguous()


@torch.no_grad()
def tune_cpu_layout(model: nn.Module, repeats: int = 5, remember: bool = False) -> bool:
    """Store the model's ``nn.Linear`` weights column-major if that makes short passes faster on this CPU.

    Times forward passes over 1 and 8 tokens as stored, column-major, then as stored again (so that a machine
    getting busier or quieter meanwhile favours neither), and keeps column-major only when it is at least 10% faster.
    With ``remember``, the decision is kept in specula's store of measurements (:mod:`specula.machine.store`) and a
    decision already made for the same CPU, threads, torch build and weight shapes is reused instead of timing again
    (timing takes a few seconds; where other programs take the CPUs then, the weights stay as stored, not kept). The
    values and the ``Parameter`` objects stay the
    same, only their strides change (``save_pretrained`` writes them as before); results differ from the row-major
    layout only by float summation order. Returns whether weights were changed. Does nothing to a model that is not
    entirely on the CPU.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    weights = _row_major_linear_weights(model)
    if not weights:
        return False
    shapes = sorted({(tuple(w.shape), str(w.dtype)) for w in weights})
    key = store.key(weights[0].device, "cpu layout", *shapes)
    column_major = (
        store.shared().get(key, lambda: _decide(model, weights, repeats), busy=lambda: False)
        if remember
        else _decide(model, weights, repeats)
    )
    if column_major:
        _store(weights, column_major=True)
    return column_major


def _decide(model: nn.Module, weights: list[nn.Parameter], repeats: int) -> bool:
    """Whether column-major weights make passes over ``TIMED_LENGTHS`` tokens at least 10% cheaper."""
    before = _pass_cost_ms(model, repeats)
    _store(weights, column_major=True)
    transposed = _pass_cost_ms(model, repeats)
    _store(weights, column_major=False)
    return transposed < MIN_GAIN * (before + _pass_cost_ms(model, repeats)) / 2
