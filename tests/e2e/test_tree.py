"""Tree drafts: several candidate continuations verified in one pass, each token seeing only its own ancestors, the
accepted path's states moved into place; output identical to model.generate (fp32)."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import transformers
from helpers import TreeOracle, chi_square_p_value, hf_greedy
from tiny_models import VOCAB, tiny_model

import specula
from specula.core import acceptance
from specula.core.acceptance import accept_draft
from specula.hf.inputs import left_padded

NEW_TOKENS = 24
# gpt2: absolute positions; mistral: every layer a sliding window; gemma3: sliding-window and full layers (windows
# of 12 and 8 tokens, shorter than the prompts)
TREE_MODELS = ["gemma3", "gpt2", "gpt_neox", "llama", "mistral", "qwen2"]


@functools.cache
def model(name: str) -> torch.nn.Module:
    return tiny_model(name)


def prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in (21, 9, 30)]


def alone(name: str, row: torch.Tensor, new_tokens: int = NEW_TOKENS, **kwargs) -> list[int]:
    return hf_greedy(model(name), row[None], new_tokens, **kwargs)[0, len(row) :].tolist()


@pytest.mark.parametrize("name", TREE_MODELS)
@pytest.mark.parametrize("shape", ["second", "detour", "late", "wrong"])
def test_a_tree_gives_model_generates_tokens_alone(name: str, shape: str) -> None:
    row = prompts()[0]
    expected = alone(name, row, eos_token_id=[])
    proposer = TreeOracle([torch.tensor(row.tolist() + expected)], shape, VOCAB)
    out = specula.generate(
        model(name), row[None], proposer, max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences[0, len(row) :].tolist() == expected
    if shape != "wrong":  # the right branch, not the first child, was taken
        assert out.stats.accepted > NEW_TOKENS // 2 and out.stats.passes < NEW_TOKENS // 2
    else:
        assert out.stats.accepted == 0 and out.stats.drafted > 0
    # every draft sent was a tree (all steps but the prefill and a last one without room for a draft); what they
    # accepted beyond their first branches (wrong at the first token in "second" and "detour", right in "late")
    assert out.stats.tree_passes >= out.stats.passes - 2 and out.stats.tree_drafted == out.stats.drafted
    assert out.stats.tree_gain == (out.stats.accepted if shape in ("second", "detour") else 0)


@pytest.mark.parametrize("name", TREE_MODELS)
def test_trees_and_chains_in_a_batch_give_each_row_its_own_tokens(name: str) -> None:
    rows = prompts()
    expected = [alone(name, row, eos_token_id=[]) for row in rows]
    references = [torch.tensor(row.tolist() + out) for row, out in zip(rows, expected)]

    class Mixed(TreeOracle):  # each row its own shape: a tree taken off its first child, a wrong tree, a chain
        def propose(self, context_ids, max_tokens):
            which = next(i for i, r in enumerate(self.references) if r[: len(context_ids)] == context_ids.tolist())
            self.shape = ("second", "wrong", "chain")[which]
            return super().propose(context_ids, max_tokens)

    ids, mask = left_padded(rows, 0)
    out = specula.generate(
        model(name),
        ids,
        Mixed(references, "second", VOCAB),
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        adaptive_draft=False,
    )
    news = [
        seq[ids.shape[1] : ids.shape[1] + stats.new_tokens]
        for seq, stats in zip(out.sequences.tolist(), out.stats.rows)
    ]
    assert news == expected
    assert out.stats.rows[0].accepted > NEW_TOKENS // 2 and out.stats.rows[1].accepted == 0
    assert out.stats.rows[0].tree_gain == out.stats.rows[0].accepted and out.stats.rows[2].tree_passes == 0
    assert out.stats.tree_gain == out.stats.rows[0].tree_gain and out.stats.rows[1].tree_passes > 0


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("limit", ["eos", "max_new_tokens"])
def test_a_tree_path_that_ends_the_output(limit: str, batch: bool) -> None:
    row, mate = prompts()[2], prompts()[1]
    full = alone("llama", row, eos_token_id=[])
    end = 9  # the output ends inside an accepted path
    eos, new_tokens = ([full[end]], NEW_TOKENS) if limit == "eos" else ([], end + 1)
    if limit == "eos":
        end = full.index(full[end])  # (the first time that token comes)
    rows = [row, mate] if batch else [row]
    references = [torch.cat([r, torch.tensor(alone("llama", r, new_tokens, eos_token_id=eos))]) for r in rows]
    ids, mask = left_padded(rows, 0)
    out = specula.generate(
        model("llama"),
        ids,
        TreeOracle(references, "second", VOCAB, depth=6),
        attention_mask=mask,
        max_new_tokens=new_tokens,
        eos_token_id=eos,
    )
    got = [
        seq[ids.shape[1] : ids.shape[1] + stats.new_tokens]
        for seq, stats in zip(out.sequences.tolist(), out.stats.rows)
    ]
    assert got[0] == full[: end + 1]
    assert got == [reference[len(r) :].tolist() for r, reference in zip(rows, references)]


V = 6
_RANDOM = torch.Generator().manual_seed(1)
P0 = torch.softmax(torch.randn(V, generator=_RANDOM) * 1.5, dim=-1)  # the target's first token
AFTER = torch.softmax(torch.randn(V, V, generator=_RANDOM) * 1.5, dim=-1)  # [first token, V]: its second
Q = torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0], [0, 0, 0, 0.2, 0.5, 0.3], [1 / 6] * 6])  # siblings: disjoint supports


def deterministic_tree(generator) -> specula.Draft:  # two candidates for the first token, the first continued
    return specula.Draft([3, 1, 4], parents=[-1, -1, 0])


def sampled_tree(generator) -> specula.Draft:  # each candidate drawn from its own q
    tokens = [int(torch.multinomial(q, 1, generator=generator)) for q in Q]
    return specula.Draft(tokens, probs=Q, parents=[-1, -1, 0])


def two_tokens(make_draft, trials: int = 20000) -> tuple[collections.Counter, collections.Counter]:
    """Steps over the trees ``make_draft`` draws, with the target above: how often each first token came, and each
    (first, second) pair where a step made two tokens."""
    sampling = specula.Sampling(do_sample=True, generator=torch.Generator().manual_seed(0))
    firsts, pairs = collections.Counter(), collections.Counter()
    for _ in range(trials):
        draft = make_draft(sampling.generator)
        rows = [P0] + [
            AFTER[token] if parent == -1 else torch.full((V,), 1 / V)
            for token, parent in zip(draft.tokens.tolist(), draft.parent_list())
        ]
        new = accept_draft(torch.log(torch.stack(rows)), draft, sampling)
        firsts[new[0]] += 1
        if len(new) > 1:
            pairs[new[0], new[1]] += 1
    return firsts, pairs


def fits_the_target(firsts: collections.Counter, pairs: collections.Counter) -> bool:
    """The first token is the target's, and so is the second given the first (wherever a step made one)."""
    with_second = collections.Counter(first for first, _ in pairs.elements())
    total = sum(with_second.values())
    conditional = {
        (first, second): with_second[first] / total * float(AFTER[first, second])
        for first in with_second
        for second in range(V)
    }
    return (
        chi_square_p_value(firsts, dict(enumerate(P0.tolist()))) > 0.001
        and chi_square_p_value(pairs, conditional) > 0.001
    )


@pytest.mark.distribution
@pytest.mark.parametrize("make_draft", [deterministic_tree, sampled_tree])
def test_a_tree_samples_exactly_the_targets_distribution(make_draft) -> None:
    assert fits_the_target(*two_tokens(make_draft))


@pytest.mark.distribution
def test_the_test_fails_without_renormalising_after_a_rejected_child(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: (p - q).clamp(min=0))
    assert not fits_the_target(*two_tokens(sampled_tree))


@pytest.mark.distribution
def test_the_test_fails_when_the_walk_follows_the_first_child_whatever_was_drawn(monkeypatch) -> None:
    """Deterministic trees: a drawn token that is a later sibling's moves the walk to the first child, whose
    scores then give the next token (the wrong prefix)."""

    def first_child_walk(scores, tokens, children, sampling):
        new, node = [], -1
        while True:
            drawn = int(sampling.sample(torch.softmax(scores[node + 1 : node + 2], dim=-1)))
            new.append(drawn)
            if not any(tokens[child] == drawn for child in children[node + 1]):
                return new
            node = children[node + 1][0]

    monkeypatch.setattr(acceptance, "_drawn_walk", first_child_walk)
    assert not fits_the_target(*two_tokens(deterministic_tree))


def test_a_model_that_cannot_hold_a_tree_gets_its_first_branches_and_a_warning() -> None:
    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )  # (no position_ids: ALiBi)
    bloom = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    row = prompts()[0]
    expected = hf_greedy(bloom, row[None], NEW_TOKENS, eos_token_id=[])[0, len(row) :].tolist()
    reference = [torch.tensor(row.tolist() + expected)]
    for shape in ("late", "second"):  # the right tokens first; a wrong first child everywhere
        with pytest.warns(UserWarning, match="takes no position_ids.*cut to their first branch"):
            # adaptive_draft=False: every draft is verified, whatever the cost model would decide on this machine
            out = specula.generate(
                bloom,
                row[None],
                TreeOracle(reference, shape, VOCAB),
                max_new_tokens=NEW_TOKENS,
                eos_token_id=[],
                adaptive_draft=False,
            )
        assert out.sequences[0, len(row) :].tolist() == expected
        assert out.stats.accepted > NEW_TOKENS // 2 if shape == "late" else out.stats.accepted == 0
