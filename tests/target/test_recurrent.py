"""Recurrent state (Mamba-2, gated delta nets ...) rolled back within a pass; what cannot be done is refused clearly.
(Identity with model.generate over every recurrent architecture: tests/e2e/test_architectures.py.)"""

from __future__ import annotations

import pytest
import torch
from architectures import sweep_prompts, tiny_causal_lm

import specula
from specula.target.runner import CachedModel


def test_a_rollback_leaves_the_state_of_the_tokens_kept() -> None:
    model, prompt = tiny_causal_lm("qwen3_next"), sweep_prompts()[0][0]
    block = torch.tensor([7, 9, 11, 13])
    target = CachedModel(model, None, None, rollback=True)
    target.forward(prompt, 1)
    target.forward(block, 4)
    target.rollback(2)  # keeps 7, 9
    after = target.forward(torch.tensor([5]), 1)
    alone = CachedModel(model, None, None, rollback=True)
    alone.forward(torch.cat([prompt, block[:2]]), 1)
    expected = alone.forward(torch.tensor([5]), 1)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert target.cached_tokens == len(prompt) + 3


def test_a_rollback_past_the_last_pass_is_refused() -> None:
    target = CachedModel(tiny_causal_lm("mamba2"), None, None, rollback=True)
    target.forward(sweep_prompts()[0][0], 1)
    target.forward(torch.tensor([7, 9]), 2)
    with pytest.raises(specula.UnsupportedModelError, match="rolls back only within the last pass"):
        target.rollback(3)


def test_half_precision_with_row_exact_verification_is_refused_before_decoding() -> None:
    model, prompt = tiny_causal_lm("falcon_h1").to(torch.bfloat16), sweep_prompts()[0]
    with pytest.raises(specula.UnsupportedModelError, match="row_exact=False"):
        specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0)
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0, row_exact=False)
    assert out.sequences.shape[1] > prompt.shape[1]
