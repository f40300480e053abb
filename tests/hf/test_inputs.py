"""Bad input gets a ValueError that says what is wrong, before anything reaches the model."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, tiny_model

import specula


@functools.cache
def llama() -> torch.nn.Module:
    return tiny_model("llama")


PROMPT = torch.tensor([[1, 5, 6, 7]])


@pytest.mark.parametrize(
    "input_ids, message",
    [
        (torch.empty(1, 0, dtype=torch.long), "empty"),
        (torch.tensor([[1.0, 2.0]]), "integer token ids"),
        (torch.tensor([[True, False]]), "integer token ids"),
        (torch.tensor([[[1, 2]]]), "shape"),
        (torch.empty(0, 3, dtype=torch.long), "shape"),
        (torch.tensor([[0, 0, 5], [1, 4, 5]]), "start with the pad token"),  # padded rows, but no attention_mask
        (torch.tensor([[1, VOCAB]]), f"vocabulary of {VOCAB}"),
        (torch.tensor([[1, -3]]), "vocabulary"),
        ("hello", "token ids"),
        (torch.ones(1, 600, dtype=torch.long), "at most 512 positions"),
    ],
)
def test_bad_input_ids(input_ids, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specula.generate(llama(), input_ids, specula.PromptLookup(), max_new_tokens=4)


@pytest.mark.parametrize("max_new_tokens", [-1, 0, 2.5, "8", True])
def test_bad_max_new_tokens(max_new_tokens) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        specula.generate(llama(), PROMPT, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(1, 3, dtype=torch.long), "must match"),
        (torch.tensor([[1, 1, 1, 0]]), "right padding"),
        (torch.tensor([[1, 2, 1, 1]]), "only 0"),
    ],
)
def test_bad_attention_mask(mask, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specula.generate(llama(), PROMPT, attention_mask=mask, max_new_tokens=4)


def test_a_model_without_generate_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a transformers causal LM"):
        specula.generate(llama().model, PROMPT, max_new_tokens=4)  # the bare decoder, without its LM head


def test_bad_eos_token_id() -> None:
    with pytest.raises(ValueError, match="eos_token_id"):
        specula.generate(llama(), PROMPT, eos_token_id="</s>", max_new_tokens=4)


def test_context_overflow_is_clamped_with_a_warning() -> None:
    prompt = torch.randint(3, VOCAB, (1, 500))
    with pytest.warns(UserWarning, match="context of 512"):
        out = specula.generate(llama(), prompt, specula.PromptLookup(), max_new_tokens=50, eos_token_id=[])
    assert out.sequences.shape[1] == 512


def test_one_dimensional_and_list_prompts_are_accepted() -> None:
    expected = specula.generate(llama(), PROMPT, max_new_tokens=5, eos_token_id=[]).sequences
    for prompt in (PROMPT[0], PROMPT[0].tolist(), PROMPT[0].numpy()):
        assert torch.equal(specula.generate(llama(), prompt, max_new_tokens=5, eos_token_id=[]).sequences, expected)


class _OutOfVocabulary(specula.Proposer):
    def propose(self, context_ids, max_tokens):
        return specula.Draft([VOCAB + 5])


class _NotADraft(specula.Proposer):
    def propose(self, context_ids, max_tokens):
        return [1, 2]


def test_misbehaving_proposers_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        specula.generate(llama(), PROMPT, _OutOfVocabulary(), max_new_tokens=4)
    with pytest.raises(TypeError, match="must return a specula.Draft"):
        specula.generate(llama(), PROMPT, _NotADraft(), max_new_tokens=4)


def test_draft_validation() -> None:
    with pytest.raises(ValueError, match="integer"):
        specula.Draft(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="probs"):
        specula.Draft([1, 2], probs=torch.ones(3, VOCAB))
    assert len(specula.Draft(np.array([4, 5]))) == 2 and len(specula.Draft.empty()) == 0
