"""PromptLookup: the Numba kernel against a plain-Python statement of the same rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specula
from specula.kernels import prompt_lookup


def reference_lookup(tokens: list[int], min_ngram: int, max_ngram: int, max_draft: int) -> list[int]:
    """Longest suffix first, most recent earlier occurrence, copy what followed (the copy may overlap the draft)."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            extended = list(tokens)
            for j in range(max_draft):
                extended.append(extended[starts[-1] + n + j])
            return extended[len(tokens) :]
    return []


def test_worked_examples() -> None:
    tokens = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert prompt_lookup(tokens, 1, 3, 4)[0].tolist() == [9, 2, 6, 7]
    assert prompt_lookup(np.array([3, 4, 3, 4]), 1, 3, 4)[0].tolist() == [3, 4, 3, 4]
    assert prompt_lookup(np.array([1, 2, 3]), 1, 3, 4)[0].tolist() == []
    assert prompt_lookup(np.array([7]), 1, 3, 4)[0].tolist() == []


def test_most_recent_occurrence_wins() -> None:
    # [1, 2] occurs twice before the end; the later one is followed by 9.
    tokens = np.array([1, 2, 8, 8, 1, 2, 9, 9, 1, 2])
    assert prompt_lookup(tokens, 2, 2, 2)[0].tolist() == [9, 9]


def test_longest_ngram_beats_recency() -> None:
    # The 3-gram [5, 1, 2] occurred only early; the 2-gram [1, 2] also occurred later. The 3-gram wins.
    tokens = np.array([5, 1, 2, 3, 4, 1, 2, 7, 7, 5, 1, 2])
    assert prompt_lookup(tokens, 1, 3, 2)[0].tolist() == [3, 4]
    assert prompt_lookup(tokens, 1, 3, 2)[1] == 3  # the match length, the draft's source label


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    min_ngram=st.integers(1, 3),
    extra=st.integers(0, 3),
    max_draft=st.integers(1, 12),
)
def test_kernel_matches_reference(tokens: list[int], min_ngram: int, extra: int, max_draft: int) -> None:
    max_ngram = min_ngram + extra
    got = prompt_lookup(np.array(tokens, dtype=np.int64), min_ngram, max_ngram, max_draft)[0].tolist()
    assert got == reference_lookup(tokens, min_ngram, max_ngram, max_draft)


def test_proposer_respects_budget() -> None:
    proposer = specula.PromptLookup(num_draft=6)
    context = np.array([3, 4, 5, 3, 4, 5, 3, 4], dtype=np.int64)
    assert proposer.propose(context, 6).tokens.tolist() == [5, 3, 4, 5, 3, 4]
    assert proposer.propose(context, 2).tokens.tolist() == [5, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_draft": 0}, "num_draft"),
        ({"num_draft": 2.5}, "num_draft"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specula.PromptLookup(**kwargs)
