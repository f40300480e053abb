"""NGramPredictor: the Numba tables agree with a pure-Python statement of the same rules."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, VOCAB, tiny_model

import specula


class ReferenceNGram:
    """Plain dicts: exact counts per (context, next token), best continuation, ageing when a row is full."""

    def __init__(self, max_order: int, limit: int, min_count, min_share) -> None:
        self.rows = max_order - 1
        self.limit = limit
        self.min_count, self.min_share = min_count, min_share
        self.pairs: list[dict] = [{} for _ in range(self.rows)]
        self.contexts: list[dict] = [{} for _ in range(self.rows)]  # context -> [total, best, best_count]
        self.recent: list[int] = []

    def _age(self, row: int) -> None:
        while len(self.pairs[row]) > 3 * self.limit // 4:
            self.pairs[row] = {key: n // 2 for key, n in self.pairs[row].items() if n // 2}
            self.contexts[row] = {c: [0, best, n // 2] for c, (_, best, n) in self.contexts[row].items() if n // 2}
            for (context, _), n in self.pairs[row].items():
                self.contexts[row][context][0] += n

    def update(self, tokens: list[int]) -> None:
        work = self.recent[-self.rows :] + list(tokens)
        for end in range(len(self.recent[-self.rows :]), len(work)):
            for row in range(min(self.rows, end)):
                context, token = tuple(work[end - row - 1 : end]), work[end]
                if (context, token) not in self.pairs[row]:
                    if len(self.pairs[row]) >= self.limit:
                        self._age(row)
                    self.pairs[row][(context, token)] = 0
                self.pairs[row][(context, token)] += 1
                stats = self.contexts[row].setdefault(context, [0, -1, 0])
                stats[0] += 1
                if self.pairs[row][(context, token)] > stats[2]:
                    stats[1:] = [token, self.pairs[row][(context, token)]]
        self.recent = work

    def predict(self, context: list[int], max_tokens: int) -> list[int]:
        tokens = list(context)
        draft: list[int] = []
        while len(draft) < max_tokens:
            for row in range(min(self.rows, len(tokens)) - 1, -1, -1):
                stats = self.contexts[row].get(tuple(tokens[len(tokens) - row - 1 :]))
                if stats is not None:
                    total, best, best_count = stats
                    if best_count >= self.min_count[row] and best_count >= self.min_share[row] * total:
                        draft.append(best)
                        tokens.append(best)
                        break
                    return draft
            else:
                return draft
        return draft

    def alternatives(self, context: list[int]) -> list[int]:
        """The confident best continuation of each suffix of ``context``, the longest first, each token once."""
        found: list[int] = []
        for row in range(min(self.rows, len(context)) - 1, -1, -1):
            stats = self.contexts[row].get(tuple(context[len(context) - row - 1 :]))
            if stats is not None and stats[2] >= self.min_count[row] and stats[2] >= self.min_share[row] * stats[0]:
                found += [stats[1]] if stats[1] not in found else []
        return found


def streams(max_vocab: int = 262144):
    """Token streams with random runs and repeats of earlier stretches (so contexts recur)."""

    @st.composite
    def build(draw):
        vocab = draw(st.sampled_from([3, 8, 50, max_vocab]))
        tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
        for _ in range(draw(st.integers(0, 4))):
            start = draw(st.integers(0, len(tokens) - 1))
            length = draw(st.integers(1, 30))
            tokens += tokens[start : start + length] + draw(st.lists(st.integers(0, vocab - 1), max_size=5))
        return tokens

    return build()


def assert_same_tables(predictor: specula.NGramPredictor, reference: ReferenceNGram) -> None:
    assert predictor.tables["n_pairs"].tolist() == [len(pairs) for pairs in reference.pairs]
    for row, pairs in enumerate(reference.pairs):
        for (context, token), count in pairs.items():
            assert predictor.count(list(context), token) == count


@settings(max_examples=150, deadline=None)
@given(
    stream=streams(),
    chunks=st.integers(1, 4),
    max_order=st.integers(2, 5),
    capacity=st.sampled_from([8, 16, 64, 4096]),
    min_count=st.integers(1, 3),
    min_share=st.sampled_from([0.0, 0.3, 0.5, 0.9]),
    max_tokens=st.integers(1, 12),
)
def test_tables_and_predictions_match_reference(stream, chunks, max_order, capacity, min_count, min_share, max_tokens):
    predictor = specula.NGramPredictor(max_order, capacity=capacity, min_count=min_count, min_share=min_share)
    rows = max_order - 1
    reference = ReferenceNGram(max_order, capacity // 2, [min_count] * rows, [min_share] * rows)
    for chunk in np.array_split(np.array(stream), chunks):
        predictor.update(chunk)
        reference.update(chunk.tolist())
    assert_same_tables(predictor, reference)
    tree = specula.NGramPredictor(max_order, capacity=capacity, min_count=min_count, min_share=min_share, tree=True)
    tree.tables = predictor.tables
    for end in range(1, len(stream) + 1, 3):
        context = stream[max(0, end - rows) : end]
        assert predictor.predict(context, max_tokens) == reference.predict(context, max_tokens)
        # a tree: each alternative first token (the longest context's first), followed by its own chain
        firsts = reference.alternatives(context)
        draft = tree.propose(np.array(context, dtype=np.int64), max_tokens)
        assert [draft.tokens[i].item() for i in draft.children()[0]] == firsts
        for first in firsts:  # (a proposer drafts at most num_draft tokens)
            branch = [first] + reference.predict(context + [first], min(max_tokens, tree.num_draft) - 1)
            assert draft.path(branch) == draft.path(branch + [-1]) and len(draft.path(branch)) == len(branch)


def test_learns_and_chains_a_phrase_seen_twice() -> None:
    phrase = [101, 2054, 2003, 1996, 3007, 1997, 2605, 1029, 102]
    predictor = specula.NGramPredictor()
    predictor.update([5, 6] + phrase + [7, 8, 9] + phrase + [11])
    assert predictor.predict(phrase[:3], 6) == phrase[3:9]


def test_collisions_never_return_another_contexts_continuation() -> None:
    # Capacity 8: nearly every probe for an unknown context lands on a slot another context occupies.
    predictor = specula.NGramPredictor(max_order=3, capacity=8, min_count=1, min_share=0.0)
    predictor.update([1, 2, 3])
    for token in range(300):
        assert predictor.predict([token], 1) == {1: [2], 2: [3]}.get(token, [])
    for first in range(40):
        for second in range(40):
            expected = [3] if (first, second) == (1, 2) else {1: [2], 2: [3]}.get(second, [])
            assert predictor.predict([first, second], 1) == expected


def test_memory_is_bounded_over_a_million_tokens() -> None:
    predictor = specula.NGramPredictor(capacity=1 << 12)
    sizes = {name: table.nbytes for name, table in predictor.tables.items()}
    rng = np.random.default_rng(0)
    phrase = rng.integers(0, 50000, 40)
    for _ in range(100):
        predictor.update(np.concatenate([rng.integers(0, 50000, 9000), np.tile(phrase, 25)]))
    assert {name: table.nbytes for name, table in predictor.tables.items()} == sizes
    assert (predictor.tables["n_pairs"] <= predictor.capacity // 2).all()
    assert len(predictor.recent) == predictor.history
    # The repeated phrase survives ageing; the random noise does not crowd it out.
    assert predictor.predict(phrase[:3], 8) == phrase[3:11].tolist()


def test_alternatives_worked_example() -> None:
    predictor = specula.NGramPredictor(max_order=3, min_count=1, min_share=0.0, tree=True)
    predictor.update([1, 2, 3, 9, 2, 3, 5, 2, 4])  # [5, 2] -> 4 once; [2] -> 3 twice, 4 once
    draft = predictor.propose(np.array([5, 2]), 2)
    # 4, then [2, 4] and [4] unknown: nothing; 3, then [2, 3] -> 9 (and 5, once each: the first seen stays best)
    assert draft.tokens.tolist() == [4, 3, 9] and draft.parents == (-1, -1, 1)
    assert specula.NGramPredictor(max_order=3).predict([5, 2], 2) == []  # (fresh tables: nothing)


def test_save_load_round_trip(tmp_path) -> None:
    predictor = specula.NGramPredictor(max_order=3, num_draft=5, capacity=256, min_count=(1, 2), min_share=0.4)
    predictor.update([4, 5, 6, 4, 5, 7, 4, 5, 6])
    predictor.save(tmp_path / "cache.npz")
    loaded = specula.NGramPredictor.load(tmp_path / "cache.npz")
    assert repr(loaded) == repr(predictor)
    assert loaded.min_count.tolist() == [1, 2] and loaded.min_share.tolist() == [0.4, 0.4]
    for name, table in predictor.tables.items():
        assert np.array_equal(loaded.tables[name], table)
    assert loaded.predict([4, 5], 4) == predictor.predict([4, 5], 4)
    loaded.update([6, 4])  # keeps learning where it left off
    assert loaded.count([5, 6], 4) == 1 and loaded.count([6], 4) == 2
    predictor = specula.NGramPredictor(tree=True)
    predictor.save(tmp_path / "tree.npz")
    assert specula.NGramPredictor.load(tmp_path / "tree.npz").proposes_trees


def test_bad_files_give_clear_errors(tmp_path) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="not a readable NGramPredictor file"):
        specula.NGramPredictor.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="not an NGramPredictor file"):
        specula.NGramPredictor.load(tmp_path / "other.npz")
    predictor = specula.NGramPredictor(max_order=3, capacity=64)
    predictor.save(tmp_path / "good.npz")
    with np.load(tmp_path / "good.npz") as archive:
        data = dict(archive)
    data["pairs"] = data["pairs"][:, :, :3]
    np.savez(tmp_path / "broken.npz", **data)
    with pytest.raises(ValueError, match="incompatible or corrupt"):
        specula.NGramPredictor.load(tmp_path / "broken.npz")
    with pytest.raises(ValueError, match="readable"):
        specula.NGramPredictor.load(tmp_path / "missing.npz")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_order": 1}, "max_order"),
        ({"max_order": 4, "history": 3}, "history"),
        ({"num_draft": 0}, "num_draft"),
        ({"capacity": 2}, "capacity"),
        ({"min_share": 1.5}, "min_share"),
        ({"min_count": 0}, "min_count"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specula.NGramPredictor(**kwargs)


def test_history_keeps_the_latest_tokens_across_small_updates() -> None:
    predictor = specula.NGramPredictor(max_order=3, history=6)
    for token in range(10):
        predictor.update([token])
    assert predictor.recent.tolist() == [4, 5, 6, 7, 8, 9]
    assert predictor.count([8], 9) == 1 and predictor.count([7, 8], 9) == 1


def test_bad_tokens() -> None:
    with pytest.raises(ValueError, match="integers"):
        specula.NGramPredictor().update([0.5, 1.5])
    with pytest.raises(ValueError, match="2\\*\\*31"):
        specula.NGramPredictor().update([-1])
    with pytest.raises(ValueError, match="max_tokens"):
        specula.NGramPredictor().predict([1, 2], -1)


@functools.cache
def _model(name: str):
    return tiny_model(name)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_drives_generate_identically(name: str) -> None:
    prompt = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    predictor = specula.NGramPredictor(min_count=1)
    out = specula.generate(_model(name), prompt, predictor, max_new_tokens=60, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == hf_greedy(_model(name), prompt, 60).tolist()
    assert out.stats.accepted > 0
    # Kept across requests, the predictor has learnt the first output: a second run drafts it from the start.
    again = specula.generate(_model(name), prompt, predictor, max_new_tokens=60, eos_token_id=[], adaptive_draft=False)
    assert again.sequences.tolist() == out.sequences.tolist()
    assert again.stats.accepted >= out.stats.accepted


@pytest.mark.parametrize("name", ["gemma3", "gpt2", "llama", "qwen2"])
def test_trees_of_alternatives_drive_generate_identically(name: str) -> None:
    prompt = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 1, 7, 8, 5, 6, 7, 3, 9, 5, 2, 4, 5, 6, 7, 8, 9, 5]])
    expected = hf_greedy(_model(name), prompt, 40)
    output = expected[0].tolist()
    predictor = specula.NGramPredictor(min_count=1, tree=True)
    for token, after in zip(output, output[1:]):  # after each token another one, twice: the best of 1-token
        for _ in range(2):  # contexts is wrong ...
            predictor.reset_context()
            predictor.update([token, (after + 1) % VOCAB])
    predictor.reset_context()
    predictor.update(output)  # ... while the longer ones know the output: trees whose first branch is right
    out = specula.generate(_model(name), prompt, predictor, max_new_tokens=40, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.tree_passes > 0 and out.stats.accepted > 20
