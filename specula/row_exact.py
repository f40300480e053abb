"""Verification passes that compute every token exactly as a one-token step computes it.

A pass over k+1 tokens runs other kernels than a one-token step: in bf16 a matmul over k+1 rows may block its sum
over the inner dimension otherwise than one over 1 row, and attention with k+1 queries reduces otherwise than with
one. The results differ in the last bit now and then, and where two tokens' logits are that close, greedy output
differs from ``model.generate``'s. :class:`RowExact` removes the difference during the verifier's multi-token passes,
without touching the model's own one-token path:

- attention: each query row is computed as the model's own attention function computes a one-token step at its
  position, over the same keys with the same mask (the window of a sliding-window layer included). With SDPA,
  rows whose key counts differ only in the kernel's scalar tail share one call, each as a batch entry of one query
  (:func:`_grouped_sdpa`), where a calibration finds that exact; otherwise each row is a call of its own.
- linear layers: each ``nn.Linear`` (and GPT-2's ``Conv1D``) that gives a row other bits in a pass of several rows
  than alone computes its rows in chunks as wide as it stays exact for (:func:`exact_rows`, on random rows, once
  per weight shape). On a 2-core EPYC with AVX512_BF16, oneDNN blocks an inner dimension of 1536 or more by the
  number of rows beyond 2: SmolLM2-135M's ``down_proj`` (1536 -> 576) is the only layer of that model so affected.

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

# Attention implementations whose one-token calls RowExact can repeat row by row (HF's sdpa and eager functions).
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Arguments of HF's sdpa function that change what it computes beyond plain masked attention.
_SDPA_EXTRAS = ("is_causal", "position_bias", "cache", "softcap", "s_aux", "sinks")
_CALIBRATION_ROWS = 33  # the widest pass the loop sends (MAX_DRAFT + 1)


@torch.inference_mode()
def exact_rows(layer: torch.nn.Module, compute: Callable | None = None, max_rows: int = _CALIBRATION_ROWS) -> int:
    """The most rows (1..max_rows) that ``compute`` (default: ``layer`` itself) takes in one call and still gives
    each of them the bits ``layer`` gives that row alone, found on random rows.

    A kernel that sums in another order for another number of rows changes a bf16 output only where the fp32 sums
    straddle a rounding boundary: ~1 output in 5000 for an inner dimension of 1536. So each width is tried on
    enough rows for 2**17 outputs (some 25 expected differences where there are any).
    """
    ordinary = functools.partial(type(layer).forward, layer)
    compute = compute or ordinary
    generator = torch.Generator().manual_seed(0)
    n = _in_features(layer)
    count = min(max(2**17 * n // layer.weight.numel(), 1), 2048)  # rows for 2**17 outputs
    x = torch.randn(1, count + max_rows, n, generator=generator).to(layer.weight.device, layer.weight.dtype)
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


def _calibrate(layer: torch.nn.Module) -> tuple[int, int]:
    """How many rows ``layer`` computes exactly in one call as it is, and by columns (:func:`_by_columns`; 0 where
    not needed)."""
    rows = exact_rows(layer)
    if rows == _CALIBRATION_ROWS:
        return rows, 0
    return rows, exact_rows(layer, functools.partial(_by_columns, _weight_t(layer), layer.bias))


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

    Where :meth:`RowExact._group_width` finds this exact, it is so because of how torch's CPU flash kernel reduces:
    it takes the keys in blocks of 512 and each block in vectors of 16 floats plus a scalar tail, and the tail's
    exponentials round otherwise than the vectors'. A query over 300 keys has keys 288..299 in the tail; padded to
    303 keys they still are, and the masked keys add exact zeros; padded to 304 they would not be. Hence groups of
    ``end // 16``.
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
        by_shape: dict[tuple, tuple[int, int]] = {}
        plans = []  # (layer, rows exact as it is, rows exact by columns) of those a multi-row pass rounds otherwise
        plain = []  # the others: exact as they are for up to _CALIBRATION_ROWS rows
        for module in model.modules():
            if type(module) in (torch.nn.Linear, Conv1D):
                shape = (module.weight.shape, module.weight.stride(), module.weight.dtype, module.weight.device,
                         module.bias is not None)
                if shape not in by_shape:
                    by_shape[shape] = _calibrate(module)
                if by_shape[shape][0] < _CALIBRATION_ROWS:
                    plans.append((module, *by_shape[shape]))
                else:
                    plain.append(_ExactLinear(module, _CALIBRATION_ROWS, False))
        # Column-major copies of row-major weights, where they pay, unless they would take half the spare memory.
        copies = sum(layer.weight.nbytes for layer, as_is, by_columns in plans
                     if by_columns > as_is and _needs_copy(layer))
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
            _ExactLinear(layer, by_columns, True) if by_columns > as_is and (self.copied_bytes or not _needs_copy(layer))
            else _ExactLinear(layer, as_is, False)
            for layer, as_is, by_columns in plans
        ]
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
        """The widest grouping (16, 8, 4 or 2; 1 for none) with which :func:`_grouped_sdpa` gives every row the bits
        of its own one-token call, for this attention geometry on this device: checked once, on random rows over
        key counts of every residue and either side of the kernel's blocks of 512."""
        if self.implementation != "sdpa" or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS):
            return 1
        kwargs = {name: kwargs[name] for name in ("dropout", "scaling") if name in kwargs}
        geometry = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device, kwargs.get("scaling"))
        if geometry not in self._group_widths:
            generator = torch.Generator().manual_seed(2)
            heads, kv_heads, dim, rows = query.shape[1], key.shape[1], query.shape[3], _CALIBRATION_ROWS

            def rand(heads: int, length: int, batch: int) -> torch.Tensor:  # laid out as a model's projections
                x = torch.randn((batch, length, heads, dim), generator=generator)
                return x.to(query.device, query.dtype).transpose(1, 2)

            def one_token(q, k, v, b: int, i: int, end: int) -> torch.Tensor:  # [1, 1, heads, dim]
                return sdpa(
                    module, q[b : b + 1, :, i : i + 1], k[b : b + 1, :, :end], v[b : b + 1, :, :end], None, **kwargs
                )[0]

            cases = []  # one row, and two rows of a batch whose queries share groups
            for starts in ((0,), (300,), (495,), (1100,), (290, 300)):
                keys = max(starts) + rows
                q, k, v = rand(heads, rows, len(starts)), rand(kv_heads, keys, len(starts)), rand(kv_heads, keys, len(starts))
                ends = [[start + i + 1 for i in range(rows)] for start in starts]
                alone = torch.cat([
                    torch.cat([one_token(q, k, v, b, i, end) for i, end in enumerate(row)], dim=1)
                    for b, row in enumerate(ends)
                ])
                cases.append((q, k, v, ends, alone))
            widths = [w for w in (16, 8, 4, 2) if all(
                torch.equal(_grouped_sdpa(module, q, k, v, ends, w, **kwargs)[0], alone) for q, k, v, ends, alone in cases
            )]
            self._group_widths[geometry] = widths[0] if widths else 1
        return self._group_widths[geometry]

    @contextlib.contextmanager
    def applied(self, cache, ends: list[list[int]] | None = None, paths: list | None = None) -> Iterator[None]:
        """Within the block, every multi-token pass of the model over ``cache`` (whose layers say which attention
        layers keep a sliding window) is row-exact. For a batch whose rows keep their own lengths, ``ends[b][i]``
        is how many keys of row ``b`` its query ``i`` sees (its keys start at slot 0: no padding). ``paths[b]``,
        for a row whose block is a tree, gives for each query the block indices of its ancestors and itself, or
        ``None`` where those are just the block tokens before it."""
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
        for linear in linears:
            linear.layer.forward = linear.forward
        try:
            yield
        finally:
            for linear in linears:
                del linear.layer.forward
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
