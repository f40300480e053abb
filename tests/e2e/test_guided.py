"""vLLM's guided decoding in request files (the default model, fp32): ``guided_choice``, ``guided_regex`` and
``guided_json`` hold the answer to one of the texts, the expression or the schema, through the same grammar as
``response_format``, ``guided_grammar`` (GBNF here) and ``structured_outputs`` likewise; ``skip_special_tokens: false``
keeps the end-of-sequence token's text; ``bad_words``, ``allowed_token_ids`` and ``truncate_prompt_tokens`` hold."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from specula import cli
from specula.hf.loading import resolve_model
from specula.hf.penalties import word_token_ids

pytestmark = pytest.mark.slow


def test_guided_answers_hold_to_their_choice_regex_and_schema(tmp_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    digits = [tokenizer.convert_tokens_to_ids(str(n)) for n in range(10)] + [tokenizer.eos_token_id]
    review = "Review: 'The battery died after two days and support never answered.'"
    lines = [
        {"id": "choice", "guided_choice": ["glowing", "mixed", "scathing"], "content": f"{review} Is it positive?"},
        {"id": "regex", "guided_regex": "[0-9]{3}-[0-9]{4}", "content": "Make up a phone number for a story."},
        {
            "id": "json",
            "guided_json": {
                "type": "object",
                "properties": {"stars": {"type": "integer"}, "fault": {"type": "string"}},
                "required": ["stars", "fault"],
                "additionalProperties": False,
            },
            "content": f"{review} Answer with a short sentence.",
        },
        {"id": "special", "skip_special_tokens": False, "content": "Say hi.", "max_tokens": 64},
        {"id": "grammar", "guided_grammar": 'root ::= ("yes" | "no") "."', "content": f"{review} Was it good?"},
        {"id": "structured", "structured_outputs": {"choice": ["glowing", "scathing"]}, "content": review},
        {"id": "free", "content": "What is the capital of France?"},
        {"id": "bad", "bad_words": ["Paris"], "content": "What is the capital of France?"},
        {"id": "allowed", "allowed_token_ids": digits, "content": "Count from one to five."},
        {"id": "cut", "truncate_prompt_tokens": 6, "content": review},
        {"id": "whole", "content": review},
    ]
    requests = [
        {"messages": [{"role": "user", "content": line.pop("content")}], "max_tokens": 40, **line} for line in lines
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in requests))
    cli.main(
        ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
        + ["--dtype", "fp32"]
    )
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    choice, regex, schema, special, grammar, structured, free, bad, allowed, cut, whole = answers
    assert choice["text"] in ("glowing", "mixed", "scathing") and choice["finish_reason"] == "stop", choice
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex["text"]), regex
    answer = json.loads(schema["text"])
    assert isinstance(answer["stars"], int) and isinstance(answer["fault"], str), schema
    assert special["finish_reason"] == "stop" and special["text"].endswith("<|im_end|>"), special
    assert grammar["text"] in ("yes.", "no."), grammar
    assert structured["text"] in ("glowing", "scathing"), structured
    assert "Paris" in free["text"] and "Paris" not in bad["text"], (free, bad)
    assert allowed["text"] and set(allowed["text"]) <= set("0123456789"), allowed
    assert cut["text"] != whole["text"], cut  # (its prompt the template's last 6 tokens: no review)


def test_bad_words_are_banned_as_a_first_word_and_after_one() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    spelt = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Paris", " Paris")]
    assert spelt[0] != spelt[1] and word_token_ids(tokenizer, ["Paris", " Paris"]) == spelt
