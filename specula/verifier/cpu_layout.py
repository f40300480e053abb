"""Weight layout for verification passes on a CPU.

``nn.Linear`` keeps its weight as ``(out_features, in_features)``, row-major, and computes ``x @ weight.T``. For
a few rows of ``x`` (a pass over the last token and a handful of draft tokens), MKL's kernel for that transposed
operand can re-read the weight for every two or three rows. Stored the other way round (the same values with
column-major strides, ``weight.t().contiguous().t()``) the weight is read once. Which layout is faster depends on
the CPU, the dtype and the BLAS build (measurements: ``docs/hardware.md``), so :func:`tune_cpu_layout` times the
model in both layouts and keeps the faster.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

TIMED_LENGTHS = (1, 8)  # a one-token step, and a pass over the last token and 7 draft tokens
MIN_GAIN = 0.9  # column-major must make the two together at least 10% cheaper


def _row_major_linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """Each distinct row-major 2-D floating-point ``nn.Linear`` weight once (tied weights share one entry)."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and weight.is_floating_point()
                and weight.dim() == 2 and weight.is_contiguous()):
            seen.setdefault(id(weight), weight)
    return list(seen.values())


def _pass_cost_ms(model: nn.Module, repeats: int) -> float:
    """Fastest of ``repeats`` forward passes over each of ``TIMED_LENGTHS`` tokens, summed (other work on the
    machine only ever adds time, so the minimum is the steadiest estimate)."""
    total = 0.0
    for length in TIMED_LENGTHS:
        ids = torch.zeros(1, length, dtype=torch.long)
        model(ids, use_cache=False)  # warm up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(ids, use_cache=False)
            times.append(time.perf_counter() - started)
        total += min(times) * 1e3
    return total


def _store(weights: list[nn.Parameter], column_major: bool) -> None:
    for w in weights:
        w.data = w.data.t().contiguous().t() if column_major else w.data.contiguous()


def _decision_key(weights: list[nn.Parameter]) -> str:
    """What the decision depends on: this CPU and its thread count, torch's build, the weights' shapes and dtypes."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    shapes = sorted({(tuple(w.shape), str(w.dtype)) for w in weights})
    return json.dumps([cpu, torch.get_num_threads(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
                       shapes])


def _read_decisions(path: Path | None) -> dict[str, bool]:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # none yet, or unreadable: decide again
        return {}


@torch.no_grad()
def tune_cpu_layout(model: nn.Module, repeats: int = 5, decisions: Path | None = None) -> bool:
    """Store the model's ``nn.Linear`` weights column-major if that makes short passes faster on this CPU.

    Times forward passes over 1 and 8 tokens as stored, column-major, then as stored again (so that a machine
    getting busier or quieter meanwhile favours neither), and keeps column-major only when it is at least 10% faster.
    With ``decisions`` (a JSON file), a decision already made for the same CPU, torch build and weight shapes is
    reused instead of timing again (timing takes a few seconds). The values and the ``Parameter`` objects stay the
    same, only their strides change (``save_pretrained`` writes them as before); results differ from the row-major
    layout only by float summation order. Returns whether weights were changed. Does nothing to a model that is not
    entirely on the CPU.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    weights = _row_major_linear_weights(model)
    if not weights:
        return False
    key = _decision_key(weights)
    known = _read_decisions(decisions)
    if key in known:
        column_major = known[key]
    else:
        before = _pass_cost_ms(model, repeats)
        _store(weights, column_major=True)
        transposed = _pass_cost_ms(model, repeats)
        _store(weights, column_major=False)
        column_major = transposed < MIN_GAIN * (before + _pass_cost_ms(model, repeats)) / 2
        if decisions is not None:
            decisions.parent.mkdir(parents=True, exist_ok=True)
            decisions.write_text(json.dumps({**known, key: column_major}, indent=1))
    if column_major:
        _store(weights, column_major=True)
    return column_major
