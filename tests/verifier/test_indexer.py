"""Sparse attention (DeepSeek-V3.2's indexer and its kin) verified with each query's keys picked as its one-token
step picks them. (Identity with model.generate over every sparse-attention architecture:
tests/e2e/test_architectures.py.)"""

from __future__ import annotations

import pytest
import torch
from architectures import tiny_causal_lm
from helpers import Oracle, PartlyRight

import specula


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_queries_that_see_fewer_keys_than_the_indexer_picks_are_verified_exactly(model_type: str) -> None:
    """Prompts and passes shorter than the indexer's top-k (8 here): the queries of a pass pick every key they see,
    as many as that, and the pass's rows are filled up to the widest with keys they cannot see."""
    model = tiny_causal_lm(model_type)
    for prompt in ([5], [40, 41, 40]):
        prompt = torch.tensor([prompt])
        expected = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=[],
            pad_token_id=0,
        )
        for proposer in (Oracle(expected, 3), PartlyRight(expected, 3)):
            out = specula.generate(
                model, prompt, proposer, max_new_tokens=20, adaptive_draft=False, eos_token_id=[], pad_token_id=0
            )
            assert out.sequences.tolist() == expected.tolist()
            assert out.stats.accepted > 0


def test_an_indexer_specula_cannot_call_per_query_is_refused() -> None:
    model = tiny_causal_lm("deepseek_v32")
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = float(module.index_topk)  # (not an indexer specula knows)
    with pytest.raises(specula.UnsupportedModelError, match="indexer specula cannot call one query at a time"):
        specula.generate(model, torch.tensor([[5, 17, 33]]), specula.PromptLookup(), max_new_tokens=4, pad_token_id=0)
