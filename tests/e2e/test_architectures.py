"""Every causal-LM architecture transformers ships, built tiny: identical to model.generate, or refused clearly.

The lists below are checked too: an architecture that starts being refused (or stops), or that can no longer be built
tiny, fails its own test, so a change is noticed and this file says why each one is refused.
"""

from __future__ import annotations

import pytest
import torch
from architectures import CAUSAL_LM_TYPES, NotTiny, sweep_prompts, tiny_causal_lm
from helpers import Oracle, PartlyRight

import specula

NEW_TOKENS = 40

_NOT_STANDARD = "not a decoder-only model with a standard KV cache"
_NO_CACHE = "takes no KV cache"

# Refused with a proposer (model type -> what the error says); plain decoding (proposer=None) is identical to
# model.generate for them unless they are in REFUSED_PLAIN too.
REFUSED = {
    "deepseek_v4": "DeepseekV4CSACache, DeepseekV4HCACache layers cannot crop what they keep",
    "moshi": "attention mask has no sliding window while its KV cache keeps one",
    "prophetnet": "fails on a pass over .* tokens after a filled KV cache \\(AssertionError",
}
# Refused even without a proposer: specula cannot decode them step by step from the cache it passes.
REFUSED_PLAIN = {
    "cpmant": "holds 60 tokens where specula expects 28",  # it adds prompt tokens of its own
    "minimax": _NOT_STANDARD,
    "openai-gpt": _NO_CACHE,
    "reformer": _NOT_STANDARD,
    "rwkv": _NOT_STANDARD,
    "xlm": _NO_CACHE,
    "xlnet": _NOT_STANDARD,
    "xlstm": _NOT_STANDARD,
}
# Their caches keep recurrent state (Mamba/SSM, linear attention, gated delta nets), rolled back by
# specula.verifier.recurrent: drafts right up to every length must be accepted (the random models rarely repeat
# themselves, so PromptLookup's drafts are mostly rejected).
RECURRENT = [
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "falcon_mamba",
    "granitemoehybrid",
    "jamba",
    "kimi_linear",
    "mamba",
    "mamba2",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "recurrent_gemma",
    "zamba",
    "zamba2",
    "zaya",
]
# Sparse attention: an indexer picks each query's keys, which specula.verifier.indexer picks per query in a pass.
SPARSE = [
    "axk2",
    "deepseek_v32",
    "dots3_note",
    "dots3_note_text",
    "glm_moe_dsa",
    "hy_v4",
    "qwen4_exp",
    "qwen4_exp_text",
]
# Cannot be built as a tiny text-only causal LM here (tests/architectures.py says why).
NOT_TINY = {"blt", "gemma3n", "gemma4_assistant", "gemma4_unified_assistant", "musicgen", "musicgen_melody"}


def _identical_or_refused(model: torch.nn.Module, make_proposer, refusal: str | None, adaptive: bool = False) -> None:
    """``adaptive=False``: every draft is verified, whatever the cost model would decide on this machine."""
    for prompt in sweep_prompts():
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS
        )
        run = lambda: specula.generate(  # noqa: E731
            model, prompt, make_proposer(), max_new_tokens=NEW_TOKENS, adaptive_draft=adaptive
        )
        if refusal is not None:
            with pytest.raises(specula.UnsupportedModelError, match=refusal):
                run()
            return
        assert run().sequences.tolist() == expected.tolist()


def _accepted_and_identical(model: torch.nn.Module) -> None:
    """Drafts of model.generate's own continuation, whole and right up to each length, every one sent."""
    for prompt in sweep_prompts():
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS
        )
        for proposer in (Oracle(expected, 6), PartlyRight(expected, 6)):
            out = specula.generate(model, prompt, proposer, max_new_tokens=NEW_TOKENS, adaptive_draft=False)
            assert out.sequences.tolist() == expected.tolist()
            assert out.stats.accepted >= out.stats.new_tokens // 3 and (out.stats.accepted < out.stats.drafted) == (
                type(proposer) is PartlyRight
            )


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_identical_to_model_generate_or_refused(model_type: str) -> None:
    if model_type in NOT_TINY:
        with pytest.raises(NotTiny):
            tiny_causal_lm(model_type)
        return
    model = tiny_causal_lm(model_type)
    _identical_or_refused(model, specula.PromptLookup, REFUSED.get(model_type, REFUSED_PLAIN.get(model_type)))
    if model_type in RECURRENT or model_type in SPARSE:
        _identical_or_refused(model, specula.PromptLookup, None, adaptive=True)
        _accepted_and_identical(model)
    if model_type in REFUSED or model_type in REFUSED_PLAIN:
        _identical_or_refused(model, lambda: None, REFUSED_PLAIN.get(model_type))


def test_the_lists_name_only_known_architectures() -> None:
    assert {*REFUSED, *REFUSED_PLAIN, *NOT_TINY} <= set(CAUSAL_LM_TYPES)
    assert not set(REFUSED) & set(REFUSED_PLAIN) and not NOT_TINY & {*REFUSED, *REFUSED_PLAIN}
    assert {*RECURRENT, *SPARSE} <= set(CAUSAL_LM_TYPES) - {*REFUSED, *REFUSED_PLAIN}
