"""Rolling back recurrent state: the conv and scan states of Mamba/SSM layers, linear-attention memories.

A KV cache is rolled back by forgetting its last entries; a recurrent layer keeps one state that every token has
updated, and transformers' cache layers for them (``LinearAttentionCacheLayerMixin``) cannot crop it. So before a
verification pass the states of those layers are kept (:func:`snapshot`: one state per layer, small next to a KV
cache), and when drafts were rejected the pass is undone (:func:`restore`) and the accepted tokens fed again
(:meth:`specula.target.runner.CachedModel.rollback`): the state is then the state after the last accepted token,
computed from the same tokens as the pass computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin


@dataclass
class Snapshot:
    """The recurrent states of a cache's layers at one point: ``states[(layer, state, kind)]``, kind ``"conv"`` or
    ``"recurrent"``."""

    states: dict[tuple[int, int, str], torch.Tensor]


def has_recurrent_state(cache: DynamicCache) -> bool:
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def snapshot(cache: DynamicCache) -> Snapshot:
    """Copies of every recurrent layer's conv and scan states, as they are now."""
    states = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for state in range(layer.number_of_states):
                for kind, held in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                    if held[state] is not None:
                        states[(index, state, kind)] = held[state].clone()
    return Snapshot(states)


def restore(cache: DynamicCache, kept: Snapshot) -> None:
    """Put back the states of :func:`snapshot` (in place where the shape is the same: the state tensors keep their
    address, as transformers keeps it for CUDA graphs)."""
    for (index, state, kind), tensor in kept.states.items():
        layer = cache.layers[index]
        held = layer.conv_states if kind == "conv" else layer.recurrent_states
        if held[state] is not None and held[state].shape == tensor.shape:
            held[state].copy_(tensor)
        else:
            held[state] = tensor.clone()
