"""Attention computed row by row during a row-exact pass.

Each query row is computed as the model's own attention function computes a one-token step at its position, over
the same keys with the same mask (the window of a sliding-window layer included). With SDPA, rows whose key counts
differ little share one call (:mod:`.grouping`), in groups as wide as a check finds exact and the clock finds
cheapest; a group of one is the one-token call.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...machine import store
from ..calibration import TIMED_ROWS
from .grouping import _calibrate_attention, _group_plan, _grouped_sdpa

# Attention implementations whose one-token calls RowExact can repeat row by row (HF's sdpa and eager functions).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Arguments of HF's sdpa function that change what it computes beyond plain masked attention.
_SDPA_EXTRAS = ("is_causal", "position_bias", "cache", "softcap", "s_aux", "sinks")


class RowAttention:
    """A model's attention as row-exact passes compute it (``implementation``: one of ``SUPPORTED_ATTENTION``): the
    grouping found for each attention geometry, and what a pass costs with it (``linear_ms``: the milliseconds of a
    pass's linear layers, exact and ordinary)."""

    def __init__(self, implementation: str, linear_ms: tuple[float, float]) -> None:
        self.implementation, self.linear_ms = implementation, linear_ms
        self._group_widths: dict[tuple, int] = {}
        # milliseconds of each attention layer, exact and ordinary (once calibrated)
        self.attention_ms: dict[int, tuple[float, float]] = {}
        self._noted = False  # whether the cost of exactness here was weighed (see _note_cost)

    @contextlib.contextmanager
    def installed(self, cache, ends: list[list[int]] | None, paths: list | None) -> Iterator[None]:
        """Within the block, the model's attention function is the row-exact one of a pass over ``cache``
        (:class:`_PassAttention`; ``ends`` and ``paths`` as :meth:`specula.verifier.row_exact.RowExact.applied` takes
        them)."""
        mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
        saved = mapping.get(self.implementation)
        mapping[self.implementation] = _PassAttention(self, self._inner_of(), cache, ends, paths)
        try:
            yield
        finally:
            if saved is None:
                del mapping[self.implementation]
            else:
                mapping[self.implementation] = saved

    def _inner_of(self) -> Callable[[torch.nn.Module], Callable]:
        """What gives an attention module's own attention function: HF's sdpa one (as it is before a pass replaces
        it), or the eager one of the module's model file."""
        if self.implementation == "sdpa":
            sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            return lambda module: sdpa
        return lambda module: sys.modules[type(module).__module__].eager_attention_forward

    def _group_width(self, module, query: torch.Tensor, key: torch.Tensor, kwargs: dict, sdpa: Callable) -> int:
        """The grouping :func:`.grouping._grouped_sdpa` uses for this attention geometry on this device (1: one call
        per row): the cheapest of those that give every row the bits of its own one-token call
        (:func:`.grouping._exact_widths`), timed on a pass of ``TIMED_ROWS`` queries; calibrated once per machine
        (:mod:`specula.machine.store`)."""
        if self.implementation != "sdpa" or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS):
            return 1
        kwargs = {name: kwargs[name] for name in ("dropout", "scaling") if name in kwargs}
        geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device, kwargs.get("scaling"))
        if geometry not in self._group_widths:
            heads, kv_heads, dim, dtype, device, scaling = geometry
            found = store.shared().get(
                store.key(device, "attention", heads, kv_heads, dim, dtype, scaling),
                lambda: _calibrate_attention(module, sdpa, heads, kv_heads, dim, dtype, device, kwargs),
            )
            store.shared().tell()
            self._group_widths[geometry] = found["width"]
            self.attention_ms[getattr(module, "layer_idx", id(module))] = (found["exact_ms"], found["ordinary_ms"])
        return self._group_widths[geometry]

    def _note_cost(self, layers: int) -> None:
        """Warn once if, by the calibrations, a row-exact pass of ``TIMED_ROWS`` tokens costs over twice an ordinary
        one here (``layers`` attention layers, each costed as the calibrated one)."""
        if self._noted or not self.attention_ms:
            return
        self._noted = True
        exact, ordinary = (self.linear_ms[i] + layers * max(ms[i] for ms in self.attention_ms.values()) for i in (0, 1))
        if exact > 2 * ordinary:
            warnings.warn(
                f"On this machine a row-exact verification pass over {TIMED_ROWS} tokens costs about "
                f"{exact / ordinary:.1f}x an ordinary one (its attention kernel gives a query its one-token bits only "
                "when computed alone), so drafts gain less; the cost model sends only those that still pay. "
                "exact=False (--no-exact) verifies the ordinary way: faster, but greedy output may then "
                "leave model.generate's after a near-tie.",
                stacklevel=2,
            )


def _attending(cache) -> int:
    """How many of ``cache``'s layers attend: all but those holding recurrent state alone (Mamba, gated delta nets)."""
    return sum(
        not isinstance(layer, LinearAttentionCacheLayerMixin) or isinstance(layer, CacheLayerMixin)
        for layer in cache.layers
    )


class _PassAttention:
    """The attention function of one row-exact pass over ``cache``: each query row as ``inner_of(module)``, the
    module's own attention function, computes a one-token step at its position (``ends`` and ``paths`` as
    :meth:`specula.verifier.row_exact.RowExact.applied` takes them)."""

    def __init__(
        self, attention: RowAttention, inner_of: Callable, cache, ends: list[list[int]] | None, paths: list | None
    ) -> None:
        self.attention, self.inner_of, self.cache, self.ends, self.paths = attention, inner_of, cache, ends, paths
        self.plans: dict[tuple, list[tuple]] = {}  # the pass's query groups: made once, the same in every layer
        # a tree's queries whose ancestors are not the tokens before them: computed by _tree_row alone
        n = len(ends[0]) if ends else 0
        self.off_path = frozenset(
            b * n + i
            for b, row in enumerate(paths or [])
            if row is not None
            for i, path in enumerate(row)
            if path is not None
        )

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        # query: [batch, heads, rows, dim]; key, value: [batch, kv_heads, keys, dim]; the last row is the newest
        inner = self.inner_of(module)
        if self.ends is not None:  # a batch whose row b's query i sees that row's keys up to ends[b][i]
            return self._ragged(module, inner, query, key, value, attention_mask, kwargs), None
        if query.shape[2] == 1:
            return inner(module, query, key, value, attention_mask, **kwargs)
        return self._aligned(module, inner, query, key, value, attention_mask, kwargs)

    def _window_of(self, module: torch.nn.Module) -> int | None:
        """The window of ``module``'s layer where the cache says it keeps a sliding window."""
        index = getattr(module, "layer_idx", None)
        if index is None or index >= len(self.cache.layers):
            return None
        return getattr(self.cache.layers[index], "sliding_window", None)

    def _plan(
        self, ends: list[list[int]], width: int, device: torch.device, skip: frozenset = frozenset()
    ) -> list[tuple]:
        """:func:`.grouping._group_plan`, made once in a pass."""
        key = (width, tuple(map(tuple, ends)), skip)
        if key not in self.plans:
            self.plans[key] = _group_plan(ends, width, device, skip)
        return self.plans[key]

    def _aligned(self, module, inner: Callable, query, key, value, attention_mask, kwargs: dict):
        """A pass whose batch rows all end at the last key: each query row over the keys and with the mask of its
        one-token step, in groups where a single row sees all its keys unmasked."""
        calls = self._one_token_calls(self._window_of(module), query.shape[2], key.shape[2], attention_mask)
        if query.shape[0] == 1 and all(mask is None and start == 0 for start, _, mask in calls):
            width = self.attention._group_width(module, query, key, kwargs, inner)
            self.attention._note_cost(_attending(self.cache))
            if width > 1:
                ends_one = [[end for _, end, _ in calls]]
                return _grouped_sdpa(
                    module, query, key, value, ends_one, width, plan=self._plan(ends_one, width, query.device), **kwargs
                )
        outputs = [
            inner(module, query[:, :, i : i + 1], key[:, :, start:end], value[:, :, start:end], mask, **kwargs)[0]
            for i, (start, end, mask) in enumerate(calls)
        ]  # each [batch, 1, heads, dim]
        return torch.cat(outputs, dim=1), None

    def _ragged(self, module, inner: Callable, query, key, value, attention_mask, kwargs: dict) -> torch.Tensor:
        """A batch whose rows keep their own lengths (``ends``), some of them trees (``paths``): ``[B, n, heads,
        dim]``."""
        window = self._window_of(module)
        width = 1 if window is not None else self.attention._group_width(module, query, key, kwargs, inner)
        self.attention._note_cost(_attending(self.cache))
        if width > 1:
            out = _grouped_sdpa(
                module,
                query,
                key,
                value,
                self.ends,
                width,
                plan=self._plan(self.ends, width, query.device, self.off_path),
                **kwargs,
            )[0]
        else:
            outputs = []  # each [1, 1, heads, dim]
            for b, row in enumerate(self.ends):
                for i, end in enumerate(row):
                    start, mask = self._one_token_call(window, end, attention_mask[b : b + 1, :, i : i + 1])
                    outputs.append(
                        inner(
                            module,
                            query[b : b + 1, :, i : i + 1],
                            key[b : b + 1, :, start:end],
                            value[b : b + 1, :, start:end],
                            mask,
                            **kwargs,
                        )[0]
                    )
            out = torch.cat(outputs, dim=1).reshape(len(self.ends), len(self.ends[0]), *outputs[0].shape[2:])
        for b, row_paths in enumerate(self.paths or []):
            if row_paths is not None:
                self._tree_row(out, b, module, inner, query, key, value, attention_mask, window, width, kwargs)
        return out

    def _tree_row(
        self,
        out,
        b: int,
        module,
        inner: Callable,
        query,
        key,
        value,
        attention_mask,
        window: int | None,
        width: int,
        kwargs: dict,
    ) -> None:
        """Recompute in ``out`` (``[B, n, heads, dim]``) the queries of batch row ``b`` (a tree) whose ancestors
        are not the block tokens before them (``paths[i]``: the block indices of query ``i``'s ancestors and
        itself; ``None`` where they are): as a one-token step at its place computes it, over the row's cache
        followed by its path. Each branch's path is written over the row's block in ``key`` and ``value`` for its
        queries, so that its keys follow the cache without a copy of it; the block is put back afterwards."""
        paths = self.paths[b]
        cached = self.ends[b][0] - 1  # the row's keys before its block
        saved = [t[b, :, cached : cached + len(paths)].clone() for t in (key, value)]  # [kv_heads, n, dim]
        done: set[int] = set()
        for leaf in reversed(range(len(paths))):  # each branch from its deepest query; its ancestors come along
            if paths[leaf] is None or leaf in done:
                continue
            members = [i for i in paths[leaf] if paths[i] is not None and i not in done]
            path = torch.tensor(paths[leaf], device=key.device)
            for t, block in zip((key, value), saved):
                t[b, :, cached : cached + len(path)] = block[:, path]
            keys = cached + len(path)
            k, v = key[b : b + 1, :, :keys], value[b : b + 1, :, :keys]  # [1, kv_heads, keys, dim]
            member_ends = [cached + len(paths[i]) for i in members]
            if width > 1:
                out[b, members] = _grouped_sdpa(
                    module,
                    query[b : b + 1, :, members],
                    k,
                    v,
                    [member_ends],
                    width,
                    plan=self._plan([member_ends], width, key.device),
                    **kwargs,
                )[0][0]
            else:
                for i, end in zip(members, member_ends):
                    # its one-token step sees all of these keys (a bool mask: True; eager's additive one: 0)
                    fill = torch.ones if attention_mask.dtype == torch.bool else torch.zeros
                    visible = fill((1, 1, 1, end), dtype=attention_mask.dtype, device=attention_mask.device)
                    start, mask = self._one_token_call(window, end, visible)
                    out[b, i] = inner(
                        module,
                        query[b : b + 1, :, i : i + 1],
                        k[..., start:end, :],
                        v[..., start:end, :],
                        mask,
                        **kwargs,
                    )[0][0, 0]
            done.update(members)
        for t, block in zip((key, value), saved):
            t[b, :, cached : cached + len(paths)] = block

    def _one_token_calls(self, window: int | None, rows: int, keys: int, attention_mask) -> list[tuple]:
        """For each query row of a one-row pass, the keys ``[start, end)`` and the mask a one-token step at its
        position attends with."""
        calls = []
        for i, end in enumerate(range(keys - rows + 1, keys + 1)):
            start, mask = self._one_token_call(
                window, end, None if attention_mask is None else attention_mask[:, :, i : i + 1]
            )
            calls.append((start, end, mask))
        return calls

    def _one_token_call(self, window: int | None, end: int, mask: torch.Tensor | None) -> tuple:
        """The keys ``[start, end)`` and the mask (from ``mask``, this query's row of the pass's mask) that a
        one-token step seeing ``end`` keys attends with: a sliding-window layer's sees its last ``window`` keys."""
        start = 0 if window is None else max(end - window, 0)
        if mask is not None:
            mask = mask[..., start:end].contiguous()
            # sdpa's one-token step gets no mask where nothing is masked (HF's is_causal skip)
            unbounded = window is None or end - start < window
            if self.attention.implementation == "sdpa" and mask.dtype == torch.bool and unbounded and bool(mask.all()):
                mask = None
        return start, mask
