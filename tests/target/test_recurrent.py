"""Recurrent state (Mamba, gated delta nets ...) rolled back within a pass, by feeding the kept tokens again or from the
states a step-by-step pass kept; what cannot be done is refused clearly. (Identity with model.generate over every
recurrent architecture: tests/e2e/test_architectures.py.)"""

from __future__ import annotations

import pytest
import torch
from architectures import sweep_prompts, tiny_causal_lm
from helpers import Oracle, PartlyRight

import specula
from specula.target.runner import CachedModel


# qwen3_next: fed again; mamba and recurrent_gemma (states on its modules): step by step
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba", "recurrent_gemma"])
def test_a_rollback_leaves_the_state_of_the_tokens_kept(model_type: str) -> None:
    model, prompt = tiny_causal_lm(model_type), sweep_prompts()[0][0]
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


@pytest.mark.parametrize("model_type", ["mamba2", "zamba"])
def test_a_rollback_past_the_last_pass_is_refused(model_type: str) -> None:
    target = CachedModel(tiny_causal_lm(model_type), None, None, rollback=True)
    target.forward(sweep_prompts()[0][0], 1)
    target.forward(torch.tensor([7, 9]), 2)
    with pytest.raises(specula.UnsupportedModelError, match="rolls back only within the last pass"):
        target.rollback(3)


def test_half_precision_recurrent_layers_are_verified_as_one_token_steps_compute_them() -> None:
    """bf16: Mamba-2's chunked scan over several tokens rounds otherwise than its one-token step, which changes greedy
    output on these tiny models unless row-exact verification computes the recurrent layers step by step."""
    ordinary_differs = False
    for model_type in ("mamba2", "granitemoehybrid", "bamba"):
        model = tiny_causal_lm(model_type).to(torch.bfloat16)
        for prompt in sweep_prompts():
            expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=40).tolist()
            for proposer in (Oracle(torch.tensor(expected), 6), PartlyRight(torch.tensor(expected), 6)):
                run = lambda row_exact: specula.generate(  # noqa: E731
                    model, prompt, proposer, max_new_tokens=40, adaptive_draft=False, pad_token_id=0,
                    row_exact=row_exact).sequences.tolist()
                assert run(None) == expected
                ordinary_differs |= run(False) != expected
    assert ordinary_differs  # (else this test could not fail)


def test_half_precision_with_row_exact_verification_is_refused_where_layers_cannot_be_stepped() -> None:
    model, prompt = tiny_causal_lm("zaya").to(torch.bfloat16), sweep_prompts()[0]
    with pytest.raises(specula.UnsupportedModelError, match="row_exact=False"):
        specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0)
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0, row_exact=False)
    assert out.sequences.shape[1] > prompt.shape[1]
