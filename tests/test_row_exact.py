"""Half precision: verification passes compute every position as a one-token step does, so greedy output is
model.generate's in bf16 and fp16 too, whatever the drafts and draft lengths (specula.row_exact)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from helpers import AlwaysWrong, Oracle, hf_greedy

import specula

VOCAB = 512
# Big enough for the kernels' blocking to depend on the number of rows (inner dimensions of 1536, heads of 64, a
# few hundred keys), small enough to decode a few hundred tokens in seconds.
_SHAPE = dict(hidden_size=256, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, **_SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, **_SHAPE),
    "gpt2": lambda: transformers.GPT2Config(**_COMMON, n_embd=256, n_inner=1536, n_layer=2, n_head=4,
                                            n_positions=2048),
    # past its window: the prompt alone is longer than the sliding window
    "gemma3": lambda: transformers.Gemma3TextConfig(**_COMMON, **_SHAPE, head_dim=64, sliding_window=96,
                                                    layer_types=["sliding_attention", "full_attention"]),
}
PROMPT_LENGTH, NEW_TOKENS = 300, 48


@functools.cache
def model(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype).eval()


@functools.cache
def prompt() -> torch.Tensor:
    """Random text with repeats in it, so that PromptLookup finds drafts."""
    generator = torch.Generator().manual_seed(1)
    words = torch.randint(3, VOCAB, (40,), generator=generator)
    picks = torch.randint(0, 36, (PROMPT_LENGTH // 4,), generator=generator)
    return torch.cat([words[i : i + 4] for i in picks.tolist()])[None]


@functools.cache
def reference(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return hf_greedy(model(name, dtype), prompt(), NEW_TOKENS, eos_token_id=[])


def speculate(name: str, proposer, dtype: torch.dtype = torch.bfloat16, **kwargs) -> specula.GenerateOutput:
    return specula.generate(model(name, dtype), prompt(), proposer, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                            **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("adaptive_draft", [True, False])
def test_bf16_identical_to_model_generate(name: str, adaptive_draft: bool) -> None:
    ref = reference(name).tolist()
    for proposer in (specula.PromptLookup(), Oracle(reference(name), 7), AlwaysWrong(reference(name), 7, VOCAB)):
        out = speculate(name, proposer, adaptive_draft=adaptive_draft)
        assert out.sequences.tolist() == ref, type(proposer).__name__
        if type(proposer) is Oracle and not adaptive_draft:  # (the cost model may find drafts do not pay here)
            assert out.stats.accepted > NEW_TOKENS // 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_without_row_exact_verification_passes_round_differently(name: str) -> None:
    """The mutant: passes computed the ordinary way give other bits, and here other tokens."""
    out = speculate(name, Oracle(reference(name), 7), adaptive_draft=False, row_exact=False)
    assert out.sequences.tolist() != reference(name).tolist()


def test_fp16_identical_to_model_generate() -> None:
    ref = reference("llama", torch.float16)
    out = speculate("llama", Oracle(ref, 7), dtype=torch.float16, adaptive_draft=False)
    assert out.sequences.tolist() == ref.tolist()
