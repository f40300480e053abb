"""A randomly initialised model of an architecture no small real model ships for, some millions of parameters, to
time specula on: recurrent state (Qwen3-Next, Mamba-2, Mamba) or sparse attention (DeepSeek-V3.2).

No real small model with recurrent state or sparse attention ships inside a PyPI package (searched 2026-11-25: Mamba,
Mamba-2, Falcon-H1, Granite-4, Qwen3.5, Zamba, LFM2, DeepSeek-V3.2 ...), so this builds one of these architectures at
a chosen size with random weights and SmolLM2-135M-Instruct's tokenizer, and saves it where ``specula bench --model``
loads it. Random weights decode text nobody would read, so acceptance says little; what such a run measures is what
a step costs with the state kept (or the keys picked per query), and whether the cost model keeps specula at least as
fast as ``model.generate``.

Usage: python examples/random_model.py OUT [--model-type qwen3_next|mamba2|mamba|deepseek_v32] [--hidden 512]
       [--layers 8]
       specula bench --model OUT --dtype fp32 --workloads ../shared/workloads --proposers prompt-lookup --no-oracle
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specula.hf.loading import resolve_model


def config(model_type: str, hidden: int, layers: int, vocab_size: int, eos: int):
    """A config of ``model_type`` at the given width and depth (heads of 64 dimensions)."""
    heads = hidden // 64
    sizes = {
        "qwen3_next": dict(
            intermediate_size=4 * hidden,
            num_attention_heads=heads,
            num_key_value_heads=max(heads // 4, 1),
            head_dim=64,
            linear_num_key_heads=heads,
            linear_num_value_heads=heads,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
        ),
        "mamba2": dict(
            num_heads=2 * heads, head_dim=64, state_size=64, n_groups=1, time_step_rank=hidden // 16, chunk_size=64
        ),
        "mamba": dict(state_size=16, expand=2, time_step_rank=hidden // 16),
        # DeepSeek-V3.2 picks 2048 keys per query (of contexts up to 128K); 256 here, so that the picking matters on
        # the public workloads' prompts of some hundred tokens
        "deepseek_v32": dict(
            intermediate_size=4 * hidden,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            q_lora_rank=hidden // 2,
            kv_lora_rank=hidden // 4,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=64,
            index_n_heads=heads,
            index_head_dim=64,
            index_topk=256,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=hidden,
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        ),
    }[model_type]
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=True,
        **sizes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model-type", choices=["qwen3_next", "mamba2", "mamba", "deepseek_v32"], default="qwen3_next")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config(args.model_type, args.hidden, args.layers, len(tokenizer), tokenizer.eos_token_id)
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{args.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
