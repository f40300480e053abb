"""Ordinary verification passes attend over a model's key/value heads as they are, not repeated.

With grouped-query attention (fewer key/value heads than query heads) and a mask, as every pass over several tokens
after a filled cache has, transformers' SDPA function copies each key/value head once per query head that shares it
(``repeat_kv``) before calling the kernel: a copy of the layer's cache in every layer of every pass. SDPA computes
the same attention without it (``enable_gqa``): on a 2-core AVX2 EPYC (fp32, 9 query heads over 3 key/value heads
of 64, 8 queries after 661 keys) 0.50 ms a layer with the copies, 0.34 ms without, and the same bits. One-token steps
have no copy to save (transformers folds their query heads), so only ordinary passes over several tokens on a CPU
attend so (``CachedModel``), and only for head geometries where it is faster on this machine (timed once, kept with
the calibrations: :mod:`specula.verifier.calibration`). Row-exact passes compute attention their own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import calibration
from .calibration import TIMED_KEYS, TIMED_ROWS, calibration_key, cheapest

# Arguments of HF's SDPA function that change what it computes beyond masked attention: left to it.
_EXTRAS = ("position_bias", "cache", "softcap", "s_aux", "sinks")
_FASTER: dict[tuple, bool] = {}  # this process's answers by head geometry (the calibrations file keeps them)


def _unrepeated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                scaling: float | None) -> torch.Tensor:
    """SDPA over ``key`` and ``value`` as they are (``[B, kv_heads, keys, dim]``; ``query``: ``[B, heads, n, dim]``),
    in the layout transformers' attention functions return (``[B, n, heads, dim]``)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _faster(module: torch.nn.Module, sdpa: Callable, query: torch.Tensor, key: torch.Tensor,
            scaling: float | None) -> bool:
    """Whether attention over unrepeated key/value heads is faster than ``sdpa`` (transformers') here for this head
    geometry, timed on ``TIMED_ROWS`` queries after ``TIMED_KEYS`` keys (once per machine)."""
    geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device.type, scaling)
    if geometry not in _FASTER:
        heads, kv_heads, dim, dtype, _, _ = geometry

        def calibrate() -> bool:
            generator = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, h, rows, dim, generator=generator).to(dtype)
                       for h, rows in ((heads, TIMED_ROWS), (kv_heads, TIMED_KEYS), (kv_heads, TIMED_KEYS)))
            mask = torch.ones(TIMED_ROWS, TIMED_KEYS, dtype=torch.bool).tril(TIMED_KEYS - TIMED_ROWS)[None, None]
            return cheapest({"repeated": lambda: sdpa(module, q, k, v, mask, scaling=scaling),
                             "unrepeated": lambda: _unrepeated(q, k, v, mask, scaling)}) == "unrepeated"

        key_name = calibration_key(query.device, "unrepeated kv heads", heads, kv_heads, dim, dtype, scaling)
        _FASTER[geometry] = calibration.shared().get(key_name, calibrate)
    return _FASTER[geometry]


@contextlib.contextmanager
def unrepeated_kv_heads() -> Iterator[None]:
    """Within the block, a model with ``sdpa`` attention attends over its key/value heads as they are wherever
    a masked call on a CPU over several queries would repeat them and that is faster here; otherwise (and for
    every call with extras such as a position bias, softcapping or sinks) transformers' own SDPA function."""
    mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
    saved = mapping.get("sdpa")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        # query: [B, heads, n, dim]; key, value: [B, kv_heads, keys, dim]; attention_mask: [B, 1, n, keys]
        if (attention_mask is None or query.shape[2] == 1 or query.shape[1] == key.shape[1] or dropout
                or query.device.type != "cpu" or any(kwargs.get(name) is not None for name in _EXTRAS)
                or not _faster(module, sdpa, query, key, scaling)):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return _unrepeated(query, key, value, attention_mask, scaling), None

    mapping["sdpa"] = attention
    try:
        yield
    finally:
        if saved is None:
            del mapping["sdpa"]
        else:
            mapping["sdpa"] = saved
