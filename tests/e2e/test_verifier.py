"""The verifier reproduces model.generate(do_sample=False) exactly, on every architecture, whatever the drafts."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from helpers import AlwaysWrong, Oracle, Recorder, hf_greedy
from tiny_models import ARCHITECTURES, VOCAB, tiny_model

import specula

REPETITIVE = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
RANDOM = [1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8]
SHORT = [1, 17]
PROMPTS = {"repetitive": REPETITIVE, "random": RANDOM, "short": SHORT}
NEW_TOKENS = 60


@functools.cache
def model(name: str) -> torch.nn.Module:
    return tiny_model(name)


@functools.cache
def reference(name: str, prompt: str) -> torch.Tensor:
    return hf_greedy(model(name), torch.tensor([PROMPTS[prompt]]), NEW_TOKENS)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prompt_lookup_matches_hf_greedy(name: str, prompt: str) -> None:
    out = specula.generate(
        model(name),
        torch.tensor([PROMPTS[prompt]]),
        specula.PromptLookup(),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        adaptive_draft=False,
    )
    assert out.sequences.tolist() == reference(name, prompt).tolist()
    stats = out.stats
    assert stats.new_tokens == NEW_TOKENS
    assert stats.passes == NEW_TOKENS - stats.accepted
    assert sum(stats.accepted_per_position) == stats.accepted <= stats.drafted
    if prompt == "repetitive":
        assert stats.accepted > 0


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_plain_decoding_matches_hf_greedy(name: str) -> None:
    out = specula.generate(model(name), torch.tensor([RANDOM]), None, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert out.sequences.tolist() == reference(name, "random").tolist()
    assert (out.stats.passes, out.stats.drafted, out.stats.tokens_per_pass) == (NEW_TOKENS, 0, 1.0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_oracle_and_always_wrong_proposers(name: str) -> None:
    ref = reference(name, "random")
    prompt = torch.tensor([RANDOM])
    oracle = specula.generate(
        model(name), prompt, Oracle(ref, 7), max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    wrong = specula.generate(
        model(name),
        prompt,
        AlwaysWrong(ref, 7, VOCAB),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        adaptive_draft=False,
    )
    assert oracle.sequences.tolist() == wrong.sequences.tolist() == ref.tolist()
    assert oracle.stats.acceptance_rate == 1.0
    assert oracle.stats.passes == 1 + -(
        -(NEW_TOKENS - 1) // 8
    )  # the prefill's token, then blocks of 7 drafts + 1 bonus
    assert wrong.stats.accepted == 0 and wrong.stats.drafted > 0
    assert wrong.stats.passes == NEW_TOKENS


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_eos_inside_an_accepted_block_stops_exactly(name: str) -> None:
    ref = reference(name, "random")[0, len(RANDOM) :].tolist()
    # Oracle blocks are 8 tokens per step after the prefill's one; pick an EOS whose first occurrence is mid-block.
    candidates = [i for i, t in enumerate(ref) if ref.index(t) == i and i >= 2 and i % 8 != 0]
    assert candidates, "the reference output has no usable token for this test"
    eos_position = candidates[len(candidates) // 2]
    eos = ref[eos_position]
    prompt = torch.tensor([RANDOM])
    recorder = Recorder(Oracle(reference(name, "random"), 7))
    out = specula.generate(model(name), prompt, recorder, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    expected = hf_greedy(model(name), prompt, NEW_TOKENS, eos_token_id=eos)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.new_tokens == eos_position + 1
    last_block, _ = recorder.observed[-1]
    assert last_block[-1] == eos


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9, 14, 23])
def test_max_new_tokens_inside_an_accepted_block(max_new_tokens: int) -> None:
    ref = reference("llama", "repetitive")
    prompt = torch.tensor([REPETITIVE])
    for proposer in (Oracle(ref, 7), specula.PromptLookup()):
        out = specula.generate(model("llama"), prompt, proposer, max_new_tokens=max_new_tokens, eos_token_id=[])
        assert out.sequences.tolist() == ref[:, : len(REPETITIVE) + max_new_tokens].tolist()
        assert out.stats.new_tokens == max_new_tokens


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_sliding_window_rollback_past_the_window(name: str) -> None:
    window = model(name).config.sliding_window
    prompt = torch.tensor([REPETITIVE * 3])
    assert prompt.shape[1] > 4 * window
    expected = hf_greedy(model(name), prompt, 120)
    out = specula.generate(
        model(name), prompt, specula.PromptLookup(), max_new_tokens=120, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.accepted > 0 and out.stats.accepted < out.stats.drafted  # rollbacks happened


def test_left_padding_matches_hf() -> None:
    prompt = torch.tensor([[0, 0, 0, *RANDOM]])
    mask = torch.tensor([[0, 0, 0] + [1] * len(RANDOM)])
    expected = hf_greedy(model("llama"), prompt, 30, attention_mask=mask)
    out = specula.generate(
        model("llama"), prompt, specula.PromptLookup(), attention_mask=mask, max_new_tokens=30, eos_token_id=[]
    )
    assert out.sequences.tolist() == expected.tolist()


def test_defaults_follow_generation_config() -> None:
    llama = model("llama")
    prompt = torch.tensor([RANDOM])
    expected = llama.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False)
    out = specula.generate(llama, prompt, specula.PromptLookup())
    assert out.sequences.tolist() == expected.tolist()


def test_proposer_hooks_see_the_whole_sequence() -> None:
    ref = reference("llama", "random")
    recorder = Recorder(specula.PromptLookup())
    out = specula.generate(model("llama"), torch.tensor([RANDOM]), recorder, max_new_tokens=25, eos_token_id=[])
    assert recorder.prompts == [RANDOM]
    observed = [t for block, _ in recorder.observed for t in block]
    assert observed == out.sequences[0, len(RANDOM) :].tolist() == ref[0, len(RANDOM) : len(RANDOM) + 25].tolist()
    assert sum(accepted for _, accepted in recorder.observed) == out.stats.accepted


def test_third_party_proposer_with_plain_lists() -> None:
    class Repeat(specula.Proposer):
        def propose(self, context_ids, max_tokens):
            return specula.Draft([int(context_ids[-1])] * max_tokens)

    out = specula.generate(model("gpt2"), torch.tensor([RANDOM]), Repeat(), max_new_tokens=20, eos_token_id=[])
    assert out.sequences.tolist() == hf_greedy(model("gpt2"), torch.tensor([RANDOM]), 20).tolist()


def test_a_mamba_model_decodes_with_drafts_as_model_generate() -> None:
    """Its recurrent state is verified step by step (specula.verifier.recurrent); it used to be refused."""
    import transformers

    torch.manual_seed(0)
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1)
    )
    expected = hf_greedy(mamba.eval(), torch.tensor([REPETITIVE]), 5).tolist()
    for proposer in (specula.PromptLookup(), None):
        out = specula.generate(
            mamba, torch.tensor([REPETITIVE]), proposer, max_new_tokens=5, eos_token_id=[], adaptive_draft=False
        )
        assert out.sequences.tolist() == expected


class _IgnoresTheCache(transformers.LlamaForCausalLM):
    """Takes past_key_values but computes with a cache of its own, as XLM did: model.generate still works (it carries
    the returned cache on), a loop that keeps its own cache object sees only the new tokens."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


def test_a_model_that_ignores_the_cache_is_refused(monkeypatch) -> None:
    config = model("llama").config
    torch.manual_seed(0)  # (after the reference model is made: the same weights alone and in the whole file)
    ignoring = _IgnoresTheCache(config).eval()
    prompt = torch.tensor([RANDOM])
    expected = hf_greedy(ignoring, prompt, 20)
    for proposer in (specula.PromptLookup(), None):
        with pytest.raises(specula.UnsupportedModelError, match="holds nothing where specula expects 16"):
            specula.generate(ignoring, prompt, proposer, max_new_tokens=20)
    # Without the check the output is silently wrong.
    monkeypatch.setattr(specula.verifier.runner, "check_cache_length", lambda model, cache, expected, after: None)
    assert specula.generate(ignoring, prompt, None, max_new_tokens=20).sequences.tolist() != expected.tolist()
