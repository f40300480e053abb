"""Retrieval-augmented answer that quotes its context: the quotes are drafted by copying from the prompt.

The context is a part of this project's README; the question asks for an answer with verbatim quotes.

Usage: python examples/rag_quotes.py [--model PATH] [--dtype bf16|fp32] [--max-new-tokens 200]
"""

from __future__ import annotations

from pathlib import Path

from common import compare, load

import specula


def main() -> None:
    model, tokenizer, args = load(__doc__)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    context = readme[readme.index("### Proposers") : readme.index("Write your own")]
    messages = [
        {"role": "system", "content": "Answer from the context only. Quote the sentences you use, verbatim."},
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: Which proposers does specula have, and how "
                                    "does each one guess the next tokens? Quote the context."},
    ]
    answer = compare(model, tokenizer, messages, args.max_new_tokens, specula.PromptLookup())
    print(f"\n{answer}")


if __name__ == "__main__":
    main()
