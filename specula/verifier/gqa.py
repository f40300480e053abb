"""Ordinary passes attend over a model's key/value heads without copying them, the cheapest way on this machine.

With grouped-query attention (fewer key/value heads than query heads) and a mask, as every pass over several tokens
after a filled cache has, transformers' SDPA function copies each key/value head once per query head that shares it
(``repeat_kv``) before calling the kernel: a copy of the layer's cache in every layer of every pass. Two ways compute
the same attention without it: SDPA over the heads as they are (``enable_gqa``), or the query heads of each
key/value head folded into one head of ``group x n`` queries (what transformers does for one-token steps with a
mask), which torch's CPU flash kernel computes in far fewer, larger blocks. A one-token step without a mask (one
request) transformers computes over the heads as they are; folded it can cost a quarter as much. Which way is
cheapest depends on the machine, the dtype and the pass (measurements: docs/hardware.md). So it is timed
once per head geometry, dtype and kind of pass (one query; several, one row or several) and kept with the
calibrations (:mod:`specula.machine.store`). Only ordinary passes on a CPU attend so (``CachedModel``): the
one-token steps of exact decoding stay ``model.generate``'s own, and row-exact passes compute attention their own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..machine import store
from ..machine.timing import cheapest
from .calibration import TIMED_KEYS, TIMED_ROWS

# Arguments of HF's SDPA function that change what it computes beyond masked attention: left to it.
_EXTRAS = ("position_bias", "cache", "softcap", "s_aux", "sinks")
TIMED_BATCH = 4  # rows of the timed passes of several rows


def _grouped(
    way: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """SDPA of ``query`` (``[B, heads, n, dim]``) over ``key`` and ``value`` as they are (``[B, kv_heads, keys,
    dim]``; ``mask``: ``[B, 1, n, keys]`` or ``None``), ``way`` "unrepeated" (``enable_gqa``) or "folded" (each
    key/value head's
    query heads as one head of their queries), in the layout transformers' attention functions return (``[B, n,
    heads, dim]``). Folded, query ``i`` of head ``kv * group + g`` is row ``g * n + i`` of head ``kv``, so the mask
    repeats whole: with 2 queries and 3 heads per group, rows 0-5 take the mask's rows 0, 1, 0, 1, 0, 1."""
    if way == "folded":
        batch, heads, n, dim = query.shape
        group = heads // key.shape[1]
        folded = query.reshape(batch, key.shape[1], group * n, dim)  # [B, kv_heads, group * n, dim]
        out = torch.nn.functional.scaled_dot_product_attention(  # (mask: [B, 1, group * n, keys])
            folded,
            key,
            value,
            attn_mask=None if mask is None else mask.repeat(1, 1, group, 1),
            scale=scaling,
        ).reshape(batch, heads, n, dim)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous()


def _way(module: torch.nn.Module, sdpa: Callable, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> str:
    """The cheapest way here for this head geometry and kind of pass: "repeated" (transformers' ``sdpa``),
    "unrepeated" or "folded", timed on ``TIMED_ROWS`` queries a row after ``TIMED_KEYS`` keys, one row or
    ``TIMED_BATCH``, or on one query without a mask (once per machine)."""
    queries = 1 if query.shape[2] == 1 else TIMED_ROWS
    rows = 1 if query.shape[0] == 1 else TIMED_BATCH
    geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device.type, scaling, rows, queries)
    ways = store.memo("grouped attention")  # this process's answers by head geometry and kind of pass
    if geometry not in ways:
        heads, kv_heads, dim, dtype = geometry[:4]

        def calibrate() -> str:
            generator = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(rows, h, length, dim, generator=generator).to(dtype)
                for h, length in ((heads, queries), (kv_heads, TIMED_KEYS), (kv_heads, TIMED_KEYS))
            )
            mask = None
            if queries > 1:
                mask = torch.ones(queries, TIMED_KEYS, dtype=torch.bool).tril(TIMED_KEYS - queries)
                mask = mask.expand(rows, 1, -1, -1)
            ways = ("folded",) if queries == 1 else ("unrepeated", "folded")  # (one query: transformers' is unrepeated)
            return cheapest(
                {
                    "repeated": lambda: sdpa(module, q, k, v, mask, scaling=scaling),
                    **{way: lambda way=way: _grouped(way, q, k, v, mask, scaling) for way in ways},
                }
            )

        key_name = store.key(query.device, "grouped attention", heads, kv_heads, dim, dtype, scaling, rows, queries)
        ways[geometry] = store.shared().get(key_name, calibrate)
    return ways[geometry]


@contextlib.contextmanager
def unrepeated_kv_heads() -> Iterator[None]:
    """Within the block, a model with ``sdpa`` attention on a CPU attends the cheapest way here (see the module
    docstring) in masked calls over several queries and in one-token steps without a mask; otherwise (a batch's
    one-token steps, which transformers folds itself, and every call with extras such as a position bias,
    softcapping or sinks) transformers' own SDPA function."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        # query: [B, heads, n, dim]; key, value: [B, kv_heads, keys, dim]; attention_mask: [B, 1, n, keys]
        way = "repeated"
        one_token_step = query.shape[2] == 1 and attention_mask is None and query.shape[0] == 1
        masked = attention_mask is not None and attention_mask.shape[1] == 1 and query.shape[2] > 1
        if (
            (one_token_step or masked)
            and query.shape[1] != key.shape[1]
            and not dropout
            and query.device.type == "cpu"
            and all(kwargs.get(name) is None for name in _EXTRAS)
        ):
            way = _way(module, sdpa, query, key, scaling)
        if way == "repeated":
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return _grouped(way, query, key, value, attention_mask, scaling), None

    with sdpa_as(attention):
        yield


@contextlib.contextmanager
def sdpa_as(attention: Callable) -> Iterator[None]:
    """Within the block, ``attention`` is the attention function of models with ``sdpa`` attention."""
    mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
    saved = mapping.get("sdpa")
    mapping["sdpa"] = attention
    try:
        yield
    finally:
        if saved is None:
            del mapping["sdpa"]
        else:
            mapping["sdpa"] = saved
