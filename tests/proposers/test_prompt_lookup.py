"""PromptLookup: the Numba kernel against a plain-Python statement of the same rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

import specula
from specula.proposers.kernels import lookup_candidates, prompt_lookup


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
    count=st.integers(1, 6),
)
def test_kernels_match_the_references(
    tokens: list[int], min_ngram: int, extra: int, max_draft: int, count: int
) -> None:
    max_ngram, array = min_ngram + extra, np.array(tokens, dtype=np.int64)
    got = prompt_lookup(array, min_ngram, max_ngram, max_draft)[0].tolist()
    assert got == reference_lookup(tokens, min_ngram, max_ngram, max_draft)
    drafts, matches = lookup_candidates(array, min_ngram, max_ngram, max_draft, count)
    assert (drafts.tolist(), matches.tolist()) == reference_candidates(tokens, min_ngram, max_ngram, max_draft, count)


def test_proposer_respects_budget() -> None:
    proposer = specula.PromptLookup(num_draft=6)
    context = np.array([3, 4, 5, 3, 4, 5, 3, 4], dtype=np.int64)
    assert proposer.propose(context, 6).tokens.tolist() == [5, 3, 4, 5, 3, 4]
    assert proposer.propose(context, 2).tokens.tolist() == [5, 3]


def test_by_default_as_many_as_asked() -> None:
    """No limit of its own: deep in a repeated block it drafts as far as the loop asks (HF's fixed 10 would not)."""
    context = np.array([3, 4, 5, 6, 7] * 20, dtype=np.int64)
    assert specula.PromptLookup().propose(context, 40).tokens.tolist() == ([3, 4, 5, 6, 7] * 8)
    assert specula.PromptLookup(branches=2).propose(context, 40).first_branch() == list(range(40))


def test_the_loop_drafts_a_long_copy_past_ten_tokens() -> None:
    """With no limit of its own, the loop's own (every token there is room for, up to its longest draft) bounds a
    draft: where the output repeats a block of 8 tokens and more, tokens past a draft's tenth are kept; the output
    stays model.generate's."""
    model = tiny_model("llama")
    prompt = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8] * 2])
    expected = hf_greedy(model, prompt, 40, eos_token_id=[])
    out = specula.generate(
        model, prompt, specula.PromptLookup(), max_new_tokens=40, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == expected.tolist()
    assert any(out.stats.accepted_per_position[10:])


def reference_candidates(tokens: list[int], min_ngram: int, max_ngram: int, max_draft: int, count: int):
    """Every earlier position's match with the suffix (tokens agreeing going back, up to max_ngram), the longest
    first, then the most recent; the continuation after each (overlapping the draft as above)."""
    found = []
    for end in range(len(tokens) - 1, 0, -1):
        match = 0
        while match < min(max_ngram, end) and tokens[end - 1 - match] == tokens[-1 - match]:
            match += 1
        if match >= min_ngram:
            found.append((match, end))
    found.sort(key=lambda pair: -pair[0])  # (stable: the most recent first among equal matches)
    drafts = []
    for _, end in found[:count]:
        extended = list(tokens)
        for j in range(max_draft):
            extended.append(extended[end + j])
        drafts.append(extended[len(tokens) :])
    return drafts, [match for match, _ in found[:count]]


def test_candidates_worked_example() -> None:
    drafts, matches = lookup_candidates(np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]), 1, 3, 2, 3)
    assert drafts.tolist() == [[9, 2], [8, 1]] and matches.tolist() == [2, 2]


def test_a_tree_merges_the_continuations_of_several_occurrences() -> None:
    #            occurrences of [.., 2]: at 1 (match 2: [1, 2]), at 5 (match 1), at 9 (match 2)
    context = np.array([1, 2, 3, 4, 5, 2, 6, 6, 1, 2, 3, 5, 1, 2], dtype=np.int64)
    tree = specula.PromptLookup(num_draft=3, branches=3).propose(context, 3)
    # [3, 5, 1] (at 9, the most recent of the longest), [3, 4, 5] (at 1) and [6, 6, 1] (at 5), merged; by depth +
    # rank: 3 | 5 | 1, 4, 6 | 5, 6 | 1
    assert tree.tokens.tolist() == [3, 5, 1, 4, 6, 5, 6, 1]
    assert tree.parents == (-1, 0, 1, 0, -1, 3, 4, 6) and tree.source == 2
    assert specula.PromptLookup(num_draft=3, branches=3).propose(context, 2).tokens.tolist() == [
        3,
        5,
        4,
        6,
        6,
    ]  # two deep
    assert specula.PromptLookup(branches=3).proposes_trees and not specula.PromptLookup().proposes_trees


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_draft": 0}, "num_draft"),
        ({"num_draft": 2.5}, "num_draft"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
        ({"branches": 0}, "branches"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specula.PromptLookup(**kwargs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 10), st.integers(2, 16))
def test_a_trees_first_branch_is_the_chain(tokens: list[int], max_tokens: int, branches: int) -> None:
    # (where a tree does not pay, its first branch is sent: PromptLookup's own chain)
    context = np.array(tokens, dtype=np.int64)
    tree = specula.PromptLookup(branches=branches).propose(context, max_tokens)
    assert tree.chain().tokens.tolist() == specula.PromptLookup().propose(context, max_tokens).tokens.tolist()


def test_warm_up_loads_the_kernels_the_proposers_call():
    """In a fresh process, after ``warm_up`` a request's drafts (prompt lookup, a tree, a prediction) need no kernel
    loaded or compiled for another signature (mutant: warming with ``int32`` tokens fails)."""
    import subprocess
    import sys

    script = """
import numpy as np
from specula.proposers.prediction import Prediction
from specula.proposers import kernels
from specula.proposers.prompt_lookup import PromptLookup
kernels.warm_up()
before = [len(k.signatures) for k in (kernels.prompt_lookup, kernels.lookup_candidates, kernels.prediction_lookup)]
sequence = np.empty(40, dtype=np.int64)
sequence[:12] = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
PromptLookup().propose(sequence[:12], 4)
PromptLookup(branches=4).propose(sequence[:12], 4)
Prediction(np.array([7, 8, 9], dtype=np.int64)).propose(sequence[4:12], 4)
after = [len(k.signatures) for k in (kernels.prompt_lookup, kernels.lookup_candidates, kernels.prediction_lookup)]
print(before, after)
assert before == after == [1, 1, 1], (before, after)
"""
    subprocess.run([sys.executable, "-c", script], check=True)
