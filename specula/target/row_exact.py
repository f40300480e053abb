"""Verification passes that compute every token exactly as a one-token step computes it.

A pass over k+1 tokens runs other kernels than a one-token step: in bf16 a matmul over k+1 rows may block its sum
over the inner dimension otherwise than one over 1 row, and attention with k+1 queries reduces otherwise than with
one. The results differ in the last bit now and then, and where two tokens' logits are that close, greedy output
differs from ``model.generate``'s. :class:`RowExact` removes the difference during the verifier's multi-token passes,
without touching the model's own one-token path:

- attention: each query row is computed as the model's own attention function computes a one-token step at its
  position, over the same keys with the same mask (the window of a sliding-window layer included). With SDPA,
  rows whose key counts differ little share one call, each as a batch entry of one query (:func:`_grouped_sdpa`),
  in groups as wide as a check finds exact and the clock finds cheapest; a group of one is the one-token call.
- linear layers: each ``nn.Linear`` (and GPT-2's ``Conv1D``) that gives a row other bits in a pass of several rows
  than alone computes its rows in chunks as wide as it stays exact for (:func:`exact_rows`), as it is or by columns
  (:func:`_by_columns`), whichever the clock finds cheaper. On a 2-core EPYC with AVX512_BF16, oneDNN blocks an
  inner dimension of 1536 or more by the number of rows beyond 2: SmolLM2-135M's ``down_proj`` (1536 -> 576) is the
  only layer of that model so affected.

What is exact and what is cheapest is found once per machine, torch build and shape, and kept on disk
(:mod:`specula.calibration`).

Everything else in a decoder (norms, rotary embeddings, activations, residual adds) works row by row and was found
invariant by :func:`specula.invariance.probe`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from . import calibration
from .calibration import calibration_key, cheapest, seconds_of

# Attention implementations whose one-token calls RowExact can repeat row by row (HF's sdpa and eager functions).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Arguments of HF's sdpa function that change what it computes beyond plain masked attention.
_SDPA_EXTRAS = ("is_causal", "position_bias", "cache", "softcap", "s_aux", "sinks")
_CALIBRATION_ROWS = 33  # the widest pass the loop sends (MAX_DRAFT + 1)
_TIMED_ROWS = 9  # strategies are timed on a typical pass: the last token and 8 drafts ...
_TIMED_KEYS = 700  # ... after this many tokens


def _spread(shape: tuple, generator: torch.Generator, octaves: float) -> torch.Tensor:
    """Random values of both signs whose magnitudes spread over ``octaves`` powers of two: sums of them cancel and
    are dominated by a few terms, so that a sum taken in another order rounds otherwise far more often than for
    Gaussian values."""
    magnitudes = torch.exp2((torch.rand(shape, generator=generator) - 0.5) * octaves)
    return torch.randn(shape, generator=generator) * magnitudes


@torch.inference_mode()
def exact_rows(layer: torch.nn.Module, compute: Callable | None = None, max_rows: int = _CALIBRATION_ROWS) -> int:
    """The most rows (1..max_rows) that ``compute`` (default: ``layer`` itself) takes in one call and still gives
    each of them the bits ``layer`` gives that row alone, found on random rows.

    A kernel that sums in another order for another number of rows changes a bf16 output only where the fp32 sums
    straddle a rounding boundary: ~1 output in 5000 for an inner dimension of 1536 and Gaussian rows. So each width
    is tried on enough rows for 2**17 outputs, of magnitudes spread over 6 octaves (:func:`_spread`).
    """
    ordinary = functools.partial(type(layer).forward, layer)
    compute = compute or ordinary
    generator = torch.Generator().manual_seed(0)
    n = _in_features(layer)
    count = min(max(2**17 * n // layer.weight.numel(), 1), 2048)  # rows for 2**17 outputs
    x = _spread((1, count + max_rows, n), generator, 6).to(layer.weight.device, layer.weight.dtype)
    alone = _in_chunks(ordinary, 1, x)
    rows = 1
    while rows < max_rows:
        tried = -(-count // (rows + 1)) * (rows + 1)  # whole chunks of rows + 1
        if not torch.equal(_in_chunks(compute, rows + 1, x[:, :tried]), alone[:, :tried]):
            break
        rows += 1
    return rows


def _in_features(layer: torch.nn.Module) -> int:
    return layer.weight.shape[0] if isinstance(layer, Conv1D) else layer.in_features  # (Conv1D: [in, out])


def _in_chunks(compute: Callable, rows: int, x: torch.Tensor) -> torch.Tensor:
    """``compute`` on ``rows`` rows of ``x`` ([..., n, in]) at a time, each chunk a fresh tensor as in a one-token
    step."""
    if x.shape[-2] <= rows:
        return compute(x)
    return torch.cat([compute(x[..., i : i + rows, :].clone()) for i in range(0, x.shape[-2], rows)], dim=-2)


def _by_columns(weight_t: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t + bias`` computed as ``(weight_t.T @ x.T).T``: with ``weight_t`` ([in, out]) contiguous, the
    number of rows of ``x`` is the product's last dimension, which oneDNN does not block the inner sum by (found
    exact where :func:`exact_rows` says so: on an Emerald Rapids Xeon, bf16, for every shape tried)."""
    rows = x.reshape(-1, x.shape[-1]).t()  # [in, n]
    out = weight_t.t() @ rows if bias is None else torch.addmm(bias[:, None], weight_t.t(), rows)  # [out, n]
    return out.t().reshape(*x.shape[:-1], -1).contiguous()


def _weight_t(layer: torch.nn.Module) -> torch.Tensor:
    """``layer``'s weight as ``[in, out]``, contiguous (a copy where it is stored otherwise)."""
    weight = layer.weight.detach()
    weight_t = weight if isinstance(layer, Conv1D) else weight.t()
    return weight_t if weight_t.is_contiguous() else weight_t.contiguous()


def _calibrate(layer: torch.nn.Module) -> dict:
    """How ``layer`` computes a multi-row pass exactly: in chunks of the most rows that are exact as it is
    (``rows``), or by columns (:func:`_by_columns`, ``columns`` rows a chunk), whichever is cheaper for a pass of
    ``_TIMED_ROWS`` rows (``by_columns``); with the milliseconds of each and of the ordinary product."""
    rows = exact_rows(layer)
    ordinary = functools.partial(type(layer).forward, layer)
    generator = torch.Generator().manual_seed(4)  # (never torch's global one: seeded sampling draws from it)
    x = torch.randn(1, _TIMED_ROWS, _in_features(layer), generator=generator).to(layer.weight.device, layer.weight.dtype)
    found = {"rows": rows, "by_columns": False, "ordinary_ms": seconds_of(lambda: ordinary(x)) * 1e3}
    if rows == _CALIBRATION_ROWS:
        return {**found, "exact_ms": found["ordinary_ms"]}
    by_columns = functools.partial(_by_columns, _weight_t(layer), layer.bias)
    columns = exact_rows(layer, by_columns)
    strategies = {False: lambda: _in_chunks(ordinary, rows, x), True: lambda: _in_chunks(by_columns, columns, x)}
    choice = cheapest(strategies)
    return {**found, "columns": columns, "by_columns": choice, "exact_ms": seconds_of(strategies[choice]) * 1e3}


def _linear_calibration(layer: torch.nn.Module) -> dict:
    """:func:`_calibrate` for ``layer``'s weight shape on this machine, made once and kept (:mod:`specula.calibration`)."""
    weight = layer.weight
    key = calibration_key(weight.device, "linear", type(layer).__name__, tuple(weight.shape), weight.stride(),
                          weight.dtype, layer.bias is not None)
    return calibration.shared().get(key, lambda: _calibrate(layer))


def _needs_copy(layer: torch.nn.Module) -> bool:
    return isinstance(layer, torch.nn.Linear) and not layer.weight.t().is_contiguous()


def _spare_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = open("/proc/meminfo").read().splitlines()
        return int(next(line for line in lines if line.startswith("MemAvailable:")).split()[1]) * 1024
    return None


class _ExactLinear:
    """A linear layer (``nn.Linear`` or GPT-2's ``Conv1D``) that gives a row of a multi-row pass other bits than
    alone, computed in chunks of ``rows`` rows that stay exact, by columns (with a column-major copy of a row-major
    weight, refreshed if the weight changes) where that is exact for more rows than the layer as it is."""

    def __init__(self, layer: torch.nn.Module, rows: int, by_columns: bool) -> None:
        self.layer, self.rows = layer, rows
        self.weight_t = _weight_t(layer) if by_columns else None
        self._source = self._version()

    def _version(self) -> tuple[int, int]:
        return self.layer.weight.data_ptr(), self.layer.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(1, -1, x.shape[-1])  # [1, rows of every batch row, in]
        if self.weight_t is None:
            out = _in_chunks(functools.partial(type(self.layer).forward, self.layer), self.rows, flat)
        else:
            if self._version() != self._source:
                self.weight_t, self._source = _weight_t(self.layer), self._version()
            out = _in_chunks(functools.partial(_by_columns, self.weight_t, self.layer.bias), self.rows, flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _group_plan(ends: list[list[int]], width: int, device: torch.device, skip: frozenset = frozenset()) -> list[tuple]:
    """How :func:`_grouped_sdpa` splits a pass's queries (query ``j = b * n + i``; ``ends[b][i]`` keys; those in
    ``skip`` left out): per group, ``(row, its queries: a slice where they follow each other, else an index tensor,
    keys, mask [members, 1, 1, keys] or None)``. The same for every layer of a pass, so it is made once."""
    n = len(ends[0])
    flat_ends = [end for row in ends for end in row]
    groups: dict[tuple[int, int], list[int]] = {}  # (row, end // width) -> its queries (a tree's need not follow)
    for j, end in enumerate(flat_ends):
        if j not in skip:
            groups.setdefault((j // n, end // width), []).append(j)
    plan = []
    for (row, _), members in groups.items():
        keys = max(flat_ends[j] for j in members)
        mask = None  # a group of one sees all its keys: the one-token call itself
        if len(members) > 1:
            lengths = torch.tensor([flat_ends[j] for j in members], device=device)
            mask = (torch.arange(keys, device=device) < lengths[:, None])[:, None, None]  # [members, 1, 1, keys]
        follow = members == list(range(members[0], members[-1] + 1))
        where = slice(members[0], members[-1] + 1) if follow else torch.tensor(members, device=device)
        plan.append((row, where, keys, mask))
    return plan


def _grouped_sdpa(module, query, key, value, ends: list[list[int]], width: int, dropout: float = 0.0, scaling=None,
                  plan: list[tuple] | None = None, **kwargs):
    """Attention of query ``i`` of batch row ``b`` over that row's keys ``[0, ends[b][i])``, with one SDPA call per
    group of a row's queries whose ``end // width`` agree: each query is a batch entry of its own, over the group's
    longest keys (the row's, shared without a copy), the keys past its own end masked (``plan``: the groups, made
    by :func:`_group_plan` where not given; a tree's queries need not come in the order of their key counts).

    Where :meth:`RowExact._group_width` finds this exact (:func:`_exact_widths`), it is so because of how the
    attention kernel reduces. torch's CPU flash kernel takes the keys in blocks of 512 and each block in vectors of 16
    floats plus a scalar tail whose exponentials round otherwise than the vectors': a query over 300 keys has keys
    288..299 in the tail; padded to 303 keys they still are, and the masked keys add exact zeros; padded to 304 they
    would not be. Its bf16 products go to MKL, which on a 2-core EPYC sums a block's last ``K % 4`` keys apart:
    there only groups of ``end // 4`` keep every query's order.
    """
    del kwargs
    # query: [B, heads, n, dim]; key, value: [B, kv_heads, keys, dim]; ends: B lists of n key counts
    batch, heads, n, dim = query.shape
    queries = query.transpose(1, 2).reshape(batch * n, heads, 1, dim)
    out = query.new_empty(batch * n, 1, heads, dim)
    for row, where, keys, mask in _group_plan(ends, width, query.device) if plan is None else plan:
        members = queries[where]  # [members, heads, 1, dim]
        k, v = (t[row : row + 1, :, :keys].expand(len(members), -1, -1, -1) for t in (key, value))  # (no copy)
        out[where] = torch.nn.functional.scaled_dot_product_attention(
            members, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=heads != k.shape[1],
        ).transpose(1, 2)  # [members, 1, heads, dim]
    return out.reshape(batch, n, heads, dim), None


def _attention_inputs(heads: int, kv_heads: int, dim: int, dtype, device, rows: int, queries: int, keys: int,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``query`` ``[rows, heads, queries, dim]`` and ``key``, ``value`` ``[rows, kv_heads, keys, dim]``, laid
    out as a model's projections, with scores spread as widely as a trained model's (a few keys dominate) and values
    of magnitudes spread over 12 octaves (:func:`_spread`), so that a changed summation order shows."""
    def projected(heads: int, length: int, values: torch.Tensor) -> torch.Tensor:
        return values.reshape(rows, length, heads, dim).to(device, dtype).transpose(1, 2)

    q = projected(heads, queries, 2.5 * torch.randn((rows, queries, heads, dim), generator=generator))
    k = projected(kv_heads, keys, 2.5 * torch.randn((rows, keys, kv_heads, dim), generator=generator))
    v = projected(kv_heads, keys, _spread((rows, keys, kv_heads, dim), generator, 12))
    return q, k, v


def _cancelling_rows(heads: int, kv_heads: int, dim: int, dtype, device, width: int, rows: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """Rows of a pass whose query ``target[b]`` (one of a group of ``width`` padded to the group's longest) sums
    values that cancel around its last keys: every query is 0 (all keys weigh 1), the values are small but for a
    large ``+B`` among the query's last 4 keys and ``-B`` a few keys before it. What the sum keeps of the small
    values then depends on the order the kernel takes the terms in, so a kernel that orders a query's last keys
    otherwise once they are padded gives it other bits. Returns query, key, value, the rows' ends and targets."""
    ends, targets = [], []
    for _ in range(rows):
        group = 16 + int(torch.randint(0, 1400 // width, (1,), generator=generator)) * width  # (a whole group)
        ends.append(list(range(group, group + width)))
        targets.append(int(torch.randint(0, width - 1, (1,), generator=generator)))  # (any but the longest)
    keys = max(map(max, ends))
    value = torch.randn((rows, keys, kv_heads, dim), generator=generator)
    for b, row in enumerate(ends):
        plus = row[targets[b]] - 1 - int(torch.randint(0, 4, (1,), generator=generator))
        minus = plus - 1 - int(torch.randint(0, 8, (1,), generator=generator))
        big = _spread((kv_heads, dim), generator, 6) * 2.0**17
        value[b, plus], value[b, minus] = big, -big
    q = torch.zeros((rows, heads, width, dim), dtype=dtype, device=device)
    k = torch.randn((rows, keys, kv_heads, dim), generator=generator).to(device, dtype).transpose(1, 2)
    return q, k, value.to(device, dtype).transpose(1, 2), ends, targets


def _exact_widths(module, sdpa: Callable, heads: int, kv_heads: int, dim: int, dtype, device, kwargs: dict) -> list[int]:
    """The groupings (2, 4, 8, 16) with which :func:`_grouped_sdpa` gives every query the bits of its own one-token
    call, for this attention geometry on this device, and 1 (each query its own call: exact by construction).

    Grouping pads a query's keys to its group's longest and masks the rest, which is exact only if the kernel sums
    the query's keys in the same order whatever the padding. On a 2-core EPYC (bf16, torch's CPU flash kernel, MKL's
    bf16 gemm) a query's last ``K % 4`` keys are summed otherwise once padded past a multiple of 4; it changes a
    query's bits only where its last keys weigh much, which Gaussian data almost never shows and real text does.
    So each width is checked on rows built to show it (:func:`_cancelling_rows`), 32 per width, and on Gaussian
    rows with widely spread scores (:func:`_attention_inputs`) over key counts either side of the kernel's blocks.
    """
    generator = torch.Generator().manual_seed(2)

    def alone(q, k, v, b: int, i: int, end: int) -> torch.Tensor:  # [1, 1, heads, dim]
        return sdpa(module, q[b : b + 1, :, i : i + 1], k[b : b + 1, :, :end], v[b : b + 1, :, :end], None, **kwargs)[0]

    spread_ends = [[start + i for i in range(16)] for start in (1, 296, 504, 1100)]
    q_s, k_s, v_s = _attention_inputs(heads, kv_heads, dim, dtype, device, len(spread_ends), 16,
                                      max(map(max, spread_ends)), generator)
    widths = [1]
    for width in (2, 4, 8, 16):
        q, k, v, ends, targets = _cancelling_rows(heads, kv_heads, dim, dtype, device, width, 32, generator)
        grouped = _grouped_sdpa(module, q, k, v, ends, width, **kwargs)[0]
        exact = all(torch.equal(grouped[b, i], alone(q, k, v, b, i, ends[b][i])[0, 0]) for b, i in enumerate(targets))
        picked = [[end for end in row if end % 16 < width] for row in spread_ends]
        grouped = _grouped_sdpa(module, q_s[:, :, :width], k_s, v_s, picked, width, **kwargs)[0]
        exact = exact and all(torch.equal(grouped[b, i], alone(q_s, k_s, v_s, b, i, end)[0, 0])
                              for b, row in enumerate(picked) for i, end in enumerate(row))
        if exact:
            widths.append(width)
    return widths


def _calibrate_attention(module, sdpa: Callable, heads: int, kv_heads: int, dim: int, dtype, device, kwargs: dict) -> dict:
    """The cheapest exact grouping (:func:`_exact_widths`) for a pass of ``_TIMED_ROWS`` queries after
    ``_TIMED_KEYS`` tokens, with the milliseconds it and the ordinary multi-query call take."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = _attention_inputs(heads, kv_heads, dim, dtype, device, 1, _TIMED_ROWS, _TIMED_KEYS, generator)
    ends = [[_TIMED_KEYS - _TIMED_ROWS + i + 1 for i in range(_TIMED_ROWS)]]
    strategies = {width: functools.partial(_grouped_sdpa, module, q, k, v, ends, width, **kwargs)
                  for width in _exact_widths(module, sdpa, heads, kv_heads, dim, dtype, device, kwargs)}
    width = cheapest(strategies)
    mask = (torch.arange(_TIMED_KEYS, device=device) < torch.tensor(ends[0], device=device)[:, None])[None, None]
    return {"width": width, "exact_ms": seconds_of(strategies[width]) * 1e3,
            "ordinary_ms": seconds_of(lambda: sdpa(module, q, k, v, mask, **kwargs)) * 1e3}


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
        self._group_widths: dict[tuple, int] = {}
        by_shape: dict[tuple, dict] = {}
        plans = []  # (layer, its calibration) of those a multi-row pass rounds otherwise
        plain = []  # the others: exact as they are for up to _CALIBRATION_ROWS rows
        for module in model.modules():
            if type(module) in (torch.nn.Linear, Conv1D):
                shape = (module.weight.shape, module.weight.stride(), module.weight.dtype, module.weight.device,
                         module.bias is not None)
                if shape not in by_shape:
                    by_shape[shape] = _linear_calibration(module)
                if by_shape[shape]["rows"] < _CALIBRATION_ROWS:
                    plans.append((module, by_shape[shape]))
                else:
                    plain.append(_ExactLinear(module, _CALIBRATION_ROWS, False))
        # Column-major copies of row-major weights, where they pay, unless they would take half the spare memory.
        copies = sum(layer.weight.nbytes for layer, found in plans if found["by_columns"] and _needs_copy(layer))
        spare = _spare_bytes(next(model.parameters()).device)
        self.copied_bytes = copies if spare is None or copies <= spare // 2 else 0
        if copies and not self.copied_bytes:
            warnings.warn(
                f"Row-exact verification would need column-major copies of {copies / 2**30:.1f} GiB of weights to be "
                "fast, more than half the free memory; it computes those layers row by row instead, which makes "
                "verification passes slow. Store the model's weights column-major "
                "(weight.data = weight.data.t().contiguous().t()) or pass row_exact=False.",
                stacklevel=2,
            )
        self.linears = [
            _ExactLinear(layer, found["columns"], True)
            if found["by_columns"] and (self.copied_bytes or not _needs_copy(layer))
            else _ExactLinear(layer, found["rows"], False)
            for layer, found in plans
        ]
        self.head = _Head.of(model, self.linears)
        calibrations = [_linear_calibration(module) for module in model.modules() if type(module) in (torch.nn.Linear, Conv1D)]
        # milliseconds of a pass's linear layers, exact and ordinary, and of each attention layer (once calibrated)
        self.linear_ms = (sum(found["exact_ms"] for found in calibrations), sum(found["ordinary_ms"] for found in calibrations))
        self.attention_ms: dict[int, tuple[float, float]] = {}
        self._noted = False  # whether the cost of exactness here was weighed (see _note_cost)
        self.plain_linears = plain  # chunked only in passes wider than calibrated (batches)

    def _attention(self, inner_of: Callable, cache, ends: list[list[int]] | None, paths: list | None) -> Callable:
        def window_of(module: torch.nn.Module) -> int | None:
            index = getattr(module, "layer_idx", None)
            if index is None or index >= len(cache.layers):
                return None
            return getattr(cache.layers[index], "sliding_window", None)

        plans: dict[tuple, list[tuple]] = {}  # the pass's query groups: made once, the same in every layer
        # a tree's queries whose ancestors are not the tokens before them: computed by _tree_row alone
        n = len(ends[0]) if ends else 0
        off_path = frozenset(b * n + i for b, row in enumerate(paths or []) if row is not None
                             for i, path in enumerate(row) if path is not None)

        def plan(ends: list[list[int]], width: int, device: torch.device, skip: frozenset = frozenset()) -> list[tuple]:
            key = (width, tuple(map(tuple, ends)), skip)
            if key not in plans:
                plans[key] = _group_plan(ends, width, device, skip)
            return plans[key]

        def attention(module, query, key, value, attention_mask, **kwargs):
            # query: [batch, heads, rows, dim]; key, value: [batch, kv_heads, keys, dim]; the last row is the newest
            inner = inner_of(module)
            if ends is not None:  # a batch whose row b's query i sees that row's keys up to ends[b][i]
                window = window_of(module)
                width = 1 if window is not None else self._group_width(module, query, key, kwargs, inner)
                self._note_cost(len(cache.layers))
                if width > 1:
                    out = _grouped_sdpa(module, query, key, value, ends, width,
                                       plan=plan(ends, width, query.device, off_path), **kwargs)[0]
                else:
                    outputs = []  # each [1, 1, heads, dim]
                    for b, row in enumerate(ends):
                        for i, end in enumerate(row):
                            start, mask = self._one_token_call(window, end, attention_mask[b : b + 1, :, i : i + 1])
                            outputs.append(inner(module, query[b : b + 1, :, i : i + 1], key[b : b + 1, :, start:end],
                                                 value[b : b + 1, :, start:end], mask, **kwargs)[0])
                    out = torch.cat(outputs, dim=1).reshape(len(ends), len(ends[0]), *outputs[0].shape[2:])
                for b, row_paths in enumerate(paths or []):
                    if row_paths is not None:
                        self._tree_row(out, b, module, query, key, value, attention_mask, row_paths, ends[b], window,
                                       width, inner, kwargs, plan)
                return out, None
            if query.shape[2] == 1:
                return inner(module, query, key, value, attention_mask, **kwargs)
            calls = self._one_token_calls(window_of(module), query.shape[2], key.shape[2], attention_mask)
            if query.shape[0] == 1 and all(mask is None and start == 0 for start, _, mask in calls):
                width = self._group_width(module, query, key, kwargs, inner)
                self._note_cost(len(cache.layers))
                if width > 1:
                    ends_one = [[end for _, end, _ in calls]]
                    return _grouped_sdpa(module, query, key, value, ends_one, width, plan=plan(ends_one, width, query.device),
                                         **kwargs)
            outputs = [
                inner(module, query[:, :, i : i + 1], key[:, :, start:end], value[:, :, start:end], mask, **kwargs)[0]
                for i, (start, end, mask) in enumerate(calls)
            ]  # each [batch, 1, heads, dim]
            return torch.cat(outputs, dim=1), None

        return attention

    def _note_cost(self, layers: int) -> None:
        """Warn once if, by the calibrations, a row-exact pass of ``_TIMED_ROWS`` tokens costs over twice an ordinary
        one here (``layers`` attention layers, each costed as the calibrated one)."""
        if self._noted or not self.attention_ms:
            return
        self._noted = True
        exact, ordinary = (self.linear_ms[i] + layers * max(ms[i] for ms in self.attention_ms.values()) for i in (0, 1))
        if exact > 2 * ordinary:
            warnings.warn(
                f"On this machine a row-exact verification pass over {_TIMED_ROWS} tokens costs about "
                f"{exact / ordinary:.1f}x an ordinary one (its attention kernel gives a query its one-token bits only "
                "when computed alone), so drafts gain less; the cost model sends only those that still pay. "
                "row_exact=False (--no-row-exact) verifies the ordinary way: faster, but greedy output may then "
                "leave model.generate's after a near-tie.", stacklevel=2)

    def _tree_row(self, out, b: int, module, query, key, value, attention_mask, paths: list, ends: list[int],
                  window: int | None, width: int, inner: Callable, kwargs: dict, plan: Callable) -> None:
        """Recompute in ``out`` (``[B, n, heads, dim]``) the queries of batch row ``b`` (a tree) whose ancestors
        are not the block tokens before them (``paths[i]``: the block indices of query ``i``'s ancestors and
        itself; ``None`` where they are): as a one-token step at its place computes it, over the row's cache
        followed by its path. Each branch's path is written over the row's block in ``key`` and ``value`` for its
        queries, so that its keys follow the cache without a copy of it; the block is put back afterwards."""
        cached = ends[0] - 1  # the row's keys before its block
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
                out[b, members] = _grouped_sdpa(module, query[b : b + 1, :, members], k, v, [member_ends], width,
                                                plan=plan([member_ends], width, key.device), **kwargs)[0][0]
            else:
                for i, end in zip(members, member_ends):
                    # its one-token step sees all of these keys (a bool mask: True; eager's additive one: 0)
                    fill = torch.ones if attention_mask.dtype == torch.bool else torch.zeros
                    visible = fill((1, 1, 1, end), dtype=attention_mask.dtype, device=attention_mask.device)
                    start, mask = self._one_token_call(window, end, visible)
                    out[b, i] = inner(module, query[b : b + 1, :, i : i + 1], k[..., start:end, :],
                                      v[..., start:end, :], mask, **kwargs)[0][0, 0]
            done.update(members)
        for t, block in zip((key, value), saved):
            t[b, :, cached : cached + len(paths)] = block

    def _one_token_calls(self, window: int | None, rows: int, keys: int, attention_mask) -> list[tuple]:
        """For each query row of a one-row pass, the keys ``[start, end)`` and the mask a one-token step at its
        position attends with."""
        calls = []
        for i, end in enumerate(range(keys - rows + 1, keys + 1)):
            start, mask = self._one_token_call(window, end, None if attention_mask is None else attention_mask[:, :, i : i + 1])
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
            if self.implementation == "sdpa" and mask.dtype == torch.bool and unbounded and bool(mask.all()):
                mask = None
        return start, mask

    def _group_width(self, module, query: torch.Tensor, key: torch.Tensor, kwargs: dict, sdpa: Callable) -> int:
        """The grouping :func:`_grouped_sdpa` uses for this attention geometry on this device (1: one call per
        row): the cheapest of those that give every row the bits of its own one-token call (:func:`_exact_widths`),
        timed on a pass of ``_TIMED_ROWS`` queries; calibrated once per machine (:mod:`specula.calibration`)."""
        if self.implementation != "sdpa" or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS):
            return 1
        kwargs = {name: kwargs[name] for name in ("dropout", "scaling") if name in kwargs}
        geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device, kwargs.get("scaling"))
        if geometry not in self._group_widths:
            heads, kv_heads, dim, dtype, device, scaling = geometry
            found = calibration.shared().get(
                calibration_key(device, "attention", heads, kv_heads, dim, dtype, scaling),
                lambda: _calibrate_attention(module, sdpa, heads, kv_heads, dim, dtype, device, kwargs),
            )
            calibration.shared().tell()
            self._group_widths[geometry] = found["width"]
            self.attention_ms[getattr(module, "layer_idx", id(module))] = (found["exact_ms"], found["ordinary_ms"])
        return self._group_widths[geometry]

    @contextlib.contextmanager
    def applied(self, cache, ends: list[list[int]] | None = None, paths: list | None = None,
                argmax_only: bool = False) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Within the block, every multi-token pass of the model over ``cache`` (whose layers say which attention
        layers keep a sliding window) is row-exact. For a batch whose rows keep their own lengths, ``ends[b][i]``
        is how many keys of row ``b`` its query ``i`` sees (its keys start at slot 0: no padding). ``paths[b]``,
        for a row whose block is a tree, gives for each query the block indices of its ancestors and itself, or
        ``None`` where those are just the block tokens before it.

        Yields what turns the pass's logits into the ones to use. With ``argmax_only`` (greedy decoding that takes
        the argmax of the logits as they are), those are exact only where the argmax could change: the LM head
        feeds no cache, so it runs the ordinary way and only rows it cannot certify are computed again (:class:`_Head`).
        """
        mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
        saved = mapping.get(self.implementation)
        if self.implementation == "sdpa":
            sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            inner_of = lambda module: sdpa  # noqa: E731
        else:
            inner_of = lambda module: sys.modules[type(module).__module__].eager_attention_forward  # noqa: E731
        mapping[self.implementation] = self._attention(inner_of, cache, ends, paths)
        linears = self.linears
        if ends is not None and sum(map(len, ends)) > _CALIBRATION_ROWS:  # wider than any width calibrated
            linears = linears + self.plain_linears
        head = self.head.pass_(argmax_only) if self.head is not None else None
        if head is not None and head.shortcut:
            linears = [linear for linear in linears if linear is not self.head.exact]
        for linear in linears:
            linear.layer.forward = linear.forward
        try:
            yield (lambda logits: logits) if head is None else head.logits
        finally:
            for linear in linears:
                del linear.layer.forward
            if head is not None:
                head.close()
            if saved is None:
                del mapping[self.implementation]
            else:
                mapping[self.implementation] = saved


class _Head:
    """The LM head of a model whose head rounds a row otherwise in a multi-row pass than alone, for greedy passes
    that only need each row's argmax (``model.generate``'s token) to be exact.

    Such a head runs the ordinary way; a row whose argmax the rounding cannot have changed keeps those logits, and
    the others are computed again exactly. The bound: a logit is ``z_j = sum_i h_i W_ji``, summed in float32 in some
    order and rounded once to the model's dtype. Summed in any order, ``|sum - z_j| <= gamma_d * sum_i |h_i W_ji|``
    with ``gamma_d = d u / (1 - d u)``, ``u = 2**-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    3.1), and ``sum_i |h_i W_ji| <= |h| |W_j|`` (Cauchy-Schwarz); rounding moves each result by at most half a unit
    in the last place. So ordinary and exact logits differ by at most ``D_j = 2 gamma_d |h| |W_j| + U_j``, with
    ``U_j`` a unit in the last place one binade above ``|z_j|`` (plus a term for denormals flushed to zero), and the
    ordinary argmax ``a`` is the exact one (the first of the maxima, as ``argmax`` takes it, with no tie) wherever
    ``z_a - z_j > D_a + D_j`` for every other ``j``; :meth:`certain` checks it in float32 with the norms rounded up.
    Only on CPUs and GPUs that sum in float32 (a GPU allowed reduced-precision reductions is not covered), for a
    head without bias whose output the model returns as its logits (not softcapped or scaled: checked on the first
    pass, where the head is still exact).
    """

    def __init__(self, exact: _ExactLinear) -> None:
        self.exact, self.layer = exact, exact.layer
        self.returned: bool | None = None  # whether the model's logits are the head's output (seen on a first pass)
        d = self.layer.weight.shape[1]
        self.gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
        self.eps = torch.finfo(self.layer.weight.dtype).eps  # a unit in the last place of 1.0 in the head's dtype
        self._norms: tuple[tuple[int, int], torch.Tensor, float] | None = None  # (weight version, |W_j|, max)
        self.norms()  # (now, while the model is being set up: a second for a 151936-token head, not in a timed pass)

    @classmethod
    def of(cls, model: torch.nn.Module, linears: list[_ExactLinear]) -> "_Head | None":
        """The model's head where it is among the layers computed row-exactly and the bound covers it."""
        layer = model.get_output_embeddings()
        exact = next((linear for linear in linears if linear.layer is layer), None)
        if exact is None or not isinstance(layer, torch.nn.Linear) or layer.bias is not None:
            return None
        device, dtype = layer.weight.device, layer.weight.dtype
        if device.type == "cuda":
            matmul = torch.backends.cuda.matmul
            if (matmul.allow_bf16_reduced_precision_reduction if dtype == torch.bfloat16
                    else matmul.allow_fp16_reduced_precision_reduction):
                return None
        elif device.type != "cpu":
            return None
        return cls(exact)

    def norms(self) -> tuple[torch.Tensor, float]:
        """``|W_j|`` per token (float32, rounded up) and their largest, kept until the weight changes."""
        version = (self.layer.weight.data_ptr(), self.layer.weight._version)
        if self._norms is None or self._norms[0] != version:
            norms = torch.linalg.vector_norm(self.layer.weight.detach().float(), dim=-1) * (1 + 2**-10)
            self._norms = (version, norms, float(norms.max()))
        return self._norms[1:]

    def certain(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Of ordinary-head ``logits`` ``[rows, vocab]`` from ``hidden`` ``[rows, d]``: whether each row's argmax
        is the exact head's (see the class). First with the row's largest bound for every token (its top two and
        largest magnitude: cheap), then token by token for the rows that leaves in doubt."""
        h = torch.linalg.vector_norm(hidden.float(), dim=-1) * (1 + 2**-10)  # [rows]
        norms, widest = self.norms()  # [vocab]; their largest
        flushed = hidden.shape[-1] * 2.0**-126 * (1 + float(h.max()) + widest)
        best = logits.topk(2, dim=-1).values.float()  # [rows, 2]
        bound = 2 * self.gamma * h * widest + flushed + self._ulp(logits.abs().amax(dim=-1).float())  # [rows]
        certain = best[:, 0] - best[:, 1] > 2 * bound
        doubtful = torch.nonzero(~certain).flatten()
        if len(doubtful):
            z = logits[doubtful].float()  # [doubtful, vocab]
            top, first = z.max(dim=-1, keepdim=True)
            bound = 2 * self.gamma * h[doubtful, None] * norms + flushed + self._ulp(torch.maximum(z.abs(), top.abs()))
            clear = (top - z) > bound + bound.gather(1, first)  # [doubtful, vocab]: z_a - z_j > D_a + D_j
            certain[doubtful] = clear.scatter_(1, first, True).all(dim=-1)
        return certain

    def _ulp(self, magnitude: torch.Tensor) -> torch.Tensor:
        """A unit in the last place of the head's dtype one binade above ``magnitude`` (float32)."""
        tiny = torch.finfo(torch.float32).tiny
        return self.eps * torch.exp2(torch.floor(torch.log2(magnitude.clamp(min=tiny))) + 1)

    def pass_(self, argmax_only: bool) -> "_HeadPass":
        return _HeadPass(self, shortcut=argmax_only and self.returned is True)


class _HeadPass:
    """One pass's view of the head: what it computed (watched with a hook), and the logits to use."""

    def __init__(self, head: _Head, shortcut: bool) -> None:
        self.head, self.shortcut, self.seen = head, shortcut, {}
        self.recomputed = 0  # rows whose argmax the bound could not certify
        self._hook = None
        if shortcut or head.returned is None:
            self._hook = head.layer.register_forward_hook(lambda module, args, out: self.seen.update(hidden=args[0], out=out))

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The pass's ``logits`` ``[..., vocab]``, fixed where the ordinary head may have changed an argmax."""
        out = self.seen.get("out")
        returned = out is not None and logits.data_ptr() == out.data_ptr() and logits.shape == out.shape
        if self.head.returned is None:
            self.head.returned = returned
        if not self.shortcut:
            return logits
        if not returned:
            raise RuntimeError("the LM head's output is no longer the model's logits; cannot certify its argmax")
        flat, hidden = logits.reshape(-1, logits.shape[-1]), self.seen["hidden"].reshape(-1, self.seen["hidden"].shape[-1])
        doubtful = torch.nonzero(~self.head.certain(flat, hidden)).flatten()
        self.recomputed = len(doubtful)
        if self.recomputed:
            flat = flat.clone()
            flat[doubtful] = self.head.exact.forward(hidden[doubtful][None])[0]
        return flat.reshape(logits.shape)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_exact_for(model: torch.nn.Module) -> RowExact:
    """The :class:`RowExact` of ``model``, built on first use (its checks take well under a second)."""
    weight = next(model.parameters())
    setting = (weight.dtype, weight.device, model.config._attn_implementation)
    if model not in _BUILT or _BUILT[model][0] != setting:  # (built again after model.to() or a new attention)
        _BUILT[model] = (setting, RowExact(model))
        calibration.shared().tell()
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
