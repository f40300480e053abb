"""Attention of verification passes on a CPU by a kernel of specula's own: every query computed the same way whatever
its pass.

torch's CPU flash kernel computes a pass's attention in blocks of queries and keys, each block's products by a matrix
product call; with the few queries of a decoding pass (a row's token or its drafts, the query heads of a key/value
head folded) most of its time goes to those calls' overhead, not to reading the keys and values (traced:
docs/hardware.md). And what it rounds depends on how many queries share a call and how many keys it covers, so that
invariant passes had to pad both (:mod:`specula.verifier.invariant`). :func:`attend` reads each row's keys and values
once per key/value head, for all the queries of that head, in one parallel call a layer, and computes each query from
its own visible keys only, in an order fixed by them: its scores, their largest, their exponentials summed in
:data:`LANES` running sums, its values summed key by key. So a query's result does not depend on the pass's width,
its batch mates, or the keys the call covers beyond its own, and nothing needs padding. bf16 keys and values are
widened to fp32 as they are read; scores and sums are fp32 throughout (flash rounds its probabilities to bf16 before
summing the values).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import carray

from .threads import kernel_threads

LANES = 16  # running sums of a query's exponentials (the widest vector of fp32 here)
HEAD_UNIT = 8  # a head's length is told the compiled code as a tuple of this many times fewer items
ROWS = 4  # queries whose values are summed together (each key's values read once for them)
DTYPES = {torch.bfloat16: np.uint16, torch.float32: np.float32}  # keys' and values' dtypes read (as numpy holds them)
LOG2E = np.float32(1.4426950408889634)
LN2 = (np.float32(0.693359375), np.float32(-2.12194440e-4))  # ln 2 in two parts (the first exact in few bits)
EXP_LOW = np.float32(-87.0)  # from it down, exp underflows fp32's normal numbers: 0
MAX_TUPLE = 100  # the longest tuple numba passes into a parallel loop (NUMBA_PARFOR_MAX_TUPLE_SIZE)
PARALLEL_WORK = 4096  # keys of all a call's rows and key/value heads, from which its heads are read in parallel
MOST_TOKENS = 128  # tokens of a row a call may hold (a verification pass's; more, a prompt's, are torch's to attend)


@intrinsic
def _stack_head(typingctx, head):
    """A pointer to a head's fp32 (``head``: as :func:`_scores` takes it) on the stack, which the compiler may hold in
    registers, as it never would heap memory a loop writes."""

    def codegen(context, builder, signature, args):
        size = context.get_constant(types.intp, len(head) * HEAD_UNIT)
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=size)

    return types.CPointer(types.float32)(head), codegen


@njit(cache=True, nogil=True, fastmath={"contract"})
def exp_below_zero(x: np.ndarray, n: int, out: np.ndarray, bits: np.ndarray) -> None:
    """``out[j] = exp(x[j])`` for ``j < n`` (``x <= 0``, ``-inf`` allowed; 0 from :data:`EXP_LOW` down), with a
    polynomial the compiler vectorizes (``bits``: int32 scratch of ``n``), within 2 ulp.

    Worked example: ``x = -1.0`` is ``2**k * exp(r)`` with ``k = round(-1 * log2(e)) = -1`` and
    ``r = -1 + ln 2 = -0.30685``; ``exp(r) = 0.73576`` (its polynomial), times ``2**-1`` (the bits ``(k + 127) << 23``
    as a float): ``0.36788``.
    """
    for j in range(n):
        v = max(x[j], EXP_LOW)
        k = np.floor(v * LOG2E + np.float32(0.5))
        r = v - k * LN2[0] - k * LN2[1]
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        bits[j] = (np.int32(k) + 127) << 23
        out[j] = p * r * r + r + np.float32(1.0)
    scale = bits[:n].view(np.float32)
    for j in range(n):
        out[j] = out[j] * scale[j] if x[j] > EXP_LOW else np.float32(0.0)


def _widen(source, start, n, wide):
    """``wide[:n] = source[start:start + n]`` as fp32 (bf16 held as uint16: its bits the top half of an fp32's)."""


@overload(_widen, jit_options={"cache": True, "nogil": True, "fastmath": {"contract"}})
def _widen_typed(source, start, n, wide):
    if source.dtype == types.uint16:

        def widen_bf16(source, start, n, wide):
            bits, read = wide.view(np.uint32), source[start : start + n]  # (indices from 0: no wraparound checks)
            for x in range(n):
                bits[x] = np.uint32(read[x]) << 16

        return widen_bf16

    def widen(source, start, n, wide):
        read = source[start : start + n]
        for x in range(n):
            wide[x] = read[x]

    return widen


def _read(source, x):
    """``source[x]`` as fp32 (bf16 held as uint16: its bits the top half of an fp32's)."""


@overload(_read, jit_options={"cache": True, "nogil": True, "inline": "always"})
def _read_typed(source, x):
    if source.dtype == types.uint16:
        return lambda source, x: np.uint32(np.uint32(source[x]) << 16).view(np.float32)
    return lambda source, x: source[x]


def _write(target, x, value):
    """``target[x] = value`` (fp32) in ``target``'s dtype (bf16 held as uint16: rounded to nearest even, as torch
    rounds)."""


@overload(_write, jit_options={"cache": True, "nogil": True, "inline": "always"})
def _write_typed(target, x, value):
    if target.dtype == types.uint16:

        def write_bf16(target, x, value):
            bits = np.float32(value).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            target[x] = np.uint16(0x7FC0) if value != value else np.uint16(rounded)

        return write_bf16

    def write(target, x, value):
        target[x] = value

    return write


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _scores(head, query, keys, start, last, scores):
    """``scores[r, j] = query[r] . key j`` for ``j < last``, key ``j`` read (and widened) from ``keys`` at
    ``start + j * dim`` (``head``: a tuple :data:`HEAD_UNIT` times shorter than a head, whose length the compiler
    takes as a constant)."""
    dim = len(head) * HEAD_UNIT
    wide = carray(_stack_head(head), (dim,))  # (a key widened once for all the queries: in registers)
    for j in range(last):
        key = keys[start + j * dim : start + (j + 1) * dim]  # (indices from 0: no wraparound checks)
        for d in range(dim):
            wide[d] = _read(key, d)
        for r in range(query.shape[0]):
            s = np.float32(0.0)
            for d in range(dim):
                s += query[r, d] * wide[d]
            scores[r, j] = s


@njit(cache=True, nogil=True, fastmath={"nnan", "reassoc", "contract"})
def _largest(x: np.ndarray, n: int, part: np.ndarray) -> np.float32:
    """The largest of ``x[:n]``, in :data:`LANES` running maxima (``part``: their scratch), which the compiler
    vectorizes (one running maximum it does not)."""
    part[:] = -np.inf
    whole = n // LANES * LANES
    for j0 in range(0, whole, LANES):
        for lane in range(LANES):
            part[lane] = max(part[lane], x[j0 + lane])
    top = np.float32(-np.inf)
    for j in range(whole, n):
        top = max(top, x[j])
    for lane in range(LANES):
        top = max(top, part[lane])
    return top


@njit(cache=True, nogil=True, fastmath={"nnan", "reassoc", "contract"})
def _softmax(scores, visible, n, ends, probs, bits, sums):
    """Each query's (row ``r``, token ``r % n``) exponentials of its scores less their largest, over its own keys
    (``< ends``, where ``visible``), in ``probs``, and their sum in ``sums`` (1 where it sees no key)."""
    part = np.empty(LANES, np.float32)
    for r in range(len(sums)):
        i, e = r % n, ends[r % n]
        for j in range(e):
            scores[r, j] = scores[r, j] if visible[i, j] else np.float32(-np.inf)
        top = _largest(scores[r], e, part)
        if top == -np.inf:  # (it sees no key: zeros)
            sums[r] = np.float32(1.0)
            continue
        lanes = -(-e // LANES) * LANES
        for j in range(e):
            scores[r, j] -= top
        for j in range(e, lanes):
            scores[r, j] = np.float32(-np.inf)
        exp_below_zero(scores[r], lanes, probs[r], bits)
        part[:] = 0.0
        for j0 in range(0, lanes, LANES):
            for lane in range(LANES):
                part[lane] += probs[r, j0 + lane]
        s = np.float32(0.0)
        for lane in range(LANES):
            s += part[lane]
        sums[r] = s


@njit(cache=True, nogil=True, fastmath={"contract"})
def _values(head, probs, n, ends, values, start, sums, out, first):
    """Query row ``r``'s ``(sum over keys j of probs[r, j] * value j) / sums[r]`` into ``out[r % n, first + r // n]``
    (``out``: ``[n, heads, dim]``, the row's), :data:`ROWS` queries at a time, key by key, value ``j`` read from
    ``values`` at ``start + j * dim`` (``head``: as :func:`_scores`'s)."""
    dim = len(head) * HEAD_UNIT
    a0 = carray(_stack_head(head), (dim,))  # (one alloca each: the compiler holds them in registers)
    a1 = carray(_stack_head(head), (dim,))
    a2 = carray(_stack_head(head), (dim,))
    a3 = carray(_stack_head(head), (dim,))
    for r0 in range(0, len(sums), ROWS):
        e = 0
        for r in range(r0, min(r0 + ROWS, len(sums))):
            e = max(e, ends[r % n])
        a0[:] = 0.0
        a1[:] = 0.0
        a2[:] = 0.0
        a3[:] = 0.0
        for j in range(e):  # (in key order: past a query's own end its probabilities are 0, adding nothing)
            p0, p1, p2, p3 = probs[r0, j], probs[r0 + 1, j], probs[r0 + 2, j], probs[r0 + 3, j]
            value = values[start + j * dim : start + (j + 1) * dim]
            for d in range(dim):
                x = _read(value, d)
                a0[d] += p0 * x
                a1[d] += p1 * x
                a2[d] += p2 * x
                a3[d] += p3 * x
        for r in range(r0, min(r0 + ROWS, len(sums))):
            inverse = np.float32(1.0) / sums[r]
            held = a0 if r == r0 else a1 if r == r0 + 1 else a2 if r == r0 + 2 else a3
            row = out[r % n, first + r // n]
            for d in range(dim):
                _write(row, d, held[d] * inverse)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _queries(query, first, group, scale, out):
    """``out[g * n + i] = query[i, first + g] * scale`` in fp32 (``query``: ``[n, heads, dim]``, the row's)."""
    n = query.shape[0]
    for g in range(group):
        for i in range(n):
            _widen(query[i, first + g], 0, out.shape[1], out[g * n + i])
            for d in range(out.shape[1]):
                out[g * n + i, d] *= scale


@njit(cache=True, nogil=True)
def _attend_head(head, query, scale, heads, keys, key_at, values, value_at, visible, ends, out, offsets, item):
    """Item ``item`` of :func:`attend_kernel`'s work: row ``item // heads``'s key/value head ``item % heads``, all
    its queries."""
    query_heads, dim = query.shape[1:]
    b, h = item // heads, item % heads
    first, n = offsets[b], offsets[b + 1] - offsets[b]  # (the row's tokens)
    group = query_heads // heads
    rows = group * n
    queries = np.empty((rows, dim), np.float32)
    _queries(query[first : first + n], h * group, group, scale, queries)
    seen, row_ends, row_out = visible[first : first + n], ends[first : first + n], out[first : first + n]
    last = 0
    for i in range(n):
        last = max(last, row_ends[i])
    padded = -(-last // LANES) * LANES
    scores = np.empty((rows, padded), np.float32)
    probs = np.zeros((-(-rows // ROWS) * ROWS, padded), np.float32)
    bits = np.empty(padded, np.int32)
    sums = np.empty(rows, np.float32)
    _scores(head, queries, keys, key_at[0] + b * key_at[1] + h * key_at[2], last, scores)
    _softmax(scores, seen, n, row_ends, probs, bits, sums)
    _values(head, probs, n, row_ends, values, value_at[0] + b * value_at[1] + h * value_at[2], sums, row_out, h * group)


@njit(cache=True, nogil=True, parallel=True)
def attend_kernel(head, query, scale, heads, keys, key_at, values, value_at, visible, ends, out, offsets):
    """Each query's attention over the keys it sees, one row's key/value head at a time in parallel
    (:func:`attend_serial`: in turn):

    - ``head``: a tuple :data:`HEAD_UNIT` times shorter than a head (``dim``: a constant of the compiled code, so that
      its sums stay in registers);
    - ``query``: ``[T, heads, dim]``, the tokens of every row in turn, row ``b``'s from ``offsets[b]`` to
      ``offsets[b + 1]`` (``n`` of them; bf16 as uint16, or fp32), scaled by ``scale`` as it is read (query head
      ``g`` of a key/value head's group at the row's token ``i`` is that head's row ``g * n + i``);
    - ``heads``: key/value heads;
    - ``keys``, ``values``: the cache's storage, flat (bf16 as uint16, or fp32); ``key_at``, ``value_at``: where
      each row's head starts in it, ``(offset, row stride, head stride)`` (its keys ``dim`` apart);
    - ``visible``: ``[T, keys]`` bool, which keys of its row each token sees; ``ends``: ``[T]``, one past the last it
      sees (0: none);
    - ``out``: ``[T, heads, dim]`` as ``query``, each query's attention (zeros where it sees no key);
    - ``offsets``: ``[B + 1]``, where each row's tokens start (a padded pass of ``n`` tokens a row: ``b * n``).

    Worked example (one row, one token, a head's first two dims, the others 0): the query ``[1, 0]`` over keys
    ``[1, 0]`` and ``[0, 1]`` scores 1 and 0; ``exp(1 - 1) = 1`` and ``exp(0 - 1) = 0.3679`` sum to 1.3679; with
    values ``[1, 2]`` and ``[3, 4]`` the result is ``(1 * [1, 2] + 0.3679 * [3, 4]) / 1.3679 = [1.538, 2.538]``.
    """
    for item in prange((len(offsets) - 1) * heads):
        _attend_head(head, query, scale, heads, keys, key_at, values, value_at, visible, ends, out, offsets, item)


@njit(cache=True, nogil=True)
def attend_serial(head, query, scale, heads, keys, key_at, values, value_at, visible, ends, out, offsets):
    """:func:`attend_kernel` on the calling thread alone: each item's bits the same."""
    for item in range((len(offsets) - 1) * heads):
        _attend_head(head, query, scale, heads, keys, key_at, values, value_at, visible, ends, out, offsets, item)


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tokens: int | None = None) -> bool:
    """Whether :func:`attend` computes this call: on a CPU, at most :data:`MOST_TOKENS` tokens a row (``tokens``;
    ``None``: the query's; its scores take ``tokens x keys`` a row at once), heads of a length it is compiled for, keys
    and values of a dtype it reads, each row's a head's length apart (as the cache's buffers hold them)."""
    return (
        query.device.type == "cpu"
        and (query.shape[2] if tokens is None else tokens) <= MOST_TOKENS
        and query.shape[3] % HEAD_UNIT == 0
        and query.shape[3] // HEAD_UNIT < MAX_TUPLE
        and key.dtype in DTYPES
        and query.dtype == key.dtype == value.dtype
        and all(states.stride(3) == 1 and states.stride(2) == states.shape[3] for states in (key, value))
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: tuple[np.ndarray, np.ndarray],
    scaling: float | None,
    offsets: np.ndarray | None = None,
) -> torch.Tensor:
    """Attention of ``query`` (``[B, heads, n, dim]``) over ``key`` and ``value`` (``[B, kv_heads, keys, dim]``, views
    of the cache's buffers) with the visibility ``visible`` (:func:`visibility`), in the layout transformers'
    attention functions return (``[B, n, heads, dim]``). A flat pass's query (``[1, heads, T, dim]``) holds the
    tokens of every row in turn, row ``b``'s from ``offsets[b]`` to ``offsets[b + 1]`` (``[B + 1]``)."""
    batch, _, n, dim = query.shape
    scale = np.float32(dim**-0.5 if scaling is None else scaling)
    rows = query.transpose(1, 2).reshape(batch * n, -1, dim)  # [T, heads, dim] (as the projection made it: no copy)
    out = torch.empty(rows.shape, dtype=query.dtype)  # [T, heads, dim]
    if offsets is None:
        offsets = np.arange(batch + 1) * n
    head, heads = (0,) * (dim // HEAD_UNIT), key.shape[1]
    arguments = (head, _numpy(rows), scale, heads, *_slabs(key), *_slabs(value), *visible, _numpy(out), offsets)
    if torch.get_num_threads() > 1 and key.shape[0] * key.shape[1] * key.shape[2] >= PARALLEL_WORK:
        with kernel_threads():
            attend_kernel(*arguments)
    else:  # (a parallel call's threads wait for each other: little work goes faster on one, whatever else runs)
        attend_serial(*arguments)
    return out.view(batch, n, -1, dim)


def visibility(mask: torch.Tensor | None, batch: int, n: int, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Which keys each token of a pass sees (``mask``: ``[B, 1, n, keys]`` bool, ``None``: all) and one past the last
    it sees, as :func:`attend_kernel` reads them (``[B * n, keys]``, ``[B * n]``; made once a pass)."""
    seen = torch.ones(batch * n, keys, dtype=torch.bool) if mask is None else mask.reshape(batch * n, keys)
    ends = torch.where(seen.any(-1), keys - seen.flip(-1).to(torch.uint8).argmax(-1), 0)
    return seen.contiguous().numpy(), ends.to(torch.int64).numpy()


def _numpy(states: torch.Tensor) -> np.ndarray:
    """``states`` as numpy holds its dtype (bf16 as uint16), no copy (nor gradient: passes compute none)."""
    states = states.detach()
    return (states.view(torch.int16) if states.dtype == torch.bfloat16 else states).numpy().view(DTYPES[states.dtype])


def _slabs(states: torch.Tensor) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The whole storage ``states`` (``[B, kv_heads, keys, dim]``) is a view of, flat, as numpy holds its dtype, and
    where each row's head starts in it: ``(offset, row stride, head stride)``."""
    flat = _numpy(torch.empty(0, dtype=states.dtype).set_(states.untyped_storage()))
    return flat, (states.storage_offset(), states.stride(0), states.stride(1))
