"""Numba kernels on the drafting hot path. Each is compiled once (``cache=True`` keeps the machine code on disk).

All kernels take token sequences as 1-D ``int64`` numpy arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def prompt_lookup(tokens: np.ndarray, min_ngram: int, max_ngram: int, max_draft: int) -> np.ndarray:
    """Draft by copying what followed the most recent earlier occurrence of the sequence's longest matching suffix.

    For n from ``max_ngram`` down to ``min_ngram``: look for the last n tokens earlier in ``tokens``, scanning from
    the end so the most recent occurrence wins, and return up to ``max_draft`` tokens that followed it. The copy may
    run past the end of ``tokens`` into the draft itself (as in LZ77), so a repeating pattern yields a full draft.
    Returns an empty array when no suffix of length >= ``min_ngram`` occurred before.

    Worked example, ``min_ngram=1, max_ngram=3, max_draft=4``::

        tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
        3-gram [2, 6, 7]: not seen before
        2-gram [6, 7]: occurs at 1 and at 5; the most recent (5) is followed by [9, 2, 6, 7]
        -> [9, 2, 6, 7]

        tokens = [3, 4, 3, 4]   2-gram [3, 4] occurs at 0, followed by [3, 4] and then by the draft itself
        -> [3, 4, 3, 4]
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix_start = length - n
        # Occurrences start at most one token before the suffix, so at least one token follows them.
        for start in range(suffix_start - 1, -1, -1):
            matched = True
            for j in range(n):
                if tokens[start + j] != tokens[suffix_start + j]:
                    matched = False
                    break
            if matched:
                draft = np.empty(max_draft, dtype=np.int64)
                source = start + n
                for j in range(max_draft):
                    position = source + j
                    draft[j] = tokens[position] if position < length else draft[position - length]
                return draft
    return np.empty(0, dtype=np.int64)


# --- n-gram tables ------------------------------------------------------------------------------------------------
#
# NGramPredictor keeps, for every order k = 2..max_order (context of c = k - 1 tokens), two open-addressing hash
# tables in preallocated arrays, indexed by table row o = c - 1:
#   contexts: ctx_hash[o, slot] (0 = empty), ctx_keys[o, slot, :c] the context tokens, ctx_total[o, slot] how often
#             the context was followed by anything, ctx_best / ctx_best_count its most frequent continuation;
#   pairs:    pair_hash[o, slot], pair_keys[o, slot, :c + 1] context + next token, pair_count[o, slot].
# Slots are found by the FNV-1a hash of the tokens, with linear probing; the stored tokens are compared too, so a
# hash collision can never return another context's continuation. n_pairs[o] counts the pairs of a row; when it
# reaches ``limit`` (half the slots), the row ages: every count is halved, entries that drop to 0 are forgotten, and
# the row is rebuilt, until it is at most 3/4 of ``limit`` full. A continuation keeps being the best of its context
# until another one is seen strictly more often (halving keeps that order).

FNV_OFFSET = np.uint64(14695981039346656037)
FNV_PRIME = np.uint64(1099511628211)


@njit(cache=True, nogil=True, inline="always")
def _fnv1a(tokens: np.ndarray, start: int, length: int) -> np.uint64:
    h = FNV_OFFSET
    for i in range(start, start + length):
        h = (h ^ np.uint64(tokens[i])) * FNV_PRIME
    return h if h != 0 else np.uint64(1)  # 0 marks an empty slot


@njit(cache=True, nogil=True, inline="always")
def _fnv1a_extend(h: np.uint64, token: int) -> np.uint64:
    """The FNV-1a hash of a context followed by ``token``, from the context's hash."""
    h = (h ^ np.uint64(token)) * FNV_PRIME
    return h if h != 0 else np.uint64(1)


@njit(cache=True, nogil=True)
def _find(hashes, keys, row: int, h: np.uint64, tokens: np.ndarray, start: int, length: int) -> int:
    """Slot holding ``tokens[start:start + length]`` in ``row``, or ``-(empty slot) - 1`` where it would go."""
    mask = np.int64(hashes.shape[1] - 1)
    slot = np.int64(h & np.uint64(mask))
    while True:
        stored = hashes[row, slot]
        if stored == 0:
            return -slot - 1
        if stored == h:
            same = True
            for j in range(length):
                if keys[row, slot, j] != tokens[start + j]:
                    same = False
                    break
            if same:
                return slot
        slot = (slot + 1) & mask


@njit(cache=True, nogil=True)
def _age_row(row, length, limit, ctx_hash, ctx_keys, ctx_total, ctx_best, ctx_best_count,
             pair_hash, pair_keys, pair_count, n_pairs) -> None:
    """Halve every count of ``row`` until at most 3/4 of ``limit`` pairs are left; rebuild the row's tables."""
    slots = ctx_hash.shape[1]
    while n_pairs[row] > (3 * limit) // 4:
        old_ctx_keys = ctx_keys[row].copy()
        old_ctx_hash = ctx_hash[row].copy()
        old_best = ctx_best[row].copy()
        old_best_count = ctx_best_count[row].copy()
        old_pair_keys = pair_keys[row].copy()
        old_pair_hash = pair_hash[row].copy()
        old_pair_count = pair_count[row].copy()
        ctx_hash[row, :] = 0
        pair_hash[row, :] = 0
        n_pairs[row] = 0
        for s in range(slots):
            if old_ctx_hash[s] != 0 and old_best_count[s] // 2 > 0:
                slot = -_find(ctx_hash, ctx_keys, row, old_ctx_hash[s], old_ctx_keys[s], 0, length) - 1
                ctx_hash[row, slot] = old_ctx_hash[s]
                ctx_keys[row, slot, :length] = old_ctx_keys[s, :length]
                ctx_total[row, slot] = 0
                ctx_best[row, slot] = old_best[s]
                ctx_best_count[row, slot] = old_best_count[s] // 2
        for s in range(slots):
            count = old_pair_count[s] // 2
            if old_pair_hash[s] != 0 and count > 0:
                slot = -_find(pair_hash, pair_keys, row, old_pair_hash[s], old_pair_keys[s], 0, length + 1) - 1
                pair_hash[row, slot] = old_pair_hash[s]
                pair_keys[row, slot, : length + 1] = old_pair_keys[s, : length + 1]
                pair_count[row, slot] = count
                n_pairs[row] += 1
                context = _find(ctx_hash, ctx_keys, row, _fnv1a(old_pair_keys[s], 0, length), old_pair_keys[s], 0, length)
                ctx_total[row, context] += count


@njit(cache=True, nogil=True)
def ngram_update(tokens, first, limit, ctx_hash, ctx_keys, ctx_total, ctx_best, ctx_best_count,
                 pair_hash, pair_keys, pair_count, n_pairs) -> None:
    """Count every n-gram that ends at a position >= ``first`` of ``tokens`` (earlier tokens are context only).

    Worked example, max_order=3 (rows 0 and 1: contexts of 1 and 2 tokens), ``tokens = [7, 8, 7, 8, 9]``,
    ``first=1``: row 0 counts 7->8 twice, 8->7 once, 8->9 once (best of [8]: 7, seen first); row 1 counts
    [7, 8]->7, [8, 7]->8, [7, 8]->9 (best of [7, 8]: 7, ties keep the earlier best).
    """
    rows = ctx_hash.shape[0]
    for end in range(first, tokens.shape[0]):
        token = tokens[end]
        for row in range(min(rows, end)):
            length = row + 1
            start = end - length
            h = _fnv1a(tokens, start, length)
            pair_h = _fnv1a_extend(h, token)
            slot = _find(pair_hash, pair_keys, row, pair_h, tokens, start, length + 1)
            if slot < 0:
                if n_pairs[row] >= limit:
                    _age_row(row, length, limit, ctx_hash, ctx_keys, ctx_total, ctx_best, ctx_best_count,
                             pair_hash, pair_keys, pair_count, n_pairs)
                    slot = _find(pair_hash, pair_keys, row, pair_h, tokens, start, length + 1)
                if slot < 0:
                    slot = -slot - 1
                    pair_hash[row, slot] = pair_h
                    pair_keys[row, slot, : length + 1] = tokens[start : end + 1]
                    pair_count[row, slot] = 0
                    n_pairs[row] += 1
            pair_count[row, slot] += 1
            context = _find(ctx_hash, ctx_keys, row, h, tokens, start, length)
            if context < 0:
                context = -context - 1
                ctx_hash[row, context] = h
                ctx_keys[row, context, :length] = tokens[start:end]
                ctx_total[row, context] = 0
                ctx_best[row, context] = -1
                ctx_best_count[row, context] = 0
            ctx_total[row, context] += 1
            if pair_count[row, slot] > ctx_best_count[row, context]:
                ctx_best[row, context] = token
                ctx_best_count[row, context] = pair_count[row, slot]


@njit(cache=True, nogil=True)
def ngram_predict(context, max_tokens, min_count, min_share, ctx_hash, ctx_keys, ctx_total, ctx_best,
                  ctx_best_count) -> np.ndarray:
    """Chain up to ``max_tokens`` predictions after ``context``: at each step the longest context the tables know
    decides; its best continuation is drafted if seen at least ``min_count[row]`` times and in at least
    ``min_share[row]`` of the context's occurrences, otherwise drafting stops.

    Worked example, tables from ``[7, 8, 7, 8, 9]`` as in :func:`ngram_update`, all thresholds 1 and 0.0:
    context ``[9, 7]``: [9, 7] unknown, [7] -> 8; then [7, 8] -> 7; then [8, 7] -> 8 ... -> ``[8, 7, 8, 7]``.
    """
    rows = ctx_hash.shape[0]
    buffer = np.empty(context.shape[0] + max_tokens, dtype=np.int64)
    buffer[: context.shape[0]] = context
    end = context.shape[0]
    while end < buffer.shape[0]:
        drafted = False
        for row in range(min(rows, end) - 1, -1, -1):
            length = row + 1
            slot = _find(ctx_hash, ctx_keys, row, _fnv1a(buffer, end - length, length), buffer, end - length, length)
            if slot >= 0:
                best_count = ctx_best_count[row, slot]
                if best_count >= min_count[row] and best_count >= min_share[row] * ctx_total[row, slot]:
                    buffer[end] = ctx_best[row, slot]
                    end += 1
                    drafted = True
                break
        if not drafted:
            break
    return buffer[context.shape[0] : end].copy()


@njit(cache=True, nogil=True)
def ngram_count(pair, pair_hash, pair_keys, pair_count) -> int:
    """How often ``pair[-1]`` followed the context ``pair[:-1]`` (table row ``len(pair) - 2``)."""
    length = pair.shape[0] - 1
    pair_h = _fnv1a_extend(_fnv1a(pair, 0, length), pair[length])
    slot = _find(pair_hash, pair_keys, length - 1, pair_h, pair, 0, length + 1)
    return pair_count[length - 1, slot] if slot >= 0 else 0
