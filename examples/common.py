"""Shared by the examples: command-line options, and running model.generate and specula side by side."""

from __future__ import annotations

import argparse
import time

import torch

import specula
from specula.hf.loading import load_model


def load(description: str, max_new_tokens: int = 200):
    """Parse the common options and load the model (default: the embedded SmolLM2-135M-Instruct)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="auto (default): what load_model picks for this machine, as the CLI does (fp32 on a CPU "
        "without BF16 instructions, else bf16)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    args = parser.parse_args()
    model, tokenizer = load_model(
        args.model, dtype={"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    )
    return model, tokenizer, args


def compare(model, tokenizer, messages: list[dict], max_new_tokens: int, proposer: specula.Proposer) -> str:
    """Greedy answer from model.generate and from specula.generate; print the speed of both and what the drafts
    did; return specula's answer."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    started = time.perf_counter()
    reference = model.generate(**prompt, do_sample=False, max_new_tokens=max_new_tokens)
    hf_seconds = time.perf_counter() - started
    out = specula.generate(model, prompt["input_ids"], proposer, max_new_tokens=max_new_tokens)
    hf_tokens = reference.shape[1] - prompt["input_ids"].shape[1]
    print(f"model.generate:   {hf_tokens} tokens in {hf_seconds:.2f}s ({hf_tokens / hf_seconds:.1f} tok/s)")
    print(f"specula.generate: {out.stats}")
    same = out.sequences.tolist() == reference.tolist()
    print(f"speedup {out.stats.tokens_per_s / (hf_tokens / hf_seconds):.2f}x; same tokens as model.generate: {same}")
    if not same and model.dtype == torch.bfloat16:
        print(
            "(in bf16 a pass over several tokens rounds differently from one-token steps, so greedy output can "
            "change after a near-tie, as with HF's own prompt lookup; --dtype fp32 gives identical tokens)"
        )
    return tokenizer.decode(out.sequences[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
