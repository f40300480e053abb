"""Linear layers that give each row of a multi-row pass the bits of that row alone.

Each ``nn.Linear`` (and GPT-2's ``Conv1D``) that gives a row other bits in a pass of several rows than alone computes
its rows in chunks as wide as it stays exact for (:func:`exact_rows`), as it is or by columns (:func:`_by_columns`),
whichever the clock finds cheaper: found once per machine, torch build and weight shape
(:mod:`specula.machine.store`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch
from transformers.pytorch_utils import Conv1D

from ...machine import store
from ...machine.memory import spare_bytes
from ...machine.timing import cheapest, seconds_of
from ..calibration import CALIBRATION_ROWS, TIMED_ROWS, spread
from ..support import is_quantized, weight_state


@torch.no_grad()
def exact_rows(
    layer: torch.nn.Module, compute: Callable | None = None, max_rows: int = CALIBRATION_ROWS, least: int = 1
) -> int:
    """The most rows (least..max_rows) that ``compute`` (default: ``layer`` itself) takes in one call and still gives
    each of them the bits ``layer`` gives that row alone (``least`` > 1: that ``compute`` gives it in a call of
    ``least`` rows), found on random rows.

    A kernel that sums in another order for another number of rows changes a bf16 output only where the fp32 sums
    straddle a rounding boundary: ~1 output in 5000 for an inner dimension of 1536 and Gaussian rows. So each width
    is tried on enough rows for 2**17 outputs, of magnitudes spread over 6 octaves
    (:func:`specula.verifier.calibration.spread`).
    """
    ordinary = functools.partial(type(layer).forward, layer)
    compute = compute or ordinary
    generator = torch.Generator().manual_seed(0)
    n = _in_features(layer)
    count = min(max(2**17 * n // layer.weight.numel(), 1), 2048)  # rows for 2**17 outputs
    x = spread((1, count + max_rows, n), generator, 6).to(layer.weight.device, layer.weight.dtype)
    alone = _in_chunks(ordinary if least == 1 else compute, least, x)
    rows = least
    while rows < max_rows:
        tried = -(-count // (rows + 1)) * (rows + 1)  # whole chunks of rows + 1
        if not torch.equal(_in_chunks(compute, rows + 1, x[:, :tried]), alone[:, :tried]):
            break
        rows += 1
    return rows


def _in_features(layer: torch.nn.Module) -> int:
    return layer.weight.shape[0] if isinstance(layer, Conv1D) else layer.in_features  # (Conv1D: [in, out])


def _in_chunks(compute: Callable, rows: int, x: torch.Tensor) -> torch.Tensor:
    """``compute`` on ``rows`` rows of ``x`` ([..., n, in]) at a time, each chunk a fresh tensor as in a one-token
    step."""
    if x.shape[-2] <= rows:
        return compute(x)
    return torch.cat([compute(x[..., i : i + rows, :].clone()) for i in range(0, x.shape[-2], rows)], dim=-2)


def _by_columns(weight_t: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t + bias`` computed as ``(weight_t.T @ x.T).T``: with ``weight_t`` ([in, out]) contiguous, the
    number of rows of ``x`` is the product's last dimension, which oneDNN does not block the inner sum by (used only
    where :func:`exact_rows` finds it exact on this machine; where it was found so: ``docs/hardware.md``)."""
    rows = x.reshape(-1, x.shape[-1]).t()  # [in, n]
    out = weight_t.t() @ rows if bias is None else torch.addmm(bias[:, None], weight_t.t(), rows)  # [out, n]
    return out.t().reshape(*x.shape[:-1], -1).contiguous()


def _weight_t(layer: torch.nn.Module) -> torch.Tensor:
    """``layer``'s weight as ``[in, out]``, contiguous (a copy where it is stored otherwise)."""
    weight = layer.weight.detach()
    weight_t = weight if isinstance(layer, Conv1D) else weight.t()
    return weight_t if weight_t.is_contiguous() else weight_t.contiguous()


def _calibrate(layer: torch.nn.Module) -> dict:
    """How ``layer`` computes a multi-row pass exactly: in chunks of the most rows that are exact as it is
    (``rows``), or by columns (:func:`_by_columns`, ``columns`` rows a chunk), whichever is cheaper for a pass of
    ``TIMED_ROWS`` rows (``by_columns``); with the milliseconds of each and of the ordinary product."""
    rows = exact_rows(layer)
    ordinary = functools.partial(type(layer).forward, layer)
    generator = torch.Generator().manual_seed(4)  # (never torch's global one: seeded sampling draws from it)
    x = torch.randn(1, TIMED_ROWS, _in_features(layer), generator=generator).to(layer.weight.device, layer.weight.dtype)
    found = {"rows": rows, "by_columns": False, "ordinary_ms": seconds_of(lambda: ordinary(x)) * 1e3}
    if rows == CALIBRATION_ROWS:
        return {**found, "exact_ms": found["ordinary_ms"]}
    if _packed(layer):  # (a quantized weight's product is its own: in chunks as it is)
        return {**found, "exact_ms": seconds_of(lambda: _in_chunks(ordinary, rows, x)) * 1e3}
    by_columns = functools.partial(_by_columns, _weight_t(layer), layer.bias)
    columns = exact_rows(layer, by_columns)
    strategies = {False: lambda: _in_chunks(ordinary, rows, x), True: lambda: _in_chunks(by_columns, columns, x)}
    choice = cheapest(strategies)
    return {**found, "columns": columns, "by_columns": choice, "exact_ms": seconds_of(strategies[choice]) * 1e3}


def _packed(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` computes its product its own way: its weight a tensor subclass holding other numbers
    (torchao's, optimum-quanto's quantized weights), or a forward of its own (a subclass of ``nn.Linear``)."""
    return type(layer).forward not in (torch.nn.Linear.forward, Conv1D.forward) or is_quantized(layer.weight)


def _weight_kind(layer: torch.nn.Module) -> tuple:
    """What a linear layer's calibration depends on besides the machine: its type, its weight's shape, layout and
    dtype (and type, where a subclass), and whether it has a bias."""
    weight = layer.weight
    return (
        type(layer).__name__,
        tuple(weight.shape),
        weight.stride(),
        weight.dtype,
        layer.bias is not None,
        *([type(weight).__name__] if is_quantized(weight) else []),
    )


def _linear_calibration(layer: torch.nn.Module) -> dict:
    """:func:`_calibrate` for ``layer``'s weight shape on this machine, made once and kept
    (:mod:`specula.machine.store`)."""
    return store.shared().get(store.key(layer.weight.device, "linear", *_weight_kind(layer)), lambda: _calibrate(layer))


def _needs_copy(layer: torch.nn.Module) -> bool:
    return isinstance(layer, torch.nn.Linear) and not layer.weight.t().is_contiguous()


class _ExactLinear:
    """A linear layer (``nn.Linear`` or GPT-2's ``Conv1D``) that gives a row of a multi-row pass other bits than
    alone, computed in chunks of ``rows`` rows that stay exact, by columns (with a column-major copy of a row-major
    weight, refreshed if the weight changes) where that is exact for more rows than the layer as it is."""

    def __init__(self, layer: torch.nn.Module, rows: int, by_columns: bool) -> None:
        self.layer, self.rows = layer, rows
        self.weight_t = _weight_t(layer) if by_columns else None
        self._source = weight_state(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(1, -1, x.shape[-1])  # [1, rows of every batch row, in]
        if self.weight_t is None:
            out = _in_chunks(functools.partial(type(self.layer).forward, self.layer), self.rows, flat)
        else:
            if weight_state(self.layer.weight) != self._source:
                self.weight_t, self._source = _weight_t(self.layer), weight_state(self.layer.weight)
            out = _in_chunks(functools.partial(_by_columns, self.weight_t, self.layer.bias), self.rows, flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def exact_linears(model: torch.nn.Module) -> tuple[list[_ExactLinear], list[_ExactLinear], int, tuple[float, float]]:
    """``model``'s linear layers as row-exact passes compute them: those a multi-row pass rounds otherwise; the
    others (exact as they are for up to ``CALIBRATION_ROWS`` rows, chunked only in passes wider than calibrated:
    batches); the bytes of the column-major weight copies made for the first; and the milliseconds of a pass's
    linear layers, exact and ordinary. The calibrations are checked once per weight shape."""
    layers = [module for module in model.modules() if isinstance(module, (torch.nn.Linear, Conv1D))]
    by_shape: dict[tuple, dict] = {}
    plans = []  # (layer, its calibration) of those a multi-row pass rounds otherwise
    plain = []  # the others
    for module in layers:
        shape = (*_weight_kind(module), module.weight.device)
        if shape not in by_shape:
            by_shape[shape] = _linear_calibration(module)
        if by_shape[shape]["rows"] < CALIBRATION_ROWS:
            plans.append((module, by_shape[shape]))
        else:
            plain.append(_ExactLinear(module, CALIBRATION_ROWS, False))
    copied = _copied_bytes(plans, next(model.parameters()).device)
    rounding = [
        _ExactLinear(layer, found["columns"], True)
        if found["by_columns"] and (copied or not _needs_copy(layer))
        else _ExactLinear(layer, found["rows"], False)
        for layer, found in plans
    ]
    calibrations = [_linear_calibration(module) for module in layers]
    milliseconds = tuple(sum(found[kind] for found in calibrations) for kind in ("exact_ms", "ordinary_ms"))
    return rounding, plain, copied, milliseconds


def _copied_bytes(plans: list[tuple[torch.nn.Module, dict]], device: torch.device) -> int:
    """The bytes of column-major copies of row-major weights, for the layers of ``plans`` computed by columns, where
    they pay, unless they would take half the spare memory (0 then, with a warning)."""
    copies = sum(layer.weight.nbytes for layer, found in plans if found["by_columns"] and _needs_copy(layer))
    spare = spare_bytes(device)
    copied = copies if spare is None or copies <= spare // 2 else 0
    if copies and not copied:
        warnings.warn(
            f"Row-exact verification would need column-major copies of {copies / 2**30:.1f} GiB of weights to be "
            "fast, more than half the free memory; it computes those layers row by row instead, which makes "
            "verification passes slow. Store the model's weights column-major "
            "(weight.data = weight.data.t().contiguous().t()) or pass exact=False.",
            stacklevel=4,  # (where RowExact is built)
        )
    return copied


@contextlib.contextmanager
def installed(linears: list[_ExactLinear]) -> Iterator[None]:
    """Within the block, the layer of each of ``linears`` computes as that :class:`_ExactLinear` does."""
    for linear in linears:
        linear.layer.forward = linear.forward
    try:
        yield
    finally:
        for linear in linears:
            del linear.layer.forward
