"""Ordinary passes attend over a model's key/value heads without copying them, the cheapest way on this machine.

With grouped-query attention (fewer key/value heads than query heads) and a mask, as every pass over several tokens
after a filled cache has, transformers' SDPA function copies each key/value head once per query head that shares it
(``repeat_kv``) before calling the kernel: a copy of the layer's cache in every layer of every pass. Two ways compute
the same attention without it: SDPA over the heads as they are (``enable_gqa``), or the query heads of each
key/value head folded into one head of ``group x n`` queries (what transformers does for one-token steps with a
mask), which torch's CPU flash kernel computes in far fewer, larger blocks. A one-token step without a mask (one
request) transformers computes over the heads as they are; folded it can cost a quarter as much. A fourth way reads
each key/value head once for all its queries in a kernel of specula's own (:mod:`.attend`, bf16 and fp32), for
a batch's one-token steps too. Which way is cheapest depends on the machine, the dtype and the pass (measurements:
docs/hardware.md). So it is timed once per head geometry, dtype and kind of pass (one query; several, one row or
several) and kept with the calibrations (:mod:`specula.machine.store`). Only ordinary passes on a CPU attend so
(``CachedModel``): the one-token steps of exact decoding stay ``model.generate``'s own, and row-exact passes compute
attention their own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..machine import store
from ..machine.timing import cheapest
from .attend import applies, attend, visibility
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
    "unrepeated", "folded" or "kernel" (specula's, where it applies: :mod:`.attend`), timed on ``TIMED_ROWS`` queries
    a row after ``TIMED_KEYS`` keys, one row or ``TIMED_BATCH``, or on one query a row (once per machine)."""
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
            mask = None  # (one request's step: none)
            if queries > 1 or rows > 1:
                mask = torch.ones(queries, TIMED_KEYS, dtype=torch.bool).tril(TIMED_KEYS - queries)
                mask = mask.expand(rows, 1, -1, -1)
            # one request's step: transformers' is unrepeated; a batch's steps it folds itself
            ways = ("unrepeated", "folded") if queries > 1 else ("folded",) if rows == 1 else ()
            seen = visibility(mask, rows, queries, TIMED_KEYS)
            return cheapest(
                {
                    "repeated": lambda: sdpa(module, q, k, v, mask, scaling=scaling),
                    **{way: lambda way=way: _grouped(way, q, k, v, mask, scaling) for way in ways},
                    **({"kernel": lambda: attend(q, k, v, seen, scaling)} if applies(q, k, v) else {}),
                }
            )

        key_name = store.key(
            query.device, "grouped attention, specula's kernel too", heads, kv_heads, dim, dtype, scaling, rows, queries
        )
        ways[geometry] = store.shared().get(key_name, calibrate)
    return ways[geometry]


@contextlib.contextmanager
def unrepeated_kv_heads() -> Iterator[None]:
    """Within the block, a model with ``sdpa`` attention on a CPU attends the cheapest way here (see the module
    docstring) in masked calls (a batch's one-token steps among them) and in one-token steps without a mask; otherwise
    (every call with extras such as a position bias, softcapping or sinks) transformers' own SDPA function."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen: dict[tuple, tuple[torch.Tensor | None, tuple]] = {}  # (id(mask), shape): the mask, its visibility

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        # query: [B, heads, n, dim]; key, value: [B, kv_heads, keys, dim]; attention_mask: [B, 1, n, keys]
        way = "repeated"
        batch, _, n, _ = query.shape
        one_token_step = n == 1 and attention_mask is None and batch == 1
        masked = attention_mask is not None and attention_mask.shape[1] == 1 and attention_mask.dtype == torch.bool
        if (
            (one_token_step or masked)
            and query.shape[1] != key.shape[1]
            and not dropout
            and query.device.type == "cpu"
            and all(kwargs.get(name) is None for name in _EXTRAS)
        ):
            way = _way(module, sdpa, query, key, scaling)
        if way == "kernel" and applies(query, key, value):
            memo = (id(attention_mask), batch, n, key.shape[2])
            if memo not in seen:  # (once for all the layers of a pass)
                seen[memo] = (attention_mask, visibility(attention_mask, batch, n, key.shape[2]))
            return attend(query, key, value, seen[memo][1], scaling), None
        if way in ("repeated", "kernel"):
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
