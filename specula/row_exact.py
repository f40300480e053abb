"""Verification passes that compute every token exactly as a one-token step computes it.

A pass over k+1 tokens runs other kernels than a one-token step: in bf16 a matmul over k+1 rows may block its sum
over the inner dimension otherwise than one over 1 row, and attention with k+1 queries reduces otherwise than with
one. The results differ in the last bit now and then, and where two tokens' logits are that close, greedy output
differs from ``model.generate``'s. :class:`RowExact` removes the difference during the verifier's multi-token passes,
without touching the model's own one-token path:

- attention: each query row is computed by the model's own attention function over the keys, and with the mask,
  that a one-token step at that position gets (the window of a sliding-window layer included);
- linear layers: each ``nn.Linear`` (and GPT-2's ``Conv1D``) whose rows come out differently in a pass of several rows than alone (found by
  :func:`rows_differ` on random rows, once per weight shape) computes each row alone. On a 2-core EPYC with
  AVX512_BF16, oneDNN blocks the inner dimension by the number of rows once it is 1536 or more: SmolLM2-135M's
  ``down_proj`` (1536 -> 576) is the only layer of that model so affected.

Everything else in a decoder (norms, rotary embeddings, activations, residual adds) works row by row and was found
invariant by :func:`specula.invariance.probe`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

# Attention implementations whose one-token calls RowExact can repeat row by row (HF's sdpa and eager functions).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Arguments of HF's sdpa function that change what it computes beyond plain masked attention.
_SDPA_EXTRAS = ("is_causal", "position_bias", "cache", "softcap", "s_aux", "sinks")
_CALIBRATION_ROWS = 33  # the widest pass the loop sends (MAX_DRAFT + 1)


@torch.inference_mode()
def rows_differ(layer: torch.nn.Linear, max_rows: int = _CALIBRATION_ROWS) -> bool:
    """Whether ``layer`` gives a row other bits inside a pass of 2..max_rows rows than alone, on random rows.

    Kernels that block the inner dimension by the number of rows differ on ~0.3% of outputs, so over the
    ``max_rows * out_features`` outputs compared a difference shows with certainty; kernels that do not are exact.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, max_rows, _in_features(layer), generator=generator).to(layer.weight.device, layer.weight.dtype)
    alone = _row_by_row(layer, x)
    return any(not torch.equal(layer(x[:, :rows]), alone[:, :rows]) for rows in range(2, max_rows + 1))


def _in_features(layer: torch.nn.Module) -> int:
    return layer.weight.shape[0] if isinstance(layer, Conv1D) else layer.in_features  # (Conv1D: [in, out])


def _row_by_row(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on each row of ``x`` ([..., rows, in]) alone, each a fresh tensor as in a one-token step."""
    forward = type(layer).forward
    return torch.cat([forward(layer, x[..., i : i + 1, :].clone()) for i in range(x.shape[-2])], dim=-2)


def _batched_sdpa(module, query, key, value, calls, dropout: float = 0.0, scaling=None, **kwargs):
    """One SDPA call over all query rows, each masked to its one-token keys, with GQA handled as HF's sdpa handles a
    one-token step without a mask (``enable_gqa``)."""
    del kwargs
    keys = key.shape[2]
    positions = torch.arange(keys, device=query.device)
    mask = torch.stack([(positions >= start) & (positions < end) for start, end, _ in calls])[None, None]
    groups = getattr(module, "num_key_value_groups", 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
    )
    return out.transpose(1, 2).contiguous(), None


class RowExact:
    """Installs row-exact attention and linear layers on ``model`` for the duration of a multi-token pass.

    Build it with :func:`row_exact_for`, which checks each weight shape once per model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.implementation = model.config._attn_implementation
        if self.implementation not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"Row-exact verification supports the attention implementations {SUPPORTED_ATTENTION}, not "
                f"{self.implementation!r}; load the model with attn_implementation='sdpa'."
            )
        self._batched_exact: dict[tuple, bool] = {}
        by_shape: dict[tuple, bool] = {}
        self.linears: list[torch.nn.Module] = []  # those computed row by row
        for module in model.modules():
            if type(module) in (torch.nn.Linear, Conv1D):
                shape = (module.weight.shape, module.weight.stride(), module.weight.dtype, module.weight.device,
                         module.bias is not None)
                if shape not in by_shape:
                    by_shape[shape] = rows_differ(module)
                if by_shape[shape]:
                    self.linears.append(module)

    def _attention(self, inner_of: Callable, cache) -> Callable:
        def window_of(module: torch.nn.Module) -> int | None:
            index = getattr(module, "layer_idx", None)
            if index is None or index >= len(cache.layers):
                return None
            return getattr(cache.layers[index], "sliding_window", None)

        def attention(module, query, key, value, attention_mask, **kwargs):
            # query: [batch, heads, rows, dim]; key, value: [batch, kv_heads, keys, dim]; the last row is the newest
            inner = inner_of(module)
            if query.shape[2] == 1:
                return inner(module, query, key, value, attention_mask, **kwargs)
            calls = self._one_token_calls(window_of(module), query.shape[2], key.shape[2], attention_mask)
            if all(mask is None for _, _, mask in calls) and self._batched_is_exact(module, query, key, kwargs):
                return _batched_sdpa(module, query, key, value, calls, **kwargs)
            outputs = [
                inner(module, query[:, :, i : i + 1], key[:, :, start:end], value[:, :, start:end], mask, **kwargs)[0]
                for i, (start, end, mask) in enumerate(calls)
            ]  # each [batch, 1, heads, dim]
            return torch.cat(outputs, dim=1), None

        return attention

    def _one_token_calls(self, window: int | None, rows: int, keys: int, attention_mask) -> list[tuple]:
        """For each query row, the keys ``[start, end)`` and the mask a one-token step at its position attends with
        (a sliding-window layer's one-token step sees the last ``window`` keys)."""
        calls = []
        for i in range(rows):
            end = keys - (rows - 1 - i)
            start = 0 if window is None else max(end - window, 0)
            mask = None
            if attention_mask is not None:
                mask = attention_mask[:, :, i : i + 1, start:end].contiguous()
                # sdpa's one-token step gets no mask where nothing is masked (HF's is_causal skip)
                unbounded = window is None or end - start < window
                if self.implementation == "sdpa" and mask.dtype == torch.bool and unbounded and bool(mask.all()):
                    mask = None
            calls.append((start, end, mask))
        return calls

    def _batched_is_exact(self, module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> bool:
        """Whether one masked SDPA call over all rows gives each row the bits of its own one-token call, for this
        attention geometry on this device (checked once on random rows, at key lengths either side of the kernels'
        block sizes)."""
        if self.implementation != "sdpa" or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS):
            return False
        kwargs = {name: kwargs[name] for name in ("dropout", "scaling") if name in kwargs}
        geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device, kwargs.get("scaling"))
        if geometry not in self._batched_exact:
            generator = torch.Generator().manual_seed(2)

            def rand(heads: int, length: int) -> torch.Tensor:
                shape = (1, heads, length, query.shape[3])
                return torch.randn(shape, generator=generator).to(query.device, query.dtype)

            exact = True
            for keys, rows in ((40, 8), (300, 33), (530, 33), (1100, 9)):
                q, k, v = rand(query.shape[1], rows), rand(key.shape[1], keys), rand(key.shape[1], keys)
                calls = [(0, keys - (rows - 1 - i), None) for i in range(rows)]
                alone = torch.cat([
                    ALL_ATTENTION_FUNCTIONS["sdpa"](module, q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], None, **kwargs)[0]
                    for i, (_, end, _) in enumerate(calls)
                ], dim=1)
                exact &= torch.equal(_batched_sdpa(module, q, k, v, calls, **kwargs)[0], alone)
            self._batched_exact[geometry] = exact
        return self._batched_exact[geometry]

    @contextlib.contextmanager
    def applied(self, cache) -> Iterator[None]:
        """Within the block, every multi-token pass of the model over ``cache`` (whose layers say which attention
        layers keep a sliding window) is row-exact."""
        mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
        saved = mapping.get(self.implementation)
        if self.implementation == "sdpa":
            sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            inner_of = lambda module: sdpa  # noqa: E731
        else:
            inner_of = lambda module: sys.modules[type(module).__module__].eager_attention_forward  # noqa: E731
        mapping[self.implementation] = self._attention(inner_of, cache)
        for layer in self.linears:
            layer.forward = functools.partial(_row_by_row, layer)
        try:
            yield
        finally:
            for layer in self.linears:
                del layer.forward
            if saved is None:
                del mapping[self.implementation]
            else:
                mapping[self.implementation] = saved


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_exact_for(model: torch.nn.Module) -> RowExact:
    """The :class:`RowExact` of ``model``, built on first use (its checks take well under a second)."""
    weight = next(model.parameters())
    setting = (weight.dtype, weight.device, model.config._attn_implementation)
    if model not in _BUILT or _BUILT[model][0] != setting:  # (built again after model.to() or a new attention)
        _BUILT[model] = (setting, RowExact(model))
    return _BUILT[model][1]


def is_half_precision(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes in bf16 or fp16."""
    return next(model.parameters()).dtype in (torch.bfloat16, torch.float16)


def wanted(model: torch.nn.Module, row_exact: bool | None) -> bool:
    """Whether to verify row-exactly: ``row_exact`` as given, or by default in bf16 and fp16 with an attention
    implementation :class:`RowExact` supports."""
    if row_exact is None:
        return is_half_precision(model) and model.config._attn_implementation in SUPPORTED_ATTENTION
    return bool(row_exact)
