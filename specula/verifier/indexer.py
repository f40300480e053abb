"""Sparse attention verified as one-token steps select its keys.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2, dots3) lets each query attend only to the top-k
keys an indexer scores highest. The indexer scores a query against every key it may see, so a pass over several
tokens scores a ``[n, keys]`` block where a one-token step scores ``[1, keys so far]``: other shapes round otherwise,
and ``topk`` breaks ties (many scores are exactly 0 after its ReLU) otherwise, so the keys picked differ. Within a
verification pass the indexer is therefore called once per query, as the one-token step ``model.generate`` takes
calls it (:class:`PerQueryIndexers`); everything else in the pass still sees all its tokens at once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer

from .cache_names import cache_parameter
from .patching import forwards_replaced

# Models whose indexer already selects each query's keys on its own, as a one-token step does (by model_type).
PER_QUERY_ALREADY = dict.fromkeys(
    ["qwen4_exp", "qwen4_exp_text"], "its QSA indexer scores the key blocks of each query in a loop over queries"
)


class PerQueryIndexers:
    """The top-k indexers of a model (modules with an ``index_topk`` whose forward takes the cache), each called once
    per query within a pass after a filled cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.indexers = [module for module in model.modules() if _picks_top_k(module)]

    @staticmethod
    def needed(cache: DynamicCache) -> bool:
        return any(isinstance(layer, DynamicIndexedLayer) for layer in cache.layers)

    def covers(self, model: torch.nn.Module) -> bool:
        """Whether every indexer of the model selects keys per query with it (or on its own)."""
        return bool(self.indexers) or model.config.model_type in PER_QUERY_ALREADY

    def applied(self) -> contextlib.AbstractContextManager:
        """Within the block, every indexer call over several queries is split into one-query calls."""
        return forwards_replaced(
            self.indexers, lambda indexer, forward: functools.partial(_per_query, forward, indexer.index_topk)
        )


def _picks_top_k(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return (
        isinstance(getattr(module, "index_topk", None), int)
        and "attention_mask" in parameters
        and cache_parameter(parameters) is not None
    )


def _per_query(forward, top_k: int, *args, **kwargs) -> torch.Tensor:
    """``forward`` (an indexer's) over each query in turn, each seeing the keys up to its own.

    The indexer takes ``hidden_states`` ``[B, n, width]``, an ``attention_mask`` ``[B, n, past + n]`` and per-token
    tensors ``[B, n, ...]`` (tuples of them: the rotary ``(cos, sin)``), and returns the picked key indices
    ``[B, n, min(top_k, past + n)]``. Query ``t`` alone picks ``min(top_k, past + t + 1)``; where that is fewer, the
    row is filled up with the keys after it, which its causal mask hides anyway (a pass picks them too: their scores
    are -inf). E.g. top_k = 4, past = 2, n = 3: query 0 picks 3 of keys 0..2 and gets key 3 added, query 1 picks
    4 of 0..3 and query 2 picks 4 of 0..4.
    """
    arguments = inspect.signature(forward).bind(*args, **kwargs).arguments
    n = arguments["hidden_states"].shape[1]
    mask = arguments["attention_mask"]  # [B, n, past + n]
    if n == 1:
        return forward(**arguments)
    past, width = mask.shape[-1] - n, min(top_k, mask.shape[-1])
    picks = []
    for t in range(n):
        step = {name: _query(value, n, t) for name, value in arguments.items()}
        step["attention_mask"] = mask[:, t : t + 1, : past + t + 1]
        picked = forward(**step)  # [B, 1, min(top_k, past + t + 1)]
        later = torch.arange(
            past + t + 1, past + t + 1 + width - picked.shape[-1], device=picked.device, dtype=picked.dtype
        )
        picks.append(torch.cat([picked, later.expand(*picked.shape[:2], -1)], dim=-1))
    return torch.cat(picks, dim=1)


def _query(value, n: int, t: int):
    """Query ``t``'s part of an indexer argument: of tensors ``[B, n, ...]`` (alone or in a tuple), position ``t``."""
    if isinstance(value, tuple):
        return tuple(_query(item, n, t) for item in value)
    if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] == n:
        return value[:, t : t + 1]
    return value
