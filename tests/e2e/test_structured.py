"""OpenAI's ``response_format`` (a JSON schema, any JSON object): the output is held to it at every verified
position, as ``model.generate`` holds it with the same processor, drafts or none; through request files it parses as
JSON of the schema; a tokenizer llguidance cannot read is a bad line that says so."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import LogitsProcessorList

import specula
from specula import cli
from specula.hf.grammar import GrammarConstraint, json_grammar
from specula.hf.loading import load_model
from specula.jobs.requests import encode

pytestmark = pytest.mark.slow
SCHEMA = {
    "type": "object",
    "properties": {"person": {"type": "string"}, "years": {"type": "integer"}, "town": {"type": "string"}},
    "required": ["person", "years", "town"],
    "additionalProperties": False,
}
ASK = "Write this as a JSON object with the keys name, age and city: Alice is 30 years old and lives in Paris."


@functools.cache
def smollm2():
    return load_model(dtype=torch.float32)


def test_the_output_is_held_to_the_schema_as_model_generate_holds_it(drafts_cost_nothing) -> None:
    """Drafts sent whatever the CI machine's clock (drafts_cost_nothing), so that they are held to the schema too."""
    model, tokenizer = smollm2()
    ids = encode(tokenizer, {"messages": [{"role": "user", "content": ASK}]})
    grammar = json_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}})

    def held() -> LogitsProcessorList:
        return LogitsProcessorList([GrammarConstraint(tokenizer, model.config.vocab_size, grammar, ids.shape[1])])

    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, logits_processor=held())
    out = specula.generate(model, ids, specula.PromptLookup(), max_new_tokens=64, logits_processor=held())
    assert torch.equal(out.sequences, expected) and out.stats.drafted > 0
    text = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    answer = json.loads(text)  # (the keys the schema names, not the request's: unheld, it writes name, age and city)
    assert set(answer) == set(SCHEMA["properties"]) and isinstance(answer["years"], int)


def test_request_lines_with_a_format_and_a_tokenizer_that_cannot_hold_one(model_folder, tmp_path, capsys) -> None:
    lines = [
        {"id": "schema", "messages": [{"role": "user", "content": ASK}], "max_tokens": 64, "temperature": 0},
        {"id": "any", "messages": [{"role": "user", "content": ASK}], "max_tokens": 64, "temperature": 0.7, "seed": 1},
    ]
    lines[0]["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    lines[1]["response_format"] = {"type": "json_object"}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cli.main(
        ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--dtype", "fp32"]
    )
    answers = {line["id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert set(json.loads(answers["schema"]["text"])) == set(SCHEMA["properties"])
    assert isinstance(json.loads(answers["any"]["text"]), dict)
    tiny = [
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "tiny.jsonl"),
        "--model",
        str(model_folder),
    ]
    with pytest.raises(SystemExit, match="every request was skipped \\(2"):  # (its tokenizer is SentencePiece-like)
        cli.main(["generate", *tiny, "--dtype", "fp32"])
    assert capsys.readouterr().err.count("tokenizer is not one llguidance reads") == 2


def test_a_schema_llguidance_cannot_compile_is_refused_saying_so() -> None:
    with pytest.raises(ValueError, match='"response_format": its schema cannot be used'):
        json_grammar({"type": "json_schema", "json_schema": {"schema": {"type": "no such type"}}})
    assert json_grammar({"type": "text"}) is None
