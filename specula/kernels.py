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
