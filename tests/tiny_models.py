"""Tiny randomly initialised HF causal LMs, one per architecture family the verifier must support."""

from __future__ import annotations

import torch
import transformers

VOCAB = 96

_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, **_LLAMA_LIKE),
    "gpt2": lambda: transformers.GPT2Config(**_COMMON, n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, **_LLAMA_LIKE),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **_COMMON,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    ),
    # A sliding window shorter than the test prompts, so rollback happens past the window.
    "mistral": lambda: transformers.MistralConfig(**_COMMON, **_LLAMA_LIKE, sliding_window=12),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, **_LLAMA_LIKE),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON,
        **_LLAMA_LIKE,
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
ARCHITECTURES = sorted(CONFIGS)

# a minimal chat template for tiny tokenizers
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant:"


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of one architecture, fp32, eval mode, deterministic weights."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_tokenizer():
    """A real BPE tokenizer (Metaspace, like SentencePiece models) with exactly VOCAB tokens, for the tiny models."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    text = [
        "the quick brown fox jumps over the lazy dog",
        "print hello world",
        "def foo(bar, baz): return bar + baz",
        "stop here please",
        "speculative decoding verifies drafts in one pass",
        "JSON keys and values, 0123456789",
    ] * 10
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.train_from_iterator(text, trainer)
    assert tokenizer.get_vocab_size() == VOCAB
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
