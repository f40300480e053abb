"""Attention over groups of a pass's queries, and which groupings are exact and cheapest on this machine.

One SDPA call per group of a row's queries whose key counts differ little, each query a batch entry of its own over
the group's longest keys, those past its own end masked (:func:`_grouped_sdpa`); the group widths that give every
query the bits of its own one-token call (:func:`_exact_widths`), and the cheapest of them
(:func:`_calibrate_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ...machine.timing import cheapest, seconds_of
from ..calibration import TIMED_KEYS, TIMED_ROWS, spread


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


def _grouped_sdpa(
    module,
    query,
    key,
    value,
    ends: list[list[int]],
    width: int,
    dropout: float = 0.0,
    scaling=None,
    plan: list[tuple] | None = None,
    **kwargs,
):
    """Attention of query ``i`` of batch row ``b`` over that row's keys ``[0, ends[b][i])``, with one SDPA call per
    group of a row's queries whose ``end // width`` agree: each query is a batch entry of its own, over the group's
    longest keys (the row's, shared without a copy), the keys past its own end masked (``plan``: the groups, made
    by :func:`_group_plan` where not given; a tree's queries need not come in the order of their key counts).

    Where :meth:`.attention.RowAttention._group_width` finds this exact (:func:`_exact_widths`), it is so because of
    how the attention kernel reduces. torch's CPU flash kernel takes the keys in blocks of 512 and each block in
    vectors of 16 floats plus a scalar tail whose exponentials round otherwise than the vectors': a query over 300
    keys has keys 288..299 in the tail; padded to 303 keys they still are, and the masked keys add exact zeros;
    padded to 304 they would not be. Where its bf16 products go to a BLAS that sums a block's last ``K % 4`` keys
    apart (MKL on some CPUs: ``docs/hardware.md``), only groups of ``end // 4`` keep every query's order.
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
            members,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=heads != k.shape[1],
        ).transpose(1, 2)  # [members, 1, heads, dim]
    return out.reshape(batch, n, heads, dim), None


def _attention_inputs(
    heads: int, kv_heads: int, dim: int, dtype, device, rows: int, queries: int, keys: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``query`` ``[rows, heads, queries, dim]`` and ``key``, ``value`` ``[rows, kv_heads, keys, dim]``, laid
    out as a model's projections, with scores spread as widely as a trained model's (a few keys dominate) and values
    of magnitudes spread over 12 octaves (:func:`specula.verifier.calibration.spread`), so that a changed summation
    order shows."""

    def projected(heads: int, length: int, values: torch.Tensor) -> torch.Tensor:
        return values.reshape(rows, length, heads, dim).to(device, dtype).transpose(1, 2)

    q = projected(heads, queries, 2.5 * torch.randn((rows, queries, heads, dim), generator=generator))
    k = projected(kv_heads, keys, 2.5 * torch.randn((rows, keys, kv_heads, dim), generator=generator))
    v = projected(kv_heads, keys, spread((rows, keys, kv_heads, dim), generator, 12))
    return q, k, v


def _cancelling_rows(
    heads: int, kv_heads: int, dim: int, dtype, device, width: int, rows: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
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
        big = spread((kv_heads, dim), generator, 6) * 2.0**17
        value[b, plus], value[b, minus] = big, -big
    q = torch.zeros((rows, heads, width, dim), dtype=dtype, device=device)
    k = torch.randn((rows, keys, kv_heads, dim), generator=generator).to(device, dtype).transpose(1, 2)
    return q, k, value.to(device, dtype).transpose(1, 2), ends, targets


def _exact_widths(
    module, sdpa: Callable, heads: int, kv_heads: int, dim: int, dtype, device, kwargs: dict
) -> list[int]:
    """The groupings (2, 4, 8, 16) with which :func:`_grouped_sdpa` gives every query the bits of its own one-token
    call, for this attention geometry on this device, and 1 (each query its own call: exact by construction).

    Grouping pads a query's keys to its group's longest and masks the rest, which is exact only if the kernel sums
    the query's keys in the same order whatever the padding. A kernel that sums a query's last keys apart once
    padded past a multiple of 4 (as MKL does on some CPUs: ``docs/hardware.md``) changes a query's bits only where its
    last
    keys weigh much, which Gaussian data almost never shows and real text does. So each width is checked on rows
    built to show it (:func:`_cancelling_rows`), 32 per width, and on Gaussian
    rows with widely spread scores (:func:`_attention_inputs`) over key counts either side of the kernel's blocks.
    """
    generator = torch.Generator().manual_seed(2)

    def alone(q, k, v, b: int, i: int, end: int) -> torch.Tensor:  # [1, 1, heads, dim]
        return sdpa(module, q[b : b + 1, :, i : i + 1], k[b : b + 1, :, :end], v[b : b + 1, :, :end], None, **kwargs)[0]

    spread_ends = [[start + i for i in range(16)] for start in (1, 296, 504, 1100)]
    q_s, k_s, v_s = _attention_inputs(
        heads, kv_heads, dim, dtype, device, len(spread_ends), 16, max(map(max, spread_ends)), generator
    )
    widths = [1]
    for width in (2, 4, 8, 16):
        q, k, v, ends, targets = _cancelling_rows(heads, kv_heads, dim, dtype, device, width, 32, generator)
        grouped = _grouped_sdpa(module, q, k, v, ends, width, **kwargs)[0]
        exact = all(torch.equal(grouped[b, i], alone(q, k, v, b, i, ends[b][i])[0, 0]) for b, i in enumerate(targets))
        picked = [[end for end in row if end % 16 < width] for row in spread_ends]
        grouped = _grouped_sdpa(module, q_s[:, :, :width], k_s, v_s, picked, width, **kwargs)[0]
        exact = exact and all(
            torch.equal(grouped[b, i], alone(q_s, k_s, v_s, b, i, end)[0, 0])
            for b, row in enumerate(picked)
            for i, end in enumerate(row)
        )
        if exact:
            widths.append(width)
    return widths


def _calibrate_attention(
    module, sdpa: Callable, heads: int, kv_heads: int, dim: int, dtype, device, kwargs: dict
) -> dict:
    """The cheapest exact grouping (:func:`_exact_widths`) for a pass of ``TIMED_ROWS`` queries after
    ``TIMED_KEYS`` tokens, with the milliseconds it and the ordinary multi-query call take."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = _attention_inputs(heads, kv_heads, dim, dtype, device, 1, TIMED_ROWS, TIMED_KEYS, generator)
    ends = [[TIMED_KEYS - TIMED_ROWS + i + 1 for i in range(TIMED_ROWS)]]
    strategies = {
        width: functools.partial(_grouped_sdpa, module, q, k, v, ends, width, **kwargs)
        for width in _exact_widths(module, sdpa, heads, kv_heads, dim, dtype, device, kwargs)
    }
    width = cheapest(strategies)
    mask = (torch.arange(TIMED_KEYS, device=device) < torch.tensor(ends[0], device=device)[:, None])[None, None]
    return {
        "width": width,
        "exact_ms": seconds_of(strategies[width]) * 1e3,
        "ordinary_ms": seconds_of(lambda: sdpa(module, q, k, v, mask, **kwargs)) * 1e3,
    }
