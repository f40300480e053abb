"""vLLM's guided decoding in request files (the default model, fp32): ``guided_choice``, ``guided_regex`` and
``guided_json`` hold the answer to one of the texts, the expression or the schema, through the same grammar as
``response_format``; ``skip_special_tokens: false`` keeps the end-of-sequence token's text."""

from __future__ import annotations

import json
import re

import pytest

from specula import cli

pytestmark = pytest.mark.slow


def test_guided_answers_hold_to_their_choice_regex_and_schema(tmp_path) -> None:
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
    ]
    requests = [
        {"messages": [{"role": "user", "content": line.pop("content")}], "max_tokens": 40, **line} for line in lines
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in requests))
    cli.main(
        ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
        + ["--dtype", "fp32"]
    )
    choice, regex, schema, special = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert choice["text"] in ("glowing", "mixed", "scathing") and choice["finish_reason"] == "stop", choice
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex["text"]), regex
    answer = json.loads(schema["text"])
    assert isinstance(answer["stars"], int) and isinstance(answer["fault"], str), schema
    assert special["finish_reason"] == "stop" and special["text"].endswith("<|im_end|>"), special
