"""Ordinary passes whose every row rounds alike whatever the pass: verification invariant to widths and batches.

In bf16 and fp16 an ordinary pass over several tokens rounds otherwise than one-token steps, and a batch's row
otherwise than the row alone, so what a request decodes to would follow its draft lengths and batch mates, and they
the clock. Traced on the AVX512_BF16 EPYC with torch 2.13's CPU kernels (docs/hardware.md), a row's result changes
with the pass in three places only: how many keys an attention call reduces over (its blocks over the keys), how many
queries share the call (its products block their rows), and a linear layer over one row (a matrix-vector kernel)
against several. So, in these passes, every attention call after a filled cache is computed on a CPU by specula's
kernel, each query from its own keys only (:mod:`.attend`), and elsewhere (a GPU, fp16) covers its keys padded with
masked ones to a multiple of :data:`KEY_BLOCK` and its queries, the query heads of a key/value head folded into one
head, to a multiple of :data:`QUERY_BLOCK` rows (the last repeated) (a fully masked block of keys adds exactly
nothing); and a single row's one-token step is computed as a pass over two tokens, its token again after it, whose
second position is dropped (:data:`STEP_WIDTH`). Passes then round as one-token
steps of this kind do, whatever their widths and batch mates: output no longer depends on draft lengths, the batch,
or the clock that sizes them. A linear layer's kernel may change with its product's rows too (oneDNN's bf16 products
on the AMX Xeon block otherwise past a number of rows): the most rows up to which every linear layer of the model
rounds each row alike is found once per machine and model (:func:`product_rows`), and a pass over more tokens
computes its products in chunks of at most that many rows (:func:`chunked_products`). Whether it all holds for a
model on a machine is checked on the live model (its passes of several widths, alone and in a batch, one wider than
a chunk, against its steps, bit for bit) once per machine and model and kept (:func:`holds`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..machine import store
from .attend import DTYPES, applies, attend, visibility
from .gqa import _EXTRAS, sdpa_as
from .int8 import int8_weight
from .row_exact import exact_rows
from .support import UnsupportedModelError, fit_context, model_device, vocab_size
from .threads import on_threads

KEY_BLOCK = 512  # keys of an attention call, padded (masked) to a multiple of this
QUERY_BLOCK = 4  # query rows of an attention call (its query heads folded), padded to a multiple of this
STEP_WIDTH = 2  # tokens a single row's one-token step is computed over (its own token repeated)
PRODUCT_ROWS = 64  # the most rows a linear layer's product in an invariant pass is tried at, and computed over at once


class NotFlat(UnsupportedModelError):
    """A flat pass met an attention call specula's kernel does not compute."""


@contextlib.contextmanager
def invariant_attention(offsets: np.ndarray | None = None) -> Iterator[None]:
    """Within the block, a model with ``sdpa`` attention attends each masked call, and each one-query call without a
    mask, so that every query rounds alike whatever the call: on a CPU with specula's kernel (:mod:`.attend`), else in
    blocks of fixed size, the query heads of each key/value head folded into one head of their queries (each
    key/value head read once), those rows padded to a multiple of :data:`QUERY_BLOCK` and the keys to a multiple of
    :data:`KEY_BLOCK`; a prefill (several queries, no mask) as transformers computes it. ``offsets`` (``[B + 1]``):
    the pass is flat, its rows' tokens one after another in one row of queries, row ``b``'s from ``offsets[b]``
    (:meth:`~specula.verifier.runner.RaggedRows.flat`; only specula's kernel computes it, else :class:`NotFlat`)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    masks: dict[tuple, tuple[torch.Tensor | None, object]] = {}  # key: (the mask, what a pass's calls take of it)

    def memo(kind: tuple, mask: torch.Tensor | None, make: Callable[[], object]):
        """What ``make`` makes of ``mask`` for calls of ``kind``: made once for all the layers of a pass."""
        if (kind, id(mask)) not in masks:
            masks[kind, id(mask)] = (mask, make())
        return masks[kind, id(mask)][1]

    def padded_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, keys: int, group: int) -> torch.Tensor:
        """``attention_mask`` (``[B, 1, n, keys]``, ``None``: every key) for the folded queries, padded rows and
        keys, additive (what the kernel turns a boolean mask into)."""
        batch, _, n, _ = query.shape

        def make() -> torch.Tensor:
            mask = attention_mask
            if mask is None:
                mask = torch.ones(batch, 1, n, keys, dtype=torch.bool, device=query.device)
            padded_keys = -(-keys // KEY_BLOCK) * KEY_BLOCK
            mask = torch.nn.functional.pad(mask, (0, padded_keys - keys), value=False).repeat(1, 1, group, 1)
            extra = -(-group * n // QUERY_BLOCK) * QUERY_BLOCK - group * n  # (the last row again)
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)  # [B, 1, rows + extra, padded]
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            return additive.masked_fill_(~mask, float("-inf"))

        return memo((batch, n, keys, group, query.dtype), attention_mask, make)

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        # query: [B, heads, n, dim]; key, value: [B, kv_heads, keys, dim]; attention_mask: [B, 1, n, keys] or None
        batch, heads, n, dim = query.shape
        torchs = (
            (attention_mask is None and n > 1)
            or (attention_mask is not None and attention_mask.dtype != torch.bool)
            or dropout
            or any(kwargs.get(name) is not None for name in _EXTRAS)
        )
        if offsets is not None:  # (a flat pass: [1, heads, T, dim] over the rows' keys)
            if torchs or not applies(query, key, value, int(np.diff(offsets).max())):
                raise NotFlat(f"{type(module).__name__}'s attention in a flat pass is not specula's kernel's")
            seen = memo(("seen", n), attention_mask, lambda: visibility(attention_mask, batch, n, key.shape[2]))
            return attend(query, key, value, seen, scaling, offsets), None
        if torchs:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        keys, group = key.shape[2], heads // key.shape[1]
        if applies(query, key, value):
            seen = memo(("seen", batch, n, keys), attention_mask, lambda: visibility(attention_mask, batch, n, keys))
            return attend(query, key, value, seen, scaling), None
        mask = padded_mask(attention_mask, query, keys, group)  # [B, 1, rows + extra, padded keys]
        key, value = (_padded(t, mask.shape[3]) for t in (key, value))
        # folded: query i of head kv * group + g is row g * n + i of head kv (the mask repeats whole, group times)
        rows = group * n
        folded = query.reshape(batch, key.shape[1], rows, dim)
        folded = torch.cat([folded, folded[:, :, -1:].expand(-1, -1, mask.shape[2] - rows, -1)], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
        return out[:, :, :rows].reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None  # [B, n, heads, dim]

    with sdpa_as(attention):
        yield


def _padded(states: torch.Tensor, keys: int) -> torch.Tensor:
    """``states`` (``[B, heads, length, dim]``) with ``keys`` positions: a view of the buffer it is a view of, where
    that holds them (what lies past ``length`` there is zeros or states a rollback forgot, finite, and masked: a
    masked key adds exactly nothing), else padded with zeros (a copy)."""
    batch, heads, length, dim = states.shape
    stride = states.stride()
    if stride[3] == 1 and stride[2] == dim and stride[1] >= keys * dim and stride[0] >= heads * stride[1]:
        end = states.storage_offset() + (batch - 1) * stride[0] + (heads - 1) * stride[1] + keys * dim
        if end <= states.untyped_storage().nbytes() // states.element_size():
            return states.as_strided((batch, heads, keys, dim), stride)
    return torch.nn.functional.pad(states, (0, 0, 0, keys - length))


def product_rows(model: torch.nn.Module, applied: Callable[[], contextlib.AbstractContextManager], packed: bool) -> int:
    """The most rows (up to :data:`PRODUCT_ROWS`) up to which every linear layer of ``model``, computed within
    ``applied()`` as an invariant pass computes it (``packed``: with prepacked weights), gives each of its rows the bits
    that row has in a product over :data:`STEP_WIDTH` rows (a one-token step's); 0 where that fails under 4 rows.
    Found once per machine and model, kept (whatever the load: bits, not times)."""
    weight = next(model.parameters())
    key = store.key(
        weight.device, "invariant products: rows, packed untimed", _model_key(model), weight.dtype, packed, PRODUCT_ROWS
    )
    return store.shared().get(key, lambda: _most_rows(model, applied), timed=False)


@torch.no_grad()
def _most_rows(model: torch.nn.Module, applied: Callable[[], contextlib.AbstractContextManager]) -> int:
    """:func:`product_rows`: each kind of linear layer (its class, weight's shape and dtype, bias, and whether a pass
    gives it another forward) tried as :func:`~specula.verifier.row_exact.exact_rows` tries a layer, against its
    products over :data:`STEP_WIDTH` rows."""
    most = PRODUCT_ROWS
    with applied():
        kinds = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                weight, own = module.weight, "forward" not in module.__dict__  # (else packed: oneDNN's, int8 ...)
                kinds.setdefault((type(module), tuple(weight.shape), weight.dtype, module.bias is None, own), module)
        for layer in kinds.values():
            most = min(most, exact_rows(layer, layer, most, least=STEP_WIDTH))
    return most if most >= 4 else 0


@contextlib.contextmanager
def chunked_products(model: torch.nn.Module, rows: int) -> Iterator[None]:
    """Within the block, every linear layer of ``model`` computes an input of more than ``rows`` rows (its leading
    dimensions flattened) in near-equal chunks of at most ``rows`` (none of one row: ``rows`` >= 4), so that each row
    rounds as in a product of at most ``rows`` (:func:`product_rows`)."""
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    before = [layer.__dict__.get("forward") for layer in layers]
    for layer, forward in zip(layers, before):
        layer.__dict__["forward"] = _chunked(forward or types.MethodType(type(layer).forward, layer), rows)
    try:
        yield
    finally:
        for layer, forward in zip(layers, before):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = forward


def _chunked(forward: Callable[[torch.Tensor], torch.Tensor], rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def compute(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        if len(flat) <= rows:
            return forward(x)
        parts = [forward(part[None])[0] for part in torch.tensor_split(flat, -(-len(flat) // rows))]
        return torch.cat(parts).reshape(*x.shape[:-1], -1)

    return compute


def holds(model: torch.nn.Module) -> bool:
    """Whether ``model``'s invariant passes (:class:`~specula.verifier.runner.CachedModel` with ``invariant=True``)
    give each row the bits of its one-token steps on this machine, whatever the pass's width and batch mates: checked
    once per machine and model (:func:`_check`; with int8 weights, as :mod:`.int8` computes them), kept whatever the
    load (bits, not times)."""
    return _verdict(model)[0]


def any_threads(model: torch.nn.Module) -> bool:
    """Whether, besides (:func:`holds`), they give each row the same bits on one thread as on torch's threads, so that
    the thread count may follow the machine's load (:mod:`.threads`) without changing an answer (checked with
    :func:`holds`)."""
    return _verdict(model)[1]


def _verdict(model: torch.nn.Module) -> list[bool]:
    weight = next(model.parameters())
    int8 = any(int8_weight(parameter) is not None for parameter in model.parameters())
    kernel = weight.device.type == "cpu" and weight.dtype in DTYPES  # (else padded blocks)
    key = store.key(
        weight.device,
        "invariant passes, query heads folded, products in chunks, on one thread, packed untimed",
        _model_key(model),
        weight.dtype,
        model.config._attn_implementation,
        *(["specula's attention kernel, flat passes"] if kernel else [KEY_BLOCK, QUERY_BLOCK]),
        *(["int8 numbers read"] if int8 else []),
    )
    return store.shared().get(key, lambda: _check(model), timed=False)


def _model_key(model: torch.nn.Module) -> str:
    from .exactness import model_key  # (exactness chooses between row-exact and these passes)

    return model_key(model)


@torch.no_grad()
def _check(model: torch.nn.Module, steps: int = 12) -> list[bool]:
    """Two rows, one whose keys cross a multiple of :data:`KEY_BLOCK` within the check (fewer where the model's
    positions end): the first row's logits over ``steps`` tokens as one-token steps, then again in passes of 5 and 7
    tokens alone, then of 4 and 8 beside the second row's passes of other widths, then in one pass beside one of the
    second row's wider than :data:`PRODUCT_ROWS` (its products in chunks); all of it again with its steps and passes
    on one thread (the prefills on torch's threads). ``[every position's logits bit for bit the same, and the same on
    one thread]``."""
    from .runner import RaggedRows  # (the runner takes these passes)

    device = model_device(model)
    wide = PRODUCT_ROWS + 9
    contexts = [fit_context(model, KEY_BLOCK - steps // 2, steps + 2), fit_context(model, 37, wide + 2)]
    text = torch.randint(
        3,
        vocab_size(model),
        (max(contexts[0] + steps, contexts[1] + wide) + 1,),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    first = contexts[0]  # (the first row's tokens after its context: text[first:first + steps])

    def run(target: RaggedRows, threads: int) -> list[list[torch.Tensor]]:
        """The first row's logits as steps, then in each set of passes, its steps and passes on ``threads``."""
        target.truncate_row(0, first)
        target.select_rows([0])
        alone = []  # [steps] logits of one-token steps
        for at in range(first, first + steps):
            with on_threads(threads):
                alone.append(target.forward_rows([text[at : at + 1]], [1], [None])[0][0])  # (as the loop calls it)
            target.keep_rows([1])
        runs = [alone]
        for widths, beside in (((5, 7), None), ((4, 8), (3, 9)), ((steps,), (wide,))):
            target.truncate_row(0, first)
            if beside is not None:
                target.start_row(1, text[: contexts[1]])
            at, got = first, []
            for index, width in enumerate(widths):
                blocks = [text[at : at + width]]
                if beside is not None:
                    start = contexts[1] + sum(beside[:index])
                    blocks.append(text[start : start + beside[index]])
                with on_threads(threads):
                    logits = target.forward_rows(blocks, [len(block) for block in blocks], [None] * len(blocks))
                got.extend(logits[0])
                target.keep_rows([len(block) for block in blocks])
                at += width
            runs.append(got)
        return runs

    threads = torch.get_num_threads()
    try:
        target = RaggedRows(
            model, rollback=True, capacity=len(text) + 1, slots=2, cheap_steps=True, invariant=True, max_width=9
        )
        if not target.product_rows:
            return [False, False]
        target.start_row(0, text[:first])
        runs = run(target, threads)
        on_one = run(target, 1) if threads > 1 and device.type == "cpu" else runs
    except UnsupportedModelError:
        return [False, False]
    holds = all(torch.equal(one, other) for got in runs[1:] for one, other in zip(runs[0], got))
    return [holds, holds and all(torch.equal(a, b) for got, mine in zip(runs, on_one) for a, b in zip(got, mine))]
