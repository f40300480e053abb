"""Speculative sampling is lossless end to end: specula.generate samples the target's exact joint distribution."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from architectures import tiny_causal_lm
from helpers import AlwaysWrong, NoisyModelDrafter, Oracle, PartlyRight, TreeOracle, chi_square_p_value
from sampling_cases import PLAIN, TRUNCATED, copyable_prompt, joint_of_two_tokens, sample_first_two, sharp_model
from tiny_models import VOCAB as TINY_VOCAB
from tiny_models import tiny_model
from transformers import TopPLogitsWarper

import specula
from specula.core import acceptance

# ---------------------------------------------------------------------------------------------------------------
# End to end: specula.generate samples the target's exact joint distribution of the first tokens.


@pytest.mark.distribution
@pytest.mark.parametrize(
    "settings_, num_draft",
    [(PLAIN, 2), (TRUNCATED, 2), (TRUNCATED, 1)],
    ids=["temperature", "temperature-top_k-top_p", "one-draft-then-bonus"],
)
def test_prompt_lookup_samples_the_targets_distribution(settings_, num_draft) -> None:
    counts, expected, stats = sample_first_two(lambda: specula.PromptLookup(num_draft=num_draft), settings_, 3000)
    assert 0.2 < stats.acceptance_rate < 0.8, "the prompt must exercise both accepted and rejected drafts"
    assert chi_square_p_value(counts, expected) > 0.001


@pytest.mark.distribution
def test_stochastic_drafter_samples_the_targets_distribution() -> None:
    counts, expected, stats = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 3000)
    assert 0.1 < stats.acceptance_rate < 0.9
    assert chi_square_p_value(counts, expected) > 0.001


@pytest.mark.distribution
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


@pytest.mark.distribution
def test_the_test_fails_when_rejections_resample_from_p(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    counts, expected, _ = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


@pytest.mark.distribution
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


@pytest.mark.distribution
def test_the_test_fails_when_the_ratio_is_inverted(monkeypatch) -> None:
    monkeypatch.setattr(acceptance, "acceptance_probability", lambda p, q: (q / p.clamp(min=1e-30)).clamp(max=1))
    counts, expected, _ = sample_first_two(lambda: NoisyModelDrafter(sharp_model(), 2), TRUNCATED, 1000)
    assert chi_square_p_value(counts, expected) < 0.001


@pytest.mark.distribution
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
    assert (
        specula.generate(model, prompt, None, max_new_tokens=30, eos_token_id=[]).sequences.tolist()
        != expected.tolist()
    )


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
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        max_new_tokens=_SAMPLED_TOKENS,
        eos_token_id=[],
        pad_token_id=0,
        **settings_,
    )


def specula_sampled(model, prompt: torch.Tensor, proposer, seed: int, **kwargs) -> specula.GenerateOutput:
    torch.manual_seed(seed)
    return specula.generate(
        model, prompt, proposer, do_sample=True, max_new_tokens=_SAMPLED_TOKENS, eos_token_id=[], **kwargs
    )


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


@pytest.mark.parametrize(
    "model_type", ["qwen3_next", "mamba2", "falcon_h1", "mamba", "recurrent_gemma", "deepseek_v32", "glm_moe_dsa"]
)
def test_seeded_sampling_with_recurrent_state_or_sparse_attention_draws_model_generates_tokens(model_type: str) -> None:
    """Recurrent state rolled back after rejected drafts (specula.verifier.recurrent: fed again, or step by step for
    mamba
    and recurrent_gemma), and sparse attention's keys picked per query (specula.verifier.indexer), leave the draws
    model.generate's."""
    model, prompt = tiny_causal_lm(model_type), torch.tensor([[5, 17, 33, 42, 8, 61, 29] * 3])
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)
    for seed in (0, 1):
        ref = hf_sampled(model, prompt, seed, **SEEDED["temperature"])
        for proposer in (specula.PromptLookup(), Oracle(ref, 6), PartlyRight(ref, 6)):
            out = specula_sampled(
                model, prompt, proposer, seed, adaptive_draft=False, pad_token_id=0, **SEEDED["temperature"]
            )
            assert out.sequences.tolist() == ref.tolist(), (seed, type(proposer).__name__)
            if isinstance(proposer, Oracle):
                assert out.stats.accepted >= _SAMPLED_TOKENS // 3


@pytest.mark.parametrize("shape", ["second", "detour", "late", "wrong"])
def test_seeded_sampling_through_trees_draws_model_generates_tokens(shape: str) -> None:
    model, prompt = _sharp("llama"), torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    for seed in (0, 1):
        ref = hf_sampled(model, prompt, seed, **SEEDED["top_k"])
        out = specula_sampled(
            model, prompt, TreeOracle([ref], shape, TINY_VOCAB), seed, adaptive_draft=False, **SEEDED["top_k"]
        )
        assert out.sequences.tolist() == ref.tolist()
        assert out.stats.tree_passes > 0 and (shape == "wrong" or out.stats.accepted >= _SAMPLED_TOKENS // 2)


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
        out = specula.generate(
            model,
            ids,
            Oracle([refs[r] for r in rows], 6),
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=_SAMPLED_TOKENS,
            eos_token_id=[],
            adaptive_draft=False,
            generator=[torch.Generator().manual_seed(r) for r in rows],
            **SEEDED["top_k"],
        )
        for b, r in enumerate(rows):
            assert out.sequences[b, width:].tolist() == refs[r][0, len(prompts[r]) :].tolist(), (rows, r)
        assert out.stats.accepted > 0
