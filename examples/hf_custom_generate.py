"""specula inside HF's own model.generate: custom_generate=specula.custom_generate, with a streamer and stop strings.

Usage: python examples/hf_custom_generate.py [--model PATH] [--dtype auto|bf16|fp32] [--max-new-tokens 200]
"""

from __future__ import annotations

import inspect
import time

from common import load
from transformers import TextStreamer

import specula


def main() -> None:
    model, tokenizer, args = load(__doc__)
    code = inspect.getsource(specula.PromptLookup.__init__)
    messages = [
        {"role": "user", "content": f"Add a docstring to this method, keep the code as is:\n```python\n{code}```"}
    ]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, stop_strings=["```\n\n"], tokenizer=tokenizer)

    started = time.perf_counter()
    plain = model.generate(**inputs, **settings)
    plain_seconds = time.perf_counter() - started
    out = model.generate(
        **inputs,
        **settings,
        custom_generate=specula.custom_generate,
        proposer=specula.PromptLookup(),
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
        return_dict_in_generate=True,
    )
    plain_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
    print(f"\nmodel.generate:                    {plain_tokens / plain_seconds:.1f} tok/s")
    print(f"model.generate + specula (custom): {out.stats}")
    print(
        f"speedup {out.stats.tokens_per_s / (plain_tokens / plain_seconds):.2f}x; "
        f"same tokens: {out.sequences.tolist() == plain.tolist()}"
    )


if __name__ == "__main__":
    main()
