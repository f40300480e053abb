"""Rolling back recurrent state: the conv and scan states of Mamba/SSM layers, linear-attention memories.

A KV cache is rolled back by forgetting its last entries; a recurrent layer keeps one state that every token has
updated, and transformers' cache layers for them (``LinearAttentionCacheLayerMixin``) cannot crop it. So before a
verification pass the states of those layers are kept (:func:`snapshot`: one state per layer, small next to a KV
cache), and when drafts were rejected the pass is undone (:func:`restore`) and the accepted tokens fed again
(:meth:`specula.verifier.runner.OneSequence.rollback`): the state is then the state after the last accepted token,
computed from the same tokens as the pass computed it. Or the pass computes the recurrent layers one token at a
time and keeps the state after each (:class:`Stepwise`): no second pass, and each token computed as a one-token step
computes it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from .cache_names import cache_parameter
from .patching import forwards_replaced


@dataclass
class Snapshot:
    """The recurrent states of a cache's layers at one point: ``states[layer]``, see :func:`_layer_states`."""

    states: dict[int, dict[tuple[str, int], torch.Tensor]]


def has_recurrent_state(cache: DynamicCache) -> bool:
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def snapshot(cache: DynamicCache) -> Snapshot:
    """Copies of every recurrent layer's conv and scan states, as they are now."""
    return Snapshot(
        {
            index: _layer_states(layer)
            for index, layer in enumerate(cache.layers)
            if isinstance(layer, LinearAttentionCacheLayerMixin)
        }
    )


def restore(cache: DynamicCache, kept: Snapshot) -> None:
    """Put back the states of :func:`snapshot`."""
    for index, states in kept.states.items():
        _put_layer_states(cache.layers[index], states)


def _layer_states(layer: LinearAttentionCacheLayerMixin) -> dict[tuple[str, int], torch.Tensor]:
    """Copies of a recurrent cache layer's states: ``{("conv" or "recurrent", state index): tensor}``."""
    return {
        (kind, state): held[state].clone()
        for kind, held in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states))
        for state in range(layer.number_of_states)
        if held[state] is not None
    }


def _put_layer_states(layer: LinearAttentionCacheLayerMixin, states: dict[tuple[str, int], torch.Tensor]) -> None:
    """Put back :func:`_layer_states` (in place where the shape is the same: the state tensors keep their address, as
    transformers keeps it for CUDA graphs)."""
    for (kind, state), tensor in states.items():
        held = layer.conv_states if kind == "conv" else layer.recurrent_states
        if held[state] is not None and held[state].shape == tensor.shape:
            held[state].copy_(tensor)
        else:
            held[state] = tensor.clone()


# Models whose pass over several tokens after a filled cache computes their recurrent layers otherwise than one-token
# steps do (found by the architecture sweep): their recurrent layers are always verified step by step
# (:class:`Stepwise`).
STEP_BY_STEP = {
    **dict.fromkeys(
        ["mamba", "falcon_mamba", "jamba", "zamba"], "a Mamba-1 scan over several tokens starts from a zero state"
    ),
    **dict.fromkeys(
        ["nemotron_h", "zamba2"], "a Mamba-2 scan over several tokens clamps the time step, a one-token step does not"
    ),
    "recurrent_gemma": "a pass over several tokens convolves without the cached conv state",
}


class Stepwise:
    """The recurrent layers of a verification pass computed one token at a time, each token by the one-token step
    ``model.generate`` takes, keeping every layer's state after every token; a rollback puts back the state after the
    last token kept. Attention and everything else in the pass still sees all its tokens at once.

    What it costs: the recurrent layers' own work once per token instead of once per pass (their input and output
    projections excepted: :func:`_projected_once`, :class:`_OutputOnce`); no second pass after a rejected draft. What
    it buys: passes exactly as one-token steps compute them where a layer's multi-token form differs
    (:data:`STEP_BY_STEP`) or rounds otherwise (bf16/fp16).

    The recurrent layers are the modules that compute a recurrent layer of the cache (Mamba, Mamba-2, gated delta
    nets ...: :func:`_cache_mixer`) and RecurrentGemma's recurrent blocks (their states live on the module).
    """

    def __init__(self, model: torch.nn.Module, cache: DynamicCache) -> None:
        recurrent = [module for module in model.modules() if _cache_mixer(module, cache) or _keeps_own_state(module)]
        # the innermost (Mamba's blocks take the cache too, to hand it to their mixer)
        self.mixers = [
            module
            for module in recurrent
            if not any(inner in recurrent for inner in module.modules() if inner is not module)
        ]
        self.states: list[list] | None = None  # [mixer][t]: its states after the first t tokens of the last pass

    def covers(self, cache: DynamicCache) -> bool:
        """Whether it finds a recurrent layer for every recurrent layer of ``cache`` (Zaya's keeps its state in its
        attention's projection, which it does not)."""
        return len(self.mixers) == sum(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)

    def rows_of(self, cache: DynamicCache) -> str | None:
        """Why its states cannot be held as batch rows (:class:`RecurrentRows`), or ``None`` where they can."""
        if not self.covers(cache):
            return "some of its recurrent layers cannot be computed one token at a time"
        if any(_keeps_own_state(mixer) for mixer in self.mixers):
            return "its recurrent layers keep their states on the modules, not in the cache"
        return None

    @contextlib.contextmanager
    def applied(self, cache: DynamicCache, parents: list[list[int]] | None = None) -> Iterator[None]:
        """Within the block, every call of a recurrent layer is split into one-token calls. ``parents[b][t]``, where
        given (trees of drafts), is the token of row ``b``'s block whose state token ``t`` follows (-1: the state
        before the pass); else each token follows the one before."""
        self.states = [[] for _ in self.mixers]
        states = dict(zip(self.mixers, self.states))
        with forwards_replaced(
            self.mixers,
            lambda mixer, forward: functools.partial(self._steps, forward, mixer, cache, states[mixer], parents),
        ):
            yield

    @staticmethod
    def _steps(
        forward,
        mixer: torch.nn.Module,
        cache: DynamicCache,
        states: list,
        parents: list[list[int]] | None,
        /,
        *args,
        **kwargs,
    ):
        """``forward`` over each token in turn, each from its parent's state; ``states[t + 1]``: the layer's states
        after token t (``states[0]``: before the pass)."""
        hidden = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
        n = hidden.shape[1]  # hidden states: [batch, n, width]

        def one(value, t):
            return (
                value[:, t : t + 1]
                if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] == n
                else value
            )

        states.append(_read(mixer, cache))
        outputs, projection = [], _OutputOnce(mixer, hidden.shape[-1])
        with projection.installed(), _projected_once(mixer, hidden):
            for t in range(n):
                follows = [row[t] for row in parents] if parents is not None else None  # [B]
                if follows is not None and any(parent != t - 1 for parent in follows):  # (a branch starts)
                    _write(mixer, cache, _of_rows(states, [parent + 1 for parent in follows]))
                outputs.append(
                    forward(*(one(value, t) for value in args), **{key: one(value, t) for key, value in kwargs.items()})
                )
                states.append(_read(mixer, cache))
                if t == 0:
                    projection.find(outputs[0])
        outputs = projection.filled(outputs)
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs, dim=1)
        return (torch.cat([output[0] for output in outputs], dim=1), *outputs[-1][1:])  # (RecurrentGemma: (out, None))

    def put_back(self, cache: DynamicCache, kept: int | list[int]) -> None:
        """Every recurrent layer's state after the first ``kept`` tokens of the last pass; in a batch, row ``b``'s
        after its first ``kept[b]`` (the tokens after a row's block, padding, are so forgotten too; of a tree, the
        state after its last accepted token is the state after as many tokens as it is the block's)."""
        for mixer, states in zip(self.mixers, self.states):
            _write(mixer, cache, states[kept] if isinstance(kept, int) else _of_rows(states, kept))
        self.states = None

    def tokens(self) -> int:
        """How many tokens the last pass computed step by step (0: none since the last rollback)."""
        return len(self.states[0]) - 1 if self.states and self.states[0] else 0

    def forget(self) -> None:
        self.states = None


def _projected_once(mixer: torch.nn.Module, hidden: torch.Tensor) -> contextlib.AbstractContextManager:
    """Within the block, the linear layers of ``mixer`` that a step feeds its own input (``hidden[:, t:t+1]`` of
    ``hidden``: ``[B, n, width]``) compute all ``n`` rows at the first step and serve each step its row: one pass over
    their weights instead of one per token (what the pass's other linear layers do; row-exact verification makes those
    rows exact where it is on). A layer fed anything else (the input masked, normed ...) computes as it is."""
    linears = [
        module
        for module in mixer.modules()
        if isinstance(module, torch.nn.Linear) and module.in_features == hidden.shape[-1]
    ]
    return forwards_replaced(linears, lambda linear, forward: functools.partial(_row_served, forward, hidden, []))


def _row_served(forward, hidden: torch.Tensor, computed: list, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)``, taken from ``forward(hidden)`` (computed once, kept in ``computed``) where ``x`` is a row of
    ``hidden`` (the same memory: a slice ``hidden[:, t:t+1]``)."""
    offset = x.data_ptr() - hidden.data_ptr()
    step = hidden.stride(1) * hidden.element_size()
    if (
        x.shape != (hidden.shape[0], 1, hidden.shape[2])
        or x.stride() != hidden.stride()
        or offset % step
        or not 0 <= offset // step < hidden.shape[1]
    ):
        return forward(x)
    if not computed:
        computed.append(forward(hidden))
    t = offset // step
    return computed[0][:, t : t + 1]


class _OutputOnce:
    """A recurrent layer's output projection (the linear layer whose output, unchanged, the layer returns) computed
    for all of a pass's tokens at once after its last step, instead of once per token. The first step finds it (a
    linear layer of the layer, mapping to its ``width``, called once, whose output is what the step returned); later
    steps get a placeholder from it, which the layer only returns, and :meth:`filled` puts the computed rows there."""

    def __init__(self, mixer: torch.nn.Module, width: int) -> None:
        self.linears = [
            module for module in mixer.modules() if isinstance(module, torch.nn.Linear) and module.out_features == width
        ]
        self.first: dict[
            torch.nn.Module, list
        ] = {}  # the first step's calls: layer -> [output, its copy, forward, calls]
        self.found: torch.nn.Module | bool | None = None  # (None: not looked for yet; False: none)
        self.inputs: list[torch.Tensor] = []  # its inputs in the later steps: [B, 1, in_features] each

    def installed(self) -> contextlib.AbstractContextManager:
        return forwards_replaced(self.linears, lambda linear, forward: functools.partial(self._call, linear, forward))

    def _call(self, linear: torch.nn.Module, forward, x: torch.Tensor) -> torch.Tensor:
        if self.found is None:  # the first step
            output = forward(x)
            calls = self.first[linear][3] + 1 if linear in self.first else 1
            self.first[linear] = [output, output.clone(), forward, calls]
            return output
        if linear is not self.found:
            return forward(x)
        self.inputs.append(x)
        return x.new_empty((*x.shape[:-1], linear.out_features))

    def find(self, returned) -> None:
        """After the first step, which ``returned`` this."""
        returned = returned if isinstance(returned, torch.Tensor) else returned[0]
        self.found = next(
            (
                linear
                for linear, (output, copy, _, calls) in self.first.items()
                if output is returned and calls == 1 and torch.equal(output, copy)
            ),
            False,
        )

    def filled(self, outputs: list) -> list:
        """The steps' ``outputs`` with the placeholders replaced by the projection's rows."""
        if not self.found or not self.inputs:
            return outputs
        rows = self.first[self.found][2](torch.cat(self.inputs, dim=1))  # [B, n - 1, width]
        return [outputs[0]] + [
            rows[:, t : t + 1] if isinstance(output, torch.Tensor) else (rows[:, t : t + 1], *output[1:])
            for t, output in enumerate(outputs[1:])
        ]


def _of_rows(states: list[dict], after: list[int]) -> dict:
    """Each row ``b``'s states after ``after[b]`` tokens, as one batch (cache states only: RecurrentGemma's are not
    held as rows)."""
    return {key: torch.stack([states[t][key][b] for b, t in enumerate(after)]) for key in states[0]}


def _cache_mixer(module: torch.nn.Module, cache: DynamicCache) -> bool:
    """Whether ``module`` may compute a recurrent layer of ``cache``: its ``layer_idx`` is one, and its forward takes
    the
    cache and the attention mask (which zeroes a batch's padding) but no positions (a recurrence needs none; the
    attention beside it in a hybrid layer, Falcon-H1's, does). transformers 5.24 names every cache argument ``cache``,
    so the name no longer tells (``cache_params`` before). Zaya's attention projection, which keeps a conv state in
    the cache but returns queries, keys and values, takes a ``conv_mask``: not one."""
    index = getattr(module, "layer_idx", None)
    if (
        not isinstance(index, int)
        or not 0 <= index < len(cache.layers)
        or not isinstance(cache.layers[index], LinearAttentionCacheLayerMixin)
    ):
        return False
    parameters = inspect.signature(module.forward).parameters
    return (
        cache_parameter(parameters) is not None
        and "attention_mask" in parameters
        and not {"position_embeddings", "position_ids"} & set(parameters)
    )


def _keeps_own_state(module: torch.nn.Module) -> bool:
    return hasattr(module, "conv1d_state") and hasattr(module, "rg_lru")  # (RecurrentGemma's recurrent block)


def _read(mixer: torch.nn.Module, cache: DynamicCache):
    if _keeps_own_state(mixer):  # (reassigned by every call, never written in place)
        return mixer.conv1d_state, mixer.rg_lru.recurrent_states
    return _layer_states(cache.layers[mixer.layer_idx])


def _write(mixer: torch.nn.Module, cache: DynamicCache, states) -> None:
    if _keeps_own_state(mixer):
        mixer.conv1d_state, mixer.rg_lru.recurrent_states = states
    else:
        _put_layer_states(cache.layers[mixer.layer_idx], states)


def stop_recording(cache: DynamicCache) -> None:
    """Let the recurrent layers of ``cache`` keep only their current state (specula puts them back whole), so that a
    one-token call takes the one-token path ``model.generate`` takes: recording the past makes it take the multi-token
    one, which is slower and may round otherwise."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicSlidingWindowLayer):
            layer.record_past = False


def crop_attention(cache: DynamicCache, tokens: int) -> None:
    """``cache.crop(-tokens)`` for the attention part of every layer; recurrent layers that record no past are put
    back by :meth:`Stepwise.put_back` instead."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not layer.record_past:
            attention = next(
                (
                    cls
                    for cls in type(layer).__mro__
                    if issubclass(cls, CacheLayerMixin) and not issubclass(cls, LinearAttentionCacheLayerMixin)
                ),
                None,
            )
            if attention is not None:  # (a layer holding both: zamba's hybrid layers)
                attention.crop(layer, -tokens)
        else:
            layer.crop(-tokens)


class RecurrentRows:
    """The recurrent states of a batch whose rows come and go: a buffer of ``slots`` rows for each state, whose rows
    in use the cache layers hold as a view (the models update their states in place, so they write the buffer).
    Each request's prompt is computed alone and its states put in its row (:meth:`put_row`)."""

    def __init__(self, cache: DynamicCache, slots: int) -> None:
        self.cache, self.slots = cache, slots
        self.layers = [
            index for index, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)
        ]
        self.buffers: dict[tuple[int, str, int], torch.Tensor] = {}  # (layer, kind, state) -> [slots, ...]

    def put_row(self, index: int, alone: DynamicCache) -> None:
        """Make row ``index`` hold the states of ``alone``, a one-row cache of the same model."""
        for layer in self.layers:
            computed, held = alone.layers[layer], self.cache.layers[layer]
            for (kind, state), tensor in _layer_states(computed).items():
                buffer = self.buffers.get((layer, kind, state))
                if buffer is None:
                    buffer = self.buffers[(layer, kind, state)] = tensor.new_zeros((self.slots, *tensor.shape[1:]))
                buffer[index] = tensor[0]
            for name in (
                "conv_kernel_size",
                "has_previous_state",
                "is_conv_states_initialized",
                "is_recurrent_states_initialized",
            ):
                setattr(held, name, dict(getattr(computed, name)))
            for name in ("dtype", "device"):  # (as far as the installed transformers' layers keep them)
                if hasattr(computed, name):
                    setattr(held, name, getattr(computed, name))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows, moved to the front."""
        for buffer in self.buffers.values():
            buffer[: len(rows)] = buffer[rows]

    def expose(self, rows: int) -> None:
        """Let the cache layers hold the first ``rows`` rows."""
        for (layer, kind, state), buffer in self.buffers.items():
            held = self.cache.layers[layer]
            (held.conv_states if kind == "conv" else held.recurrent_states)[state] = buffer[:rows]
