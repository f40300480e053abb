"""The acceptance rule, analytically: for any p and q, emitted tokens are distributed as p (specula.core.acceptance)."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import chi_square_p_value
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor

import specula
from specula.core.acceptance import accept_draft, accept_drafts, acceptance_probability, residual_distribution
from specula.core.sampling import Sampling


def output_distribution(p: torch.Tensor, q: torch.Tensor, accept_probability=acceptance_probability) -> torch.Tensor:
    """Exact distribution of the token emitted at one draft position: draw d ~ q, accept it with a(d), else draw
    from the residual. sum_d q(d) a(d) [x = d] + (sum_d q(d) (1 - a(d))) residual(x)."""
    tokens = torch.arange(len(p))
    accept = accept_probability(p[tokens], q[tokens])
    rejected_mass = (q * (1 - accept)).sum()
    return q * accept + rejected_mass * residual_distribution(p[None], q[None])[0]


def distributions(size: int):
    """Probability vectors over ``size`` tokens, with exact zeros and tiny values."""
    weight = st.one_of(st.just(0.0), st.floats(1e-12, 1.0), st.floats(1e-3, 1.0))
    return (
        st.lists(weight, min_size=size, max_size=size)
        .filter(lambda w: sum(w) > 0)
        .map(lambda w: torch.tensor(w, dtype=torch.float64) / sum(w))
    )


@st.composite
def p_and_q(draw):
    size = draw(st.integers(2, 8))
    p = draw(distributions(size))
    kind = draw(st.sampled_from(["any", "one-hot", "near-tie", "equal"]))
    if kind == "any":
        q = draw(distributions(size))
    elif kind == "one-hot":  # a deterministic proposer
        q = torch.zeros(size, dtype=torch.float64)
        q[draw(st.integers(0, size - 1))] = 1.0
    elif kind == "near-tie":
        noise = torch.tensor(draw(st.lists(st.floats(0, 1e-9), min_size=size, max_size=size)), dtype=torch.float64)
        q = (p + noise) / (p + noise).sum()
    else:
        q = p.clone()
    return p, q


@settings(max_examples=500, deadline=None)
@given(p_and_q())
def test_acceptance_rule_emits_exactly_p(pq) -> None:
    p, q = pq
    assert torch.allclose(output_distribution(p, q), p, rtol=0, atol=1e-9)


def test_the_analytic_check_catches_a_wrong_rule() -> None:
    """The property above is not vacuous: accepting with min(1, q/p), or resampling from p, breaks it."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    inverted = output_distribution(p, q, accept_probability=lambda pd, qd: (qd / pd).clamp(max=1))
    assert not torch.allclose(inverted, p, atol=1e-3)
    one_hot = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    tokens = torch.arange(3)
    accept = acceptance_probability(p[tokens], one_hot[tokens])
    resample_from_p = one_hot * accept + (one_hot * (1 - accept)).sum() * p
    assert not torch.allclose(resample_from_p, p, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# accept_draft itself, on logits: the same rule as implemented, vectorised, in float32.


def test_greedy_is_the_temperature_zero_case() -> None:
    logits = torch.randn(4, 10)
    draft = specula.Draft(logits[:3].argmax(-1))
    for sampling in (specula.Sampling(), specula.Sampling.from_settings(temperature=0.0, top_k=3)):
        assert accept_draft(logits, draft, sampling) == logits.argmax(-1).tolist()


def first_token_counts(logits, draft_for, sampling, samples) -> collections.Counter:
    counts = collections.Counter()
    for _ in range(samples):
        counts[accept_draft(logits, draft_for(), sampling)[0]] += 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accept_draft_emits_p_for_one_hot_and_stochastic_drafts(dtype) -> None:
    torch.manual_seed(0)
    sampling = specula.Sampling.from_settings(temperature=0.9, top_k=5, top_p=0.95)
    logits = (torch.randn(3, 7) * 2).to(dtype)
    p = sampling.probs(logits)[0].double()
    expected = {token: float(p[token]) for token in range(7)}
    q = torch.softmax(torch.randn(7) * 2, -1)

    def stochastic():
        d = int(torch.multinomial(q, 1))
        return specula.Draft([d, 0], torch.stack([q, q]))

    for draft_for in (lambda: specula.Draft([int(p.argmax()), 1]), lambda: specula.Draft([6, 1]), stochastic):
        counts = first_token_counts(logits, draft_for, sampling, 3000)
        assert chi_square_p_value(counts, expected) > 0.001


def test_the_bonus_token_comes_from_the_last_row() -> None:
    torch.manual_seed(0)
    sampling = specula.Sampling.from_settings(temperature=1.0)
    logits = torch.stack([torch.tensor([5.0, 0, 0, 0, 0]), torch.randn(5)])
    expected = dict(enumerate(sampling.probs(logits)[1].tolist()))
    counts = collections.Counter()
    for _ in range(3000):
        tokens = accept_draft(logits, specula.Draft([0]), sampling)
        if len(tokens) == 2:
            counts[tokens[1]] += 1
    assert chi_square_p_value(counts, expected) > 0.001


def test_zero_probability_corner_cases() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0], [0.0] * 5])
    top2 = specula.Sampling.from_settings(temperature=1.0, top_k=2)
    # A draft token outside the target's top-k has p = 0: never accepted.
    assert all(accept_draft(logits, specula.Draft([3]), top2)[0] in (0, 1) for _ in range(200))
    # A drafter that gave its own token probability 0 (q(d) = 0) is accepted iff p(d) > 0, without dividing by 0.
    q_zero = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    assert all(accept_draft(logits, specula.Draft([1], q_zero), top2)[0] in (0, 1) for _ in range(200))
    accepted = [accept_draft(logits, specula.Draft([0], q_zero), top2) for _ in range(200)]
    assert all(len(tokens) == 2 for tokens in accepted)
    # p == q: the residual is all zero, a rejection cannot happen and nothing is NaN.
    p = top2.probs(logits[:1])
    assert all(len(accept_draft(logits, specula.Draft([0], p), top2)) == 2 for _ in range(50))
    assert all(accept_draft(logits, specula.Draft([1], p), top2)[:1] == [1] for _ in range(50))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_pass_accepts_each_row_as_accept_draft_does(data) -> None:
    """``accept_drafts`` (a pass's rows, the greedy ones without processors sharing one argmax) gives each row what
    ``accept_draft`` gives it alone: chains and trees of any length, greedy with and without processors, sampled."""
    vocab, rows = 6, data.draw(st.integers(1, 5))
    kinds = data.draw(st.lists(st.sampled_from(["greedy", "processed", "sampled"]), min_size=rows, max_size=rows))
    drafts, logits, samplings = [], [], []
    for kind in kinds:
        tree = data.draw(st.booleans())  # (a tree's tokens distinct: no two siblings alike)
        tokens = data.draw(st.lists(st.integers(0, vocab - 1), max_size=5, unique=tree))
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(len(tokens))] if tree else None
        drafts.append(specula.Draft(tokens, parents=parents))
        # near-ties in each row's logits, so a wrong row's argmax would differ
        logits.append(
            torch.tensor(
                data.draw(
                    st.lists(
                        st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab),
                        min_size=len(tokens) + 1,
                        max_size=len(tokens) + 1,
                    )
                ),
                dtype=torch.float32,
            )
        )
        processors = [] if kind == "greedy" else [_FavourFirst()]
        samplings.append(
            Sampling(
                do_sample=kind == "sampled",
                processors=processors,
                generator=torch.Generator().manual_seed(len(samplings)),
            )
        )

    def tokens(row: int) -> torch.Tensor:  # [1, length + len(draft)]: what the processors read
        return torch.cat([torch.zeros(3, dtype=torch.long), drafts[row].tokens])[None]

    alone = []
    for row in range(rows):
        samplings[row].generator.manual_seed(row)
        alone.append(accept_draft(logits[row], drafts[row], samplings[row], tokens(row)))
    for row in range(rows):
        samplings[row].generator.manual_seed(row)
    assert accept_drafts(logits, drafts, samplings, tokens) == alone


class _FavourFirst(LogitsProcessor):
    """A processor that changes the argmax (token 0 raised): rows it processes must not take the raw logits'."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores + 2.5 * (torch.arange(scores.shape[-1]) == 0)
