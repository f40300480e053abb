"""Numba kernels on the drafting hot path. Each is compiled once (``cache=True`` keeps the machine code on disk).

All kernels take token sequences as 1-D ``int64`` numpy arrays.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


def warm_up() -> None:
    """Load the drafting kernels' machine code now (numba sets its compiler up at the first call of a process), e.g.
    in a thread while the model loads, so that the first request's drafts do not wait for it."""
    tokens = np.arange(4, dtype=np.int64)
    prompt_lookup(tokens, 1, 2, 2)
    lookup_candidates(tokens, 1, 2, 2, 2)
    prediction_lookup(tokens, tokens[:2], 0, 2)


@njit(cache=True, nogil=True)
def prompt_lookup(tokens: np.ndarray, min_ngram: int, max_ngram: int, max_draft: int) -> tuple[np.ndarray, int]:
    """Draft by copying what followed the most recent earlier occurrence of the sequence's longest matching suffix;
    returns the draft and the length of the matched suffix.

    For n from ``max_ngram`` down to ``min_ngram``: look for the last n tokens earlier in ``tokens``, scanning from
    the end so the most recent occurrence wins, and return up to ``max_draft`` tokens that followed it. The copy may
    run past the end of ``tokens`` into the draft itself (as in LZ77), so a repeating pattern yields a full draft.
    Returns an empty array (and 0) when no suffix of length >= ``min_ngram`` occurred before.

    Worked example, ``min_ngram=1, max_ngram=3, max_draft=4``::

        tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
        3-gram [2, 6, 7]: not seen before
        2-gram [6, 7]: occurs at 1 and at 5; the most recent (5) is followed by [9, 2, 6, 7]
        -> ([9, 2, 6, 7], 2)

        tokens = [3, 4, 3, 4]   2-gram [3, 4] occurs at 0, followed by [3, 4] and then by the draft itself
        -> ([3, 4, 3, 4], 2)
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
                return draft, n
    return np.empty(0, dtype=np.int64), 0


@njit(cache=True, nogil=True)
def prediction_lookup(prediction: np.ndarray, context: np.ndarray, expected: int, max_ngram: int) -> tuple[int, int]:
    """Where in ``prediction`` (the text a request expects back) its output goes on: the position ``p`` whose
    preceding tokens match the longest suffix of ``context`` (up to ``max_ngram`` tokens), the nearest to
    ``expected`` (where the output would be had it followed the prediction since it last did) among equally long
    matches, the later on a tie. Returns ``(p, match length)``; ``p`` always leaves a token to draft
    (``p < len(prediction)``). Where no suffix matches, ``(expected, 0)`` if ``expected`` leaves a token to draft
    (the output replaced as many tokens as it wrote: the usual edit), else ``(-1, 0)``.

    Worked example, ``max_ngram=3``::

        prediction = [5, 6, 7, 5, 6, 8, 9]
        context    = [.., 1, 5, 6]       3-gram [1, 5, 6]: nowhere; 2-gram [5, 6] ends before p = 2 and p = 5
        expected 4 -> (5, 2): the draft goes on [8, 9]      expected 1 -> (2, 2): [7, 5, 6, 8, 9]
        context    = [.., 4]             nothing matches: expected 4 -> (4, 0): [6, 8, 9]
    """
    best, best_length, best_distance = -1, 0, 0
    n = context.shape[0]
    for p in range(1, prediction.shape[0]):
        length = 0
        while (
            length < max_ngram and length < p and length < n and prediction[p - 1 - length] == context[n - 1 - length]
        ):
            length += 1
        if length == 0:
            continue
        distance = abs(p - expected)
        if length > best_length or (length == best_length and distance <= best_distance):
            best, best_length, best_distance = p, length, distance
    if best < 0 and 0 <= expected < prediction.shape[0]:
        return expected, 0
    return best, best_length


@njit(cache=True, nogil=True)
def lookup_candidates(
    tokens: np.ndarray, min_ngram: int, max_ngram: int, max_draft: int, max_candidates: int
) -> tuple[np.ndarray, np.ndarray]:
    """The continuations of up to ``max_candidates`` earlier occurrences of the sequence's suffix, the longest
    matches first, then the most recent: returns ``(drafts [m, max_draft], matches [m])``.

    Every earlier position is an occurrence of the suffix matched over as many tokens as the two agree going back
    (at most ``max_ngram``; at least ``min_ngram`` to count); its continuation is what followed, up to
    ``max_draft`` tokens, running into itself past the end of ``tokens`` as :func:`prompt_lookup`'s does.

    Worked example, ``min_ngram=1, max_ngram=3, max_draft=2, max_candidates=3``::

        tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
        occurrences of the suffix [.., 6, 7]: ending after 7 at 3 (match 2: [6, 7]) and at 7 (match 2);
        of [7] alone: none other
        -> drafts [[9, 2], [8, 1]], matches [2, 2]   (the most recent first among equal matches)
    """
    length = tokens.shape[0]
    longest = min(max_ngram, length - 1)
    ends = np.empty(max_candidates, dtype=np.int64)  # where each continuation starts
    matches = np.zeros(max_candidates, dtype=np.int64)
    found = 0
    for end in range(length - 1, 0, -1):  # the most recent first
        match = 0
        while match < longest and match < end and tokens[end - 1 - match] == tokens[length - 1 - match]:
            match += 1
        if match < min_ngram or (found == max_candidates and match <= matches[found - 1]):
            continue
        if found < max_candidates:
            found += 1
        i = found - 1  # insert, keeping longer matches first and, among equal ones, earlier found (more recent)
        while i > 0 and matches[i - 1] < match:
            ends[i], matches[i] = ends[i - 1], matches[i - 1]
            i -= 1
        ends[i], matches[i] = end, match
    drafts = np.empty((found, max_draft), dtype=np.int64)
    for c in range(found):
        for j in range(max_draft):
            position = ends[c] + j
            drafts[c, j] = tokens[position] if position < length else drafts[c, position - length]
    return drafts, matches[:found]


# --- n-gram tables ------------------------------------------------------------------------------------------------
#
# NGramPredictor keeps, for every order k = 2..max_order (a context of c = k - 1 tokens, table row r = c - 1), two
# open-addressing hash tables of int32 records, one record per slot so that a probe touches one cache line:
#   contexts[r, slot] = [tag, total, best, best_count, t_1 .. t_c]   how often the context was followed by anything,
#                                                                      and its most frequent continuation;
#   pairs[r, slot]    = [tag, count, context slot, t_1 .. t_c, next] how often ``next`` followed the context.
# A context is hashed with FNV-1a over its tokens newest first (t_c, t_c-1, ... t_1), so the hash of the c-token
# context extends the (c-1)-token one; a pair's hash extends its context's hash with ``next``. The slot comes from
# the low bits of the hash (linear probing), the tag from its high bits (0 marks an empty slot). The stored tokens
# are compared as well, so a hash collision can never return another context's continuation. n_pairs[r] counts the
# pairs of a row; when it reaches ``limit`` (half the slots), or a total nears the int32 range, the row ages: every
# count is halved, entries that drop to 0 are forgotten and the row is rebuilt, until it holds at most 3/4 of
# ``limit`` pairs. A continuation stays the best of its context until another one is seen strictly more often
# (halving keeps that order).

FNV_OFFSET = np.uint64(14695981039346656037)
FNV_PRIME = np.uint64(1099511628211)
TAG, TOTAL, BEST, BEST_COUNT, CONTEXT_KEYS = 0, 1, 2, 3, 4  # context record fields
COUNT, CONTEXT_SLOT, PAIR_KEYS = 1, 2, 3  # pair record fields (TAG is field 0 too)
MAX_TOTAL = 1 << 30
PREFETCH_AHEAD = 4


def _prefetch(table, row: int, slot: int) -> None:
    """Ask the CPU to start loading ``table[row, slot]`` (a hint; compiled code only, nothing when interpreted)."""


@intrinsic
def _prefetch_intrinsic(typingctx, table, row, slot):
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        pointer = cgutils.get_item_pointer(
            context, builder, signature.args[0], array, [args[1], args[2], zero], wraparound=False
        )
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte_pointer], ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
        )
        # read, high temporal locality, data cache
        builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(table, types.intp, types.intp), codegen


@overload(_prefetch, inline="always")
def _prefetch_compiled(table, row, slot):
    return lambda table, row, slot: _prefetch_intrinsic(table, row, slot)


@njit(cache=True, nogil=True, inline="always")
def _fnv1a_extend(h: np.uint64, token: int) -> np.uint64:
    """One FNV-1a step: XOR the token in, multiply by the prime."""
    return (h ^ np.uint64(token)) * FNV_PRIME


@njit(cache=True, nogil=True, inline="always")
def _context_hash(tokens, start: int, length: int) -> np.uint64:
    """FNV-1a of ``tokens[start:start + length]``, newest token first."""
    h = FNV_OFFSET
    for i in range(start + length - 1, start - 1, -1):
        h = _fnv1a_extend(h, tokens[i])
    return h


@njit(cache=True, nogil=True, inline="always")
def _find(table, row: int, h: np.uint64, keys_at: int, tokens, start: int, length: int) -> int:
    """Slot of ``table[row]`` holding ``tokens[start:start + length]``, or ``-(empty slot) - 1`` where it would go."""
    mask = np.int64(table.shape[1] - 1)
    slot = np.int64(h & np.uint64(mask))
    tag = np.int32(np.int64(h >> np.uint64(33)) | 1)
    while True:
        stored = table[row, slot, TAG]
        if stored == 0:
            return -slot - 1
        if stored == tag:
            same = True
            for j in range(length):
                if table[row, slot, keys_at + j] != tokens[start + j]:
                    same = False
                    break
            if same:
                return slot
        slot = (slot + 1) & mask


@njit(cache=True, nogil=True, inline="always")
def _claim(table, row: int, slot: int, h: np.uint64, keys_at: int, tokens, start: int, length: int) -> None:
    table[row, slot, :] = 0
    table[row, slot, TAG] = np.int32(np.int64(h >> np.uint64(33)) | 1)
    for j in range(length):
        table[row, slot, keys_at + j] = tokens[start + j]


@njit(cache=True, nogil=True)
def _halved(table, row: int, count_at: int) -> np.ndarray:
    """The records of ``table[row]`` whose count at ``count_at`` survives halving (halved), emptying the row."""
    kept = 0
    for s in range(table.shape[1]):  # no branches: most are unpredictable
        kept += (table[row, s, TAG] != 0) & (table[row, s, count_at] > 1)
    survivors = np.empty((kept, table.shape[2]), table.dtype)
    kept = 0
    for s in range(table.shape[1]):
        if survivors.shape[0] and table[row, s, TAG] != 0 and table[row, s, count_at] > 1:
            survivors[kept] = table[row, s]
            survivors[kept, count_at] //= 2
            kept += 1
        table[row, s, TAG] = 0
    return survivors


@njit(cache=True, nogil=True)
def _age_row(row: int, limit: int, contexts, pairs, n_pairs) -> None:
    """Halve every count of ``row`` until its pairs fit in 3/4 of ``limit`` and no total nears int32; rebuild it."""
    length = row + 1
    while True:
        old_contexts = _halved(contexts, row, BEST_COUNT)
        old_pairs = _halved(pairs, row, COUNT)
        n_pairs[row] = 0
        largest = 0
        for s in range(old_contexts.shape[0]):
            keys = old_contexts[s, CONTEXT_KEYS:]
            h = _context_hash(keys, 0, length)
            slot = -_find(contexts, row, h, CONTEXT_KEYS, keys, 0, length) - 1
            _claim(contexts, row, slot, h, CONTEXT_KEYS, keys, 0, length)
            contexts[row, slot, BEST] = old_contexts[s, BEST]
            contexts[row, slot, BEST_COUNT] = old_contexts[s, BEST_COUNT]
        for s in range(old_pairs.shape[0]):
            keys = old_pairs[s, PAIR_KEYS:]
            context_h = _context_hash(keys, 0, length)
            h = _fnv1a_extend(context_h, keys[length])
            slot = -_find(pairs, row, h, PAIR_KEYS, keys, 0, length + 1) - 1
            _claim(pairs, row, slot, h, PAIR_KEYS, keys, 0, length + 1)
            context = _find(contexts, row, context_h, CONTEXT_KEYS, keys, 0, length)
            pairs[row, slot, COUNT] = old_pairs[s, COUNT]
            pairs[row, slot, CONTEXT_SLOT] = context
            n_pairs[row] += 1
            contexts[row, context, TOTAL] += old_pairs[s, COUNT]
            largest = max(largest, contexts[row, context, TOTAL])
        if n_pairs[row] <= (3 * limit) // 4 and largest < MAX_TOTAL // 2:
            return


@njit(cache=True, nogil=True, inline="always")
def _prefetch_position(tokens, end: int, contexts, pairs) -> None:
    """Start loading the home slots of the records that counting the n-grams ending at ``end`` will touch."""
    mask = np.uint64(contexts.shape[1] - 1)
    h = FNV_OFFSET
    for row in range(min(contexts.shape[0], end)):
        h = _fnv1a_extend(h, tokens[end - row - 1])
        _prefetch(pairs, row, np.int64(_fnv1a_extend(h, tokens[end]) & mask))
        _prefetch(contexts, row, np.int64(h & mask))


@njit(cache=True, nogil=True)
def ngram_update(tokens, first: int, limit: int, contexts, pairs, n_pairs) -> bool:
    """Count every n-gram that ends at a position >= ``first`` of ``tokens`` (earlier tokens are context only).
    Returns False, learning nothing, if a token is outside [0, 2**31).

    Worked example, max_order=3 (rows 0 and 1: contexts of 1 and 2 tokens), ``tokens = [7, 8, 7, 8, 9]``,
    ``first=1``: row 0 counts 7->8 twice, 8->7 once, 8->9 once (best of [8]: 7, seen first); row 1 counts
    [7, 8]->7, [8, 7]->8, [7, 8]->9 (best of [7, 8]: 7, ties keep the earlier best).
    """
    for i in range(first, tokens.shape[0]):
        if tokens[i] < 0 or tokens[i] > 2147483647:
            return False
    rows = contexts.shape[0]
    for ahead in range(first, min(first + PREFETCH_AHEAD, tokens.shape[0])):
        _prefetch_position(tokens, ahead, contexts, pairs)
    for end in range(first, tokens.shape[0]):
        if end + PREFETCH_AHEAD < tokens.shape[0]:
            _prefetch_position(tokens, end + PREFETCH_AHEAD, contexts, pairs)
        token = tokens[end]
        h = FNV_OFFSET
        for row in range(min(rows, end)):
            length = row + 1
            start = end - length
            h = _fnv1a_extend(h, tokens[start])  # the context grows by one older token per row
            pair_h = _fnv1a_extend(h, token)
            slot = _find(pairs, row, pair_h, PAIR_KEYS, tokens, start, length + 1)
            if slot >= 0:
                context = pairs[row, slot, CONTEXT_SLOT]
            else:
                if n_pairs[row] >= limit:
                    _age_row(row, limit, contexts, pairs, n_pairs)
                    slot = _find(pairs, row, pair_h, PAIR_KEYS, tokens, start, length + 1)
                slot = -slot - 1
                _claim(pairs, row, slot, pair_h, PAIR_KEYS, tokens, start, length + 1)
                n_pairs[row] += 1
                context = _find(contexts, row, h, CONTEXT_KEYS, tokens, start, length)
                if context < 0:
                    context = -context - 1
                    _claim(contexts, row, context, h, CONTEXT_KEYS, tokens, start, length)
                    contexts[row, context, BEST] = -1
                pairs[row, slot, CONTEXT_SLOT] = context
            pairs[row, slot, COUNT] += 1
            contexts[row, context, TOTAL] += 1
            if pairs[row, slot, COUNT] > contexts[row, context, BEST_COUNT]:
                contexts[row, context, BEST] = token
                contexts[row, context, BEST_COUNT] = pairs[row, slot, COUNT]
            if contexts[row, context, TOTAL] >= MAX_TOTAL:
                _age_row(row, limit, contexts, pairs, n_pairs)
    return True


@njit(cache=True, nogil=True)
def ngram_predict(context, max_tokens: int, min_count, min_share, contexts) -> np.ndarray:
    """Chain up to ``max_tokens`` predictions after ``context``: at each step the longest context the tables know
    decides; its best continuation is drafted if seen at least ``min_count[row]`` times and in at least
    ``min_share[row]`` of the context's occurrences, otherwise drafting stops.

    Worked example, tables from ``[7, 8, 7, 8, 9]`` as in :func:`ngram_update`, thresholds 1 and 0.0:
    context ``[9, 7]``: [9, 7] unknown, [7] -> 8; then [7, 8] -> 7; then [8, 7] -> 8 ... -> ``[8, 7, 8, 7]``.
    """
    rows = contexts.shape[0]
    buffer = np.empty(context.shape[0] + max_tokens, dtype=np.int64)
    buffer[: context.shape[0]] = context
    end = context.shape[0]
    while end < buffer.shape[0]:
        drafted = False
        for row in range(min(rows, end) - 1, -1, -1):
            length = row + 1
            h = _context_hash(buffer, end - length, length)
            slot = _find(contexts, row, h, CONTEXT_KEYS, buffer, end - length, length)
            if slot >= 0:
                best_count = contexts[row, slot, BEST_COUNT]
                if best_count >= min_count[row] and best_count >= min_share[row] * contexts[row, slot, TOTAL]:
                    buffer[end] = contexts[row, slot, BEST]
                    end += 1
                    drafted = True
                break
        if not drafted:
            break
    return buffer[context.shape[0] : end].copy()


@njit(cache=True, nogil=True)
def ngram_alternatives(context, min_count, min_share, contexts) -> np.ndarray:
    """The confident best continuations of ``context``'s suffixes, the longest suffix first, each token once: the
    first token :func:`ngram_predict` drafts (where the longest known context is confident), then the best tokens of
    the shorter contexts, which it never consults; a tree's candidate first tokens.

    Worked example, tables from ``[1, 2, 3, 9, 2, 3, 5, 2, 4]`` (``max_order=3``), thresholds 1 and 0.0: context
    ``[5, 2]`` was followed by 4 once; ``[2]`` by 3 twice and by 4 once -> ``[4, 3]``.
    """
    found = np.empty(contexts.shape[0], dtype=np.int64)
    count = 0
    for row in range(min(contexts.shape[0], context.shape[0]) - 1, -1, -1):
        length = row + 1
        start = context.shape[0] - length
        slot = _find(contexts, row, _context_hash(context, start, length), CONTEXT_KEYS, context, start, length)
        if slot < 0:
            continue
        best, best_count = contexts[row, slot, BEST], contexts[row, slot, BEST_COUNT]
        if best_count >= min_count[row] and best_count >= min_share[row] * contexts[row, slot, TOTAL]:
            seen = False
            for i in range(count):
                seen |= found[i] == best
            if not seen:
                found[count] = best
                count += 1
    return found[:count].copy()


@njit(cache=True, nogil=True)
def ngram_count(pair, pairs) -> int:
    """How often ``pair[-1]`` followed the context ``pair[:-1]`` (table row ``len(pair) - 2``)."""
    length = pair.shape[0] - 1
    h = _fnv1a_extend(_context_hash(pair, 0, length), pair[length])
    slot = _find(pairs, length - 1, h, PAIR_KEYS, pair, 0, length + 1)
    return pairs[length - 1, slot, COUNT] if slot >= 0 else 0
