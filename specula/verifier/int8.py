"""Linear layers holding int8 weight-only weights (torchao's, optimum-quanto's), computed from their int8 numbers on a
CPU.

torchao's ``Int8WeightOnlyConfig`` keeps a linear layer's weight as int8 rows with a scale each, and computes every
product by first converting the whole weight to the activations' dtype, at each call (optimum-quanto's ``qint8``
likewise in fp32, scaled first): on a CPU, where decoding is bound by reading weights, a one-token step then reads
and writes five bytes a weight where one holds its number. :func:`int8_matmul` reads each weight once, as int8, and
sums in fp32: the products the layer computes, summed in another order (as another BLAS would: ordinary
verification's rounding, docs/exactness.md; bf16 and fp16 activations summed in fp32). Verification passes and
ordinary decoding's steps take it where it is faster on the machine (:mod:`specula.verifier.packed`); prefills,
row-exact passes and the model's own ``generate`` keep the layer's product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from numba import njit, prange

from .threads import kernel_threads

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the activations (summed in fp32)


class Int8Weight(NamedTuple):
    """A weight's int8 numbers (``[out, in]``, contiguous) and fp32 scales (``[out]``), and its most rows: wider
    products are the layer's own (the kernel's cost grows with the rows, a matrix product's hardly)."""

    numbers: torch.Tensor
    scales: torch.Tensor
    most_rows: int | None = None


def int8_weight(weight: torch.Tensor) -> Int8Weight | None:
    """``weight``'s int8 numbers and scales where it is torchao's int8 weight-only weight (``Int8Tensor``: one scale
    a row, zero points none or 0, activations not quantized) or optimum-quanto's (``WeightQBytesTensor`` of
    ``qint8``, a scale a row) of an fp32, bf16 or fp16 layer on the CPU; ``None`` for any other."""
    kind = type(weight)
    if kind.__name__ == "Int8Tensor" and kind.__module__.startswith("torchao."):
        numbers, scales = getattr(weight, "qdata", None), getattr(weight, "scale", None)
        zero = getattr(weight, "zero_point", None)
        if (
            list(getattr(weight, "block_size", [])) != [1, weight.shape[-1]]
            or any(getattr(weight, name, None) is not None for name in ("act_quant_kwargs", "act_pre_scale"))
            or (zero is not None and bool(torch.any(zero)))
        ):
            return None
    elif kind.__name__ == "WeightQBytesTensor" and kind.__module__.startswith("optimum.quanto."):
        numbers, scales = getattr(weight, "_data", None), getattr(weight, "_scale", None)
        if str(getattr(weight, "qtype", None)) != "quanto.qint8" or getattr(weight, "axis", None) != 0:
            return None
    else:
        return None
    if (
        weight.dtype not in DTYPES
        or not isinstance(numbers, torch.Tensor)
        or numbers.dtype != torch.int8
        or numbers.dim() != 2
        or numbers.device.type != "cpu"
        or not isinstance(scales, torch.Tensor)
        or scales.numel() != numbers.shape[0]
    ):
        return None
    return Int8Weight(numbers.contiguous(), scales.detach().reshape(-1).float().contiguous())


def int8_forward(
    weight: Int8Weight, bias: torch.Tensor | None, own: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer's forward computing its rows (up to ``weight.most_rows`` of them) with :func:`int8_matmul`,
    else as ``own``, the layer's own forward (bf16 and fp16 rows summed in fp32, rounded once)."""
    numbers, scales = weight.numbers.numpy(), weight.scales.numpy()

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [rows, in]
        if x.dtype not in DTYPES or (weight.most_rows is not None and len(rows) > weight.most_rows):
            return own(x)
        out = torch.empty(len(rows), len(numbers))  # [rows, out]
        with kernel_threads():
            int8_matmul(rows.float().contiguous().numpy(), numbers, scales, out.numpy())
        out = out.to(x.dtype)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], len(numbers))

    return forward


@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"})
def int8_matmul(x: np.ndarray, numbers: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """``out[m, n] = (sum over k of x[m, k] * numbers[n, k]) * scales[n]`` in fp32 (``x``: ``[rows, in]`` fp32,
    ``numbers``: ``[out, in]`` int8, ``scales``: ``[out]`` fp32, ``out``: ``[rows, out]`` fp32). Each weight row is
    converted once, into fp32 beside the core summing it, and summed against four rows of ``x`` at a time (the rows'
    sums in one loop: each converted weight read once for four products).

    Worked example::

        x = [[1, 2]], numbers = [[1, -1], [3, 0]], scales = [0.5, 2]
        out[0, 0] = (1 * 1 + 2 * -1) * 0.5 = -0.5
        out[0, 1] = (1 * 3 + 2 * 0) * 2 = 6.0
        -> out = [[-0.5, 6.0]]
    """
    rows, inner = x.shape
    for n in prange(numbers.shape[0]):
        weight = np.empty(inner, np.float32)
        for k in range(inner):
            weight[k] = numbers[n, k]
        m = 0
        while m + 4 <= rows:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(inner):
                w = weight[k]
                a0 += x[m, k] * w
                a1 += x[m + 1, k] * w
                a2 += x[m + 2, k] * w
                a3 += x[m + 3, k] * w
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = (
                a0 * scales[n],
                a1 * scales[n],
                a2 * scales[n],
                a3 * scales[n],
            )
            m += 4
        while m < rows:
            a0 = np.float32(0.0)
            for k in range(inner):
                a0 += x[m, k] * weight[k]
            out[m, n] = a0 * scales[n]
            m += 1
