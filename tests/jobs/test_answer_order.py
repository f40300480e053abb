"""specula generate writes answers in the order of their requests' lines, though requests decoded in the same passes
finish in another order; a stopped run still writes every answer it made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy

from specula import cli
from specula.hf import loading
from specula.jobs import decode as decode_module
from specula.jobs.answer_file import AnswerFile, InputOrder, Tally

PROMPTS = [
    "alpha beta gamma delta alpha beta",
    "print hello world print",
    "def foo(bar, baz): return bar",
    "the quick brown fox jumps",
    "one two three four",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def early_end(model_folder, tmp_path_factory) -> Path:
    """The tiny model, saved with an end-of-sequence token that the third prompt reaches at its second new token
    (and the first two prompts never within NEW_TOKENS): in a batch of three, the third request ends first."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)
    greedy = [
        hf_greedy(model, tokenizer(p, return_tensors="pt").input_ids, NEW_TOKENS)[0, -NEW_TOKENS:].tolist()
        for p in PROMPTS
    ]
    eos = next(token for token in greedy[2][1:] if token not in greedy[0] + greedy[1] and token != greedy[2][0])
    model.generation_config.eos_token_id = eos
    folder = tmp_path_factory.mktemp("early-end")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_answers_are_written_in_input_order_though_they_finish_out_of_it(early_end, tmp_path, monkeypatch) -> None:
    finished = []  # line numbers in the order the answerer gives them
    call = decode_module.Answerer.__call__

    def recording(self, requests, **kwargs):
        for request, answer in call(self, requests, **kwargs):
            finished.append(request.line)
            yield request, answer

    monkeypatch.setattr(decode_module.Answerer, "__call__", recording)
    lines = [json.dumps({"id": f"r{n}", "prompt": p}) for n, p in enumerate(PROMPTS)]
    lines.insert(3, "not a request")  # a skipped line between them
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    run = [
        "generate",
        "--input",
        tmp_path / "in.jsonl",
        "--model",
        early_end,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        NEW_TOKENS,
        "--temperature",
        0,
    ]
    cli.main([str(arg) for arg in run + ["--output", tmp_path / "b3.jsonl", "--batch-size", 3]])
    assert finished != sorted(finished), "the requests did not finish out of order: the test proves nothing"
    written = [json.loads(line) for line in (tmp_path / "b3.jsonl").read_text().splitlines()]
    assert [answer["id"] for answer in written] == [f"r{n}" for n in range(len(PROMPTS))]
    cli.main([str(arg) for arg in run + ["--output", tmp_path / "b1.jsonl", "--batch-size", 1]])
    assert (tmp_path / "b1.jsonl").read_text().count("\n") == len(PROMPTS)
    alone = [json.loads(line)["text"] for line in (tmp_path / "b1.jsonl").read_text().splitlines()]
    assert [answer["text"] for answer in written] == alone


def test_input_order_waits_for_earlier_lines_and_writes_the_rest_when_stopped(tmp_path) -> None:
    output, tally = AnswerFile(tmp_path / "out.jsonl"), Tally()

    def answer(n: int) -> dict:
        return {"id": n, "text": "", "stats": {"new_tokens": n, "passes": n}}

    def ids() -> list[int]:
        output.file.flush()
        return [json.loads(line)["id"] for line in output.path.read_text().splitlines()]

    with output, InputOrder(output, tally) as order:
        for number in (1, 2, 3, 5, 6):
            order.expect(number)
        order.settle(3, answer(3))
        assert output.file is None  # nothing written: 1 and 2 are still running
        order.settle(1, answer(1))
        assert ids() == [1]
        order.settle(2, None)  # skipped
        assert ids() == [1, 3]
        order.settle(6, answer(6))  # stopped here: 5 never ends
        assert ids() == [1, 3]
    assert [json.loads(line)["id"] for line in output.path.read_text().splitlines()] == [1, 3, 6]
    assert tally.answered == 3 and tally.new_tokens == 10


def test_the_summary_counts_tokens_per_pass_per_request() -> None:
    """Plain decoding makes one token a request a pass; what drafts gave is what the summary's figure is above 1."""
    tally = Tally()
    tally.add({"new_tokens": 10, "passes": 4})
    tally.add({"new_tokens": 6, "passes": 6})
    summary = tally.summary(batch_sizes=[2])
    assert summary["tokens_per_pass_per_request"] == 1.6 and summary["requests"] == 2
    assert summary["new_tokens"] == 16 and summary["batch_sizes"] == [2]
