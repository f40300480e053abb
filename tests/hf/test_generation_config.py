"""specula.generate reads the model's generation_config exactly as model.generate does."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from tiny_models import tiny_model

import specula

PROMPT = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
NEW_TOKENS = 40


@functools.cache
def plain_output() -> list[int]:
    """The new tokens of greedy decoding with no setting that changes them: the settings below are chosen from it, so
    that each one changes what model.generate produces."""
    model = tiny_model("llama")
    out = model.generate(
        PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None
    )
    return out[0, PROMPT.shape[1] :].tolist()


def settings(name: str) -> dict:
    new = plain_output()
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "suppress_tokens": dict(suppress_tokens=[new[1]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[new[0]]),
        "bad_words_ids": dict(bad_words_ids=[[new[2], new[3]]]),
        "min_new_tokens": dict(eos_token_id=new[2], min_new_tokens=12),
        "forced_eos_token_id": dict(eos_token_id=None, forced_eos_token_id=(new[-1] + 1) % 90 + 3),
    }[name]


SETTINGS = [
    "repetition_penalty",
    "no_repeat_ngram_size",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "min_new_tokens",
    "forced_eos_token_id",
]


def configured(name: str) -> torch.nn.Module:
    model = tiny_model("llama")
    model.generation_config.update(**{"eos_token_id": None, **settings(name)})
    return model


def hf_greedy(model: torch.nn.Module) -> list[int]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0].tolist()


@pytest.mark.parametrize("name", SETTINGS)
def test_each_setting_of_the_generation_config_is_applied(name: str) -> None:
    model = configured(name)
    expected = hf_greedy(model)
    assert expected[PROMPT.shape[1] :] != plain_output(), f"{name} must change the output for this test to mean much"
    for proposer in (specula.PromptLookup(), None):
        out = specula.generate(model, PROMPT, proposer, max_new_tokens=NEW_TOKENS)
        assert out.sequences[0].tolist() == expected


def test_sampling_settings_of_the_generation_config_are_applied() -> None:
    """A config that asks for sampling samples; explicit arguments override it."""
    model = tiny_model("llama")
    model.generation_config.update(eos_token_id=None, do_sample=True, temperature=2.0)
    outputs = {tuple(specula.generate(model, PROMPT, max_new_tokens=10).sequences[0].tolist()) for _ in range(4)}
    assert len(outputs) > 1
    greedy = specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert greedy.sequences[0, PROMPT.shape[1] :].tolist() == plain_output()
    assert specula.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, temperature=0).sequences.tolist() == (
        greedy.sequences.tolist()
    )


def test_the_test_fails_when_the_configs_processors_are_dropped(monkeypatch) -> None:
    def without_processors(do_sample, processors, generator):
        return specula.Sampling(do_sample, [], generator)

    monkeypatch.setattr(sys.modules["specula.hf.bridge"], "Sampling", without_processors)
    model = configured("repetition_penalty")
    out = specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=NEW_TOKENS)
    assert out.sequences[0].tolist() != hf_greedy(model)
