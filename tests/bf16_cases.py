"""bf16 models big enough for their kernels' blocking to depend on the number of rows, a prompt with repeats, and
model.generate's greedy output for them: what the row-exact and drift tests compare with."""

from __future__ import annotations

import functools

import torch
import transformers
from helpers import hf_greedy

VOCAB = 512
# Big enough for the kernels' blocking to depend on the number of rows (inner dimensions of 1536, heads of 64, a
# few hundred keys), small enough to decode a few hundred tokens in seconds.
_SHAPE = dict(
    hidden_size=256,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, **_SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, **_SHAPE),
    "gpt2": lambda: transformers.GPT2Config(**_COMMON, n_embd=256, n_inner=1536, n_layer=2, n_head=4, n_positions=2048),
    # past its window: the prompt alone is longer than the sliding window
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON, **_SHAPE, head_dim=64, sliding_window=96, layer_types=["sliding_attention", "full_attention"]
    ),
}
PROMPT_LENGTH, NEW_TOKENS = 300, 48
WIDE = 32  # passes this wide round differently on every model here (8 is often not enough)


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
