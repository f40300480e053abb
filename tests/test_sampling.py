"""Speculative sampling is lossless: the acceptance rule analytically, then specula.generate statistically."""

from __future__ import annotations

import collections
import functools
import itertools
import sys

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import specula
from specula.core import acceptance
from specula.core.acceptance import accept_draft, acceptance_probability, residual_distribution
from helpers import AlwaysWrong, NoisyModelDrafter, Oracle, TreeOracle, chi_square_p_value
from tiny_models import VOCAB as TINY_VOCAB, tiny_model

# ---------------------------------------------------------------------------------------------------------------
# The acceptance rule, analytically: for any p and q, emitted tokens are distributed as p.


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
    return st.lists(weight, min_size=size, max_size=size).filter(lambda w: sum(w) > 0).map(
        lambda w: torch.tensor(w, dtype=torch.float64) / sum(w)
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


# ---------------------------------------------------------------------------------------------------------------
# End to end: specula.generate samples the target's exact joint distribution of the first tokens.

VOCAB = 8
PLAIN = dict(temperature=0.8)
TRUNCATED = dict(temperature=0.7, top_k=4, top_p=0.9)


@functools.cache
def sharp_model() -> torch.nn.Module:
    """A tiny Llama over 8 tokens whose next-token distributions are peaked, so top-k and top-p cut real mass."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def hf_warped_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's next-token distribution, built here from transformers' warpers directly (not specula's code)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(warpers(None, logits.double()), dim=-1)


@functools.cache
def joint_of_two_tokens(prompt: tuple[int, ...], settings_items: tuple) -> dict[tuple[int, int], float]:
    """Exact P(x1, x2 | prompt) of the target under the sampling settings."""
    model, settings_ = sharp_model(), dict(settings_items)
    with torch.no_grad():
        first = hf_warped_probs(model(torch.tensor([prompt])).logits[0, -1:], **settings_)[0]
        batch = torch.tensor([[*prompt, x] for x in range(VOCAB)])
        second = hf_warped_probs(model(batch).logits[:, -1], **settings_)
    return {(x1, x2): float(first[x1] * second[x1, x2]) for x1, x2 in itertools.product(range(VOCAB), repeat=2)}


@functools.cache
def copyable_prompt(settings_items: tuple) -> tuple[int, ...]:
    """A prompt [a b c d a b]: PromptLookup drafts "c d", and the target accepts each with probability near 1/2,
    so both the accept and the reject paths are sampled often."""
    model, settings_ = sharp_model(), dict(settings_items)
    candidates = torch.tensor([[a, b, c, d, a, b, c] for a, b, c, d in itertools.permutations(range(VOCAB), 4)])
    with torch.no_grad():
        probs = hf_warped_probs(model(candidates).logits[:, -2:].reshape(-1, VOCAB), **settings_).reshape(-1, 2, VOCAB)
    p_c = probs[:, 0].gather(1, candidates[:, 2:3])[:, 0]
    p_d = probs[:, 1].gather(1, candidates[:, 3:4])[:, 0]
    balance = torch.minimum(p_c, 1 - p_c) + torch.minimum(p_d, 1 - p_d)
    return tuple(candidates[int(balance.argmax()), :6].tolist())


def sample_first_two(make_proposer, settings_: dict, samples: int, seed: int = 1234, adaptive: bool = False):
    prompt = copyable_prompt(tuple(settings_.items()))
    torch.manual_seed(seed)
    counts, stats = collections.Counter(), specula.SpecStats()
    for _ in range(samples):
        out = specula.generate(
            sharp_model(), torch.tensor([prompt]), make_proposer(), max_new_tokens=3, eos_token_id=[],
            do_sample=True, adaptive_draft=adaptive, **settings_,
        )
        counts[tuple(out.sequences[0, len(prompt) : len(prompt) + 2].tolist())] += 1
        stats.drafted += out.stats.drafted
        stats.accepted += out.stats.accepted
    return counts, joint_of_two_tokens(prompt, tuple(settings_.items())), stats


@pytest.mark.parametrize(
    "settings_, num_draft",
    [(PLAIN, 2), (TRUNCATED, 2), (TRUNCATED, 1)],
    ids=["temperature", "temperature-top_k-top_p", "one-draft-then-bonus"],
)
def test_prompt_lookup_samples_the_targets_distribution(settings_, num_draft) -> None:
    counts, expected, stats = sample_first_two(lambda: specula.PromptLookup(num_draft=num_draft), settings_, 3000)
    assert 0.2 < stats.acceptance_rate < 0.8, "the prompt must exercise both accepted and rejected drafts"
    assert chi_square_p_value(counts, expected) > 0.001


def test_stochastic_drafter_samples_the_targets_distribution() -> None:
    counts, expected, stats = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 3000)
    assert 0.1 < stats.acceptance_rate < 0.9
    assert chi_square_p_value(counts, expected) > 0.001


def test_plain_decoding_samples_the_targets_distribution() -> None:
    counts, expected, _ = sample_first_two(lambda: None, TRUNCATED, 2000)
    assert chi_square_p_value(counts, expected) > 0.001


def test_the_reference_distribution_is_what_model_generate_samples() -> None:
    """The exact joint used above is the one model.generate(do_sample=True) draws from."""
    model, prompt = sharp_model(), copyable_prompt(tuple(TRUNCATED.items()))
    torch.manual_seed(99)
    counts = collections.Counter()
    for _ in range(2000):
        ids = torch.tensor([prompt])  # token 0 is the pad token: say it is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=2, **TRUNCATED)
        counts[tuple(out[0, len(prompt) :].tolist())] += 1
    assert chi_square_p_value(counts, joint_of_two_tokens(prompt, tuple(TRUNCATED.items()))) > 0.001


# The same tests fail on deliberately wrong variants of the rule: the statistics have the power to catch them.


def test_the_test_fails_when_rejections_resample_from_p(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    counts, expected, _ = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


def test_the_test_fails_when_draft_positions_are_drawn_from_the_wrong_prefix(monkeypatch) -> None:
    """Deterministic drafts: the token at each node is drawn from the scores a token later (after its first child,
    the draft token being verified) instead of that node's own."""
    def walk_one_token_late(scores, tokens, children, sampling):
        new, node = [], -1
        while True:
            late = min(node + 2, len(scores) - 1)
            drawn = int(sampling.sample(torch.softmax(scores[late : late + 1], dim=-1)))
            new.append(drawn)
            node = next((child for child in children[node + 1] if tokens[child] == drawn), None)
            if node is None:
                return new

    monkeypatch.setattr(acceptance, "_drawn_walk", walk_one_token_late)
    counts, expected, _ = sample_first_two(specula.PromptLookup, TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


def test_the_test_fails_when_the_ratio_is_inverted(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "acceptance_probability", lambda p, q: (q / p.clamp(min=1e-30)).clamp(max=1))
    counts, expected, _ = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


def test_the_test_fails_when_top_p_is_applied_to_q_only(monkeypatch) -> None:
    """The drafter samples with top-k and top-p, the verifier's p lacks top-p (warpers applied to one side only)."""
    def without_top_p(do_sample, processors, generator):
        return specula.Sampling(do_sample, [p for p in processors if not isinstance(p, TopPLogitsWarper)], generator)

    monkeypatch.setattr(sys.modules["specula.hf.bridge"], "Sampling", without_top_p)
    drafter = lambda: NoisyModelDrafter(sharp_model(), 2, sampling=specula.Sampling.from_settings(**TRUNCATED))  # noqa: E731
    counts, expected, _ = sample_first_two(drafter, TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


# ---------------------------------------------------------------------------------------------------------------
# Reproducibility, stopping, settings and bad input.


def test_seeded_runs_are_reproducible() -> None:
    model, prompt = tiny_model("llama"), torch.tensor([[1, 5, 6, 7, 5, 6, 7, 5, 6]])

    def run(**kwargs):
        return specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=30, do_sample=True, **kwargs)

    torch.manual_seed(7)
    first = run().sequences
    torch.manual_seed(7)
    assert torch.equal(run().sequences, first)
    outputs = set()
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # a generator makes the run independent of the global RNG
        outputs.add(tuple(run(generator=torch.Generator().manual_seed(3)).sequences[0].tolist()))
    assert len(outputs) == 1
    torch.manual_seed(8)
    assert not torch.equal(run().sequences, first)


def test_sampling_stops_exactly_at_eos_and_max_new_tokens() -> None:
    model, prompt = tiny_model("llama"), torch.tensor([[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    torch.manual_seed(0)
    ended_by_eos = 0
    for _ in range(40):
        out = specula.generate(
            model, prompt, specula.PromptLookup(), max_new_tokens=17, eos_token_id=7, do_sample=True, temperature=1.5
        )
        new = out.sequences[0, prompt.shape[1] :].tolist()
        if 7 in new:
            ended_by_eos += 1
            assert new.index(7) == len(new) - 1
        else:
            assert len(new) == 17
        assert out.stats.new_tokens == len(new)
    assert ended_by_eos > 0


def test_settings_come_from_the_generation_config_exactly_as_in_model_generate() -> None:
    """Seeded plain decoding draws the same tokens as seeded model.generate: the same processors, warpers and
    settings (the model's generation_config, then transformers' defaults: top_k=50 here), the same random draws."""
    model, prompt = tiny_model("llama"), torch.tensor([[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    model.generation_config.update(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.3)

    def both(**kwargs):
        torch.manual_seed(5)
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, **kwargs)
        torch.manual_seed(5)
        return expected, specula.generate(model, prompt, None, max_new_tokens=30, **kwargs).sequences

    expected, out = both(eos_token_id=[])
    assert out.tolist() == expected.tolist()
    expected, out = both(eos_token_id=[], top_k=3, temperature=1.5)  # explicit arguments override the config
    assert out.tolist() == expected.tolist()
    expected, out = both(eos_token_id=[], do_sample=False)
    assert out.tolist() == expected.tolist()
    model.generation_config.update(do_sample=False, repetition_penalty=1.0)  # what the config asked made a difference
    torch.manual_seed(5)
    assert specula.generate(model, prompt, None, max_new_tokens=30, eos_token_id=[]).sequences.tolist() != expected.tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature.*strictly positive"),  # transformers' own checks, as model.generate
        (dict(temperature="hot"), "temperature.*strictly positive"),
        (dict(top_k=-1), "top_k.*strictly positive integer"),
        (dict(top_k=2.5), "top_k.*strictly positive integer"),
        (dict(generator=123), "generator must be a torch.Generator"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        specula.generate(tiny_model("llama"), torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=True, **kwargs)


def test_draft_probabilities_over_another_vocabulary_are_refused() -> None:
    class WrongWidth(specula.Proposer):
        def propose(self, context_ids, max_tokens):
            return specula.Draft([3], torch.full((1, 10), 0.1))

    with pytest.raises(ValueError, match="probabilities over 10 tokens but the target's vocabulary has 96"):
        specula.generate(tiny_model("llama"), torch.tensor([[1, 2, 3]]), WrongWidth(), max_new_tokens=4, do_sample=True)


# ---------------------------------------------------------------------------------------------------------------
# Seeded sampling draws model.generate's very tokens, whatever the drafts and their lengths.

SEEDED = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=12),
    "top_p-repetition_penalty": dict(temperature=0.9, top_p=0.8, repetition_penalty=1.3),
}
_SAMPLED_TOKENS = 40


def _sharp(name: str) -> torch.nn.Module:
    """A tiny model whose next-token distributions are peaked enough for drafts of its own samples to be drawn
    again now and then."""
    model = tiny_model(name)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    return model


def hf_sampled(model, prompt: torch.Tensor, seed: int, **settings_) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                          max_new_tokens=_SAMPLED_TOKENS, eos_token_id=[], pad_token_id=0, **settings_)


def specula_sampled(model, prompt: torch.Tensor, proposer, seed: int, **kwargs) -> specula.GenerateOutput:
    torch.manual_seed(seed)
    return specula.generate(model, prompt, proposer, do_sample=True, max_new_tokens=_SAMPLED_TOKENS,
                            eos_token_id=[], **kwargs)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("settings_", list(SEEDED.values()), ids=list(SEEDED))
def test_seeded_sampling_draws_model_generates_tokens(name: str, settings_: dict) -> None:
    """With the same seed, every proposer and every way of choosing draft lengths gives model.generate's tokens:
    PromptLookup, drafts of the reference's own tokens (mostly accepted) and of wrong ones (never)."""
    model, prompt = _sharp(name), torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    for seed in (0, 1, 2):
        ref = hf_sampled(model, prompt, seed, **settings_)
        for proposer in (specula.PromptLookup(), Oracle(ref, 6), AlwaysWrong(ref, 6, TINY_VOCAB), None):
            for adaptive in (True, False):
                out = specula_sampled(model, prompt, proposer, seed, adaptive_draft=adaptive, **settings_)
                assert out.sequences.tolist() == ref.tolist(), (seed, type(proposer).__name__, adaptive)
                if isinstance(proposer, Oracle) and not isinstance(proposer, AlwaysWrong) and not adaptive:
                    assert out.stats.accepted >= _SAMPLED_TOKENS // 2


@pytest.mark.parametrize("shape", ["second", "detour", "late", "wrong"])
def test_seeded_sampling_through_trees_draws_model_generates_tokens(shape: str) -> None:
    model, prompt = _sharp("llama"), torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    for seed in (0, 1):
        ref = hf_sampled(model, prompt, seed, **SEEDED["top_k"])
        out = specula_sampled(model, prompt, TreeOracle([ref], shape, TINY_VOCAB), seed, adaptive_draft=False,
                              **SEEDED["top_k"])
        assert out.sequences.tolist() == ref.tolist()
        assert out.stats.tree_steps > 0 and (shape == "wrong" or out.stats.accepted >= _SAMPLED_TOKENS // 2)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch() -> None:
    """Each row draws from its own generator: a request seeded s gives model.generate's tokens with seed s, alone
    and next to other requests (rows accepting different numbers of drafts)."""
    model = _sharp("llama")
    prompts = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 9, 3, 9, 3, 9, 3], [1, 4, 4, 4, 4, 4, 4, 4, 4]]
    refs = [hf_sampled(model, torch.tensor([p]), seed, **SEEDED["top_k"]) for seed, p in enumerate(prompts)]
    for rows in ([0, 1], [2, 0], [1, 2, 0]):
        width = max(len(prompts[r]) for r in rows)
        ids = torch.tensor([[0] * (width - len(prompts[r])) + prompts[r] for r in rows])
        mask = (torch.arange(width) >= torch.tensor([width - len(prompts[r]) for r in rows])[:, None]).long()
        out = specula.generate(model, ids, Oracle([refs[r] for r in rows], 6), attention_mask=mask, do_sample=True,
                               max_new_tokens=_SAMPLED_TOKENS, eos_token_id=[], adaptive_draft=False,
                               generator=[torch.Generator().manual_seed(r) for r in rows], **SEEDED["top_k"])
        for b, r in enumerate(rows):
            assert out.sequences[b, width:].tolist() == refs[r][0, len(prompts[r]):].tolist(), (rows, r)
        assert out.stats.accepted > 0
