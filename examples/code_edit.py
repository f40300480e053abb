"""A code edit: apply a diff to a function; most of the answer is copied from the prompt.

Usage: python examples/code_edit.py [--model PATH] [--dtype auto|bf16|fp32] [--max-new-tokens 200]
"""

from __future__ import annotations

import difflib
import inspect

from common import compare, load

import specula


def main() -> None:
    model, tokenizer, args = load(__doc__)
    original = inspect.getsource(specula.core.stats.SpecStats.record_pass)
    edited = original.replace("position", "index")
    diff = "".join(difflib.unified_diff(original.splitlines(True), edited.splitlines(True), "a/stats.py", "b/stats.py"))
    messages = [
        {
            "role": "user",
            "content": f"Apply this diff to the code and write the whole new function.\n\n```python\n{original}```\n\n"
            f"```diff\n{diff}```",
        }
    ]
    answer = compare(model, tokenizer, messages, args.max_new_tokens, specula.PromptLookup())
    print(f"\n{answer}")


if __name__ == "__main__":
    main()
