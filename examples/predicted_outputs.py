"""Predicted outputs where the answer is a close edit of a text the prompt does not hold: explain a function that
changed a little between two releases of a package, with the answer to its previous release as the prediction (as a
pipeline that documents every release has it).

The functions: ``examples/workloads/release_edits.jsonl`` (``packaging`` 24.0 -> 25.0, built by
``examples/build_release_edits.py``, which says where they come from). For each, the model first answers about the
old source (greedy: the previous release's answer, untimed), then the bench times the question about the new source:
``model.generate``, HF's prompt lookup, specula with prompt lookup, and specula with the previous answer as the
prediction, with prompt lookup (``specula-prompt-lookup+prediction``) and alone (``specula-none+prediction``).
The table adds how many prediction tokens were verified and kept or rejected.

``--one-place-edit`` measures the mechanism where the prediction is nearly right: the prediction is then the
model's own answer about the new source with 8 tokens in its middle replaced by the previous answer's tokens at that
place (an edit of one place), as a pipeline whose last answer differs from this one in one place has it.

``--write DIR`` also writes the workload with its predictions (``DIR/release_edits.jsonl``: ``messages`` and
``prediction``), for ``specula bench --workloads DIR``.

Usage: python examples/predicted_outputs.py [--model PATH] [--dtype auto|bf16|fp32] [--limit 8] [--repeats 1]
       [--max-new-tokens 128] [--one-place-edit] [--write DIR]
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import torch

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import encode, parse_request
from specula.tools.bench import format_table, hf_method, run_bench, specula_method

FUNCTIONS = Path(__file__).resolve().parent / "workloads" / "release_edits.jsonl"
TASK = "Explain what this Python function does."


def messages(source: str) -> list[dict]:
    return [{"role": "user", "content": f"{TASK}\n\n```python\n{textwrap.dedent(source)}```"}]


def answer(model, tokenizer, source: str, max_new_tokens: int) -> list[int]:
    """The model's greedy answer about ``source`` (untimed)."""
    prompt = encode(tokenizer, {"messages": messages(source)})
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=max_new_tokens)
    return out.sequences[0, prompt.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--limit", type=int, default=8, help="functions (of 44)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--one-place-edit",
        action="store_true",
        help="predict this answer with one place edited, not the previous release's answer",
    )
    parser.add_argument("--write", type=Path, default=None, help="also write the workload with its predictions here")
    args = parser.parse_args()
    model, tokenizer = load_model(
        args.model, dtype={"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    )
    rows = []
    for function in map(json.loads, FUNCTIONS.read_text().splitlines()[: args.limit]):
        previous = answer(model, tokenizer, function["old"], args.max_new_tokens)
        if args.one_place_edit:
            now = answer(model, tokenizer, function["new"], args.max_new_tokens)
            middle = len(now) // 2
            previous = now[:middle] + previous[middle : middle + 8] + now[middle + 8 :]
        text = tokenizer.decode(previous, skip_special_tokens=True)
        rows.append(
            parse_request(
                {"id": function["id"], "messages": messages(function["new"]), "prediction": text}, len(rows) + 1
            )
        )
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        (args.write / "release_edits.jsonl").write_text("".join(json.dumps(row.data) + "\n" for row in rows))
    methods = {
        "hf-greedy": hf_method(model),
        "hf-prompt-lookup": hf_method(model, prompt_lookup_num_tokens=10),
        "specula-prompt-lookup": specula_method(model, specula.PromptLookup),
        "specula-prompt-lookup+prediction": specula_method(model, specula.PromptLookup, predicted_with=tokenizer),
        "specula-none+prediction": specula_method(model, lambda: None, predicted_with=tokenizer),
    }
    table = run_bench(methods, tokenizer, {"release_edits": rows}, args.max_new_tokens, args.repeats)
    print(
        f"{args.model or 'SmolLM2-135M-Instruct'}, {model.dtype}, {len(rows)} functions, {args.max_new_tokens} new "
        f"tokens, median of {args.repeats}; speedup vs hf-greedy"
    )
    print(format_table(table))


if __name__ == "__main__":
    main()
