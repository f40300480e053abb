"""Retrieval-augmented answer that quotes its context: the quotes are drafted by copying from the prompt.

The context is the opening of this project's README; the question asks for an answer with verbatim quotes.

Usage: python examples/rag_quotes.py [--model PATH] [--dtype auto|bf16|fp32] [--max-new-tokens 200]
"""

from __future__ import annotations

from pathlib import Path

from common import compare, load

import specula


def main() -> None:
    model, tokenizer, args = load(__doc__)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    context = readme[readme.index("specula makes") : readme.index("## Set up")].strip()
    messages = [
        {"role": "system", "content": "Answer from the context only. Quote the sentences you use, verbatim."},
        {
            "role": "user",
            "content": f"Context:\n{context}\n\nQuestion: What does the proposer do, and what does "
            "the model check? Quote the context.",
        },
    ]
    answer = compare(model, tokenizer, messages, args.max_new_tokens, specula.PromptLookup())
    print(f"\n{answer}")


if __name__ == "__main__":
    main()
