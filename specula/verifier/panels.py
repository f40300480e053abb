"""fp32 linear layers computed from their weights laid out in panels of 16 outputs, by a kernel of specula's own.

A verification pass or a one-token step multiplies a few rows by each weight: bound by reading the weight, not by
arithmetic. The BLAS and oneDNN kernels torch calls are made for wide products, and for a few rows read the weights
at about half the speed the memory allows on some CPUs (the 2-core AVX2 EPYC: docs/hardware.md). :func:`panel_matmul`
reads a weight once a call, as :func:`panels` lays it out (each 16 outputs' weights, input by input, contiguous: one
stream the CPU's prefetchers follow), and sums each output over its inputs in order, four rows at a time against one
panel, or one row against four panels: a row's sums are the same whatever the rows beside it. Summed in another order
than the layer's own product (as another BLAS would: ordinary verification's rounding, docs/exactness.md), so only
ordinary fp32 passes and steps take it, where it is faster on the machine (:mod:`specula.verifier.packed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from .threads import kernel_threads

WIDE = 16  # outputs a panel holds (two AVX2 vectors of fp32)
BLOCK = 4  # rows summed together against one panel, or panels against one row (4 x 16 sums in registers)


class Panels(NamedTuple):
    """An fp32 weight (``[out, in]``) as panels (``[ceil(out / 16), in, 16]``, the last padded with zeros), the same
    weight packed for oneDNN (``None``: not), and its most rows: wider products are oneDNN's or the layer's own (the
    kernel's cost grows with the rows, a matrix product's hardly)."""

    panels: torch.Tensor
    outputs: int
    wider: torch.Tensor | None = None
    most_rows: int | None = None


def panels(weight: torch.Tensor) -> Panels:
    """``weight`` (``[out, in]`` fp32) laid out in panels of :data:`WIDE` outputs."""
    outputs, inputs = weight.shape
    count = -(-outputs // WIDE)
    padded = torch.zeros(count * WIDE, inputs, dtype=torch.float32)
    padded[:outputs] = weight.detach()
    return Panels(padded.view(count, WIDE, inputs).transpose(1, 2).contiguous(), outputs)


def panel_forward(
    weight: Panels, bias: torch.Tensor | None, own: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer's forward computing its fp32 rows (up to ``weight.most_rows`` of them) with
    :func:`panel_matmul`, else as ``own`` (oneDNN's with ``weight.wider``, or the layer's own forward)."""
    laid_out = weight.panels.numpy()

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [rows, in]
        if x.dtype != torch.float32 or (weight.most_rows is not None and len(rows) > weight.most_rows):
            return own(x)
        out = torch.empty(len(rows), weight.outputs)  # [rows, out]
        with kernel_threads():
            panel_matmul(rows.contiguous().numpy(), laid_out, out.numpy())
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.outputs)

    return forward


@intrinsic
def _sums(typingctx):
    """A pointer to :data:`BLOCK` x :data:`WIDE` fp32 on the stack, which the compiler may hold in registers, as it
    never would heap memory a loop writes."""

    def codegen(context, builder, signature, args):
        size = context.get_constant(types.intp, BLOCK * WIDE)
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=size)

    return types.CPointer(types.float32)(), codegen


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def panel_matmul(x: np.ndarray, laid_out: np.ndarray, out: np.ndarray) -> None:
    """``out[m, 16 * p + j] = sum over k of x[m, k] * laid_out[p, k, j]``, summed in the order of ``k`` (``x``:
    ``[rows, in]``, ``laid_out``: ``[panels, in, 16]``, ``out``: ``[rows, out]``, all fp32; ``out`` may be narrower
    than the panels: their padding is not written). Each thread takes groups of :data:`BLOCK` panels: four rows at a
    time against each panel of the group (each weight read once for four rows), then each row left against the four
    panels together.

    Worked example, one panel of two inputs, its first two outputs' weights ``[1, 3]`` and ``[-1, 0]``::

        x = [[1, 2]], laid_out[0] = [[1, -1, 0, ..], [3, 0, 0, ..]]
        out[0, 0] = 1 * 1 + 2 * 3 = 7.0
        out[0, 1] = 1 * -1 + 2 * 0 = -1.0
        -> out = [[7.0, -1.0]] (out holding two outputs)
    """
    rows, inner = x.shape
    count, outputs = laid_out.shape[0], out.shape[1]
    for group in prange(-(-count // BLOCK)):
        first = group * BLOCK
        held = min(BLOCK, count - first)
        sums = carray(_sums(), (BLOCK, WIDE))
        m = 0
        while m + BLOCK <= rows:
            for p in range(first, first + held):
                panel = laid_out[p]
                for j in range(WIDE):
                    sums[0, j] = sums[1, j] = sums[2, j] = sums[3, j] = np.float32(0.0)
                for k in range(inner):
                    x0, x1, x2, x3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
                    for j in range(WIDE):
                        w = panel[k, j]
                        sums[0, j] += x0 * w
                        sums[1, j] += x1 * w
                        sums[2, j] += x2 * w
                        sums[3, j] += x3 * w
                for i in range(BLOCK):
                    for j in range(min(WIDE, outputs - p * WIDE)):
                        out[m + i, p * WIDE + j] = sums[i, j]
            m += BLOCK
        while m < rows:
            for q in range(BLOCK):
                for j in range(WIDE):
                    sums[q, j] = np.float32(0.0)
            if held == BLOCK:
                p0, p1, p2, p3 = laid_out[first], laid_out[first + 1], laid_out[first + 2], laid_out[first + 3]
                for k in range(inner):
                    xk = x[m, k]
                    for j in range(WIDE):
                        sums[0, j] += xk * p0[k, j]
                        sums[1, j] += xk * p1[k, j]
                        sums[2, j] += xk * p2[k, j]
                        sums[3, j] += xk * p3[k, j]
            else:
                for q in range(held):
                    panel = laid_out[first + q]
                    for k in range(inner):
                        xk = x[m, k]
                        for j in range(WIDE):
                            sums[q, j] += xk * panel[k, j]
            for q in range(held):
                p = first + q
                for j in range(min(WIDE, outputs - p * WIDE)):
                    out[m, p * WIDE + j] = sums[q, j]
            m += 1
