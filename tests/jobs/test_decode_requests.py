"""specula generate's Answerer (specula.jobs.decode): a measured batch size is measured again during a run, and a
change of size loses and repeats no request."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

import specula
from specula.jobs import decode as decode_module
from specula.jobs.decode import Answerer, Settings, jobs_of
from specula.jobs.requests import parse_request
from specula.machine import store
from specula.policy import batch_size as batch_size_module


@pytest.mark.parametrize("remeasure", [True, False])
def test_a_measured_batch_size_is_measured_again_during_a_run(fresh_store, monkeypatch, remeasure: bool) -> None:
    """The machine was busy when the size was measured and kept (1 measured fastest), quiet later (4): after every 3
    requests the size is measured again, and the rest run in batches of 4. Each request is answered once."""
    sizes, built = iter([1, 4, 4, 4]), []
    measured = []

    def fastest(model, largest, again=False):
        measured.append(again)
        return next(sizes) if remeasure or not again else 1

    class Recording(specula.Decoder):
        def __init__(self, model, proposer, slots, **kwargs):
            built.append(slots)
            super().__init__(model, proposer, slots, **kwargs)

    monkeypatch.setattr(
        batch_size_module, "fastest_batch_size", lambda model, largest, again=False: fastest(model, largest)
    )
    monkeypatch.setattr(decode_module, "fastest_batch_size", fastest)
    monkeypatch.setattr(decode_module, "Decoder", Recording)
    monkeypatch.setattr(decode_module, "REMEASURE", 3)
    answerer = Answerer(
        tiny_model("llama"),
        tiny_tokenizer(),
        specula.PromptLookup(),
        Settings(max_new_tokens=6),
        on_skip=lambda number, reason: None,
    )
    requests = [
        parse_request({"id": f"r{n}", "prompt": f"the quick brown fox {n} jumps over the lazy dog {n}"}, n)
        for n in range(10)
    ]
    answers = list(answerer(requests, largest=8))
    assert sorted((request.line, answer["id"]) for request, answer in answers) == [(n, f"r{n}") for n in range(10)]
    assert measured[0] is False and all(measured[1:]) and len(measured) == 4  # at start, then after 3, 6, 9
    assert built == ([1, 4] if remeasure else [1]) and answerer.slots == (4 if remeasure else 1)


def test_a_batch_size_given_is_never_measured(monkeypatch) -> None:
    monkeypatch.setattr(decode_module, "fastest_batch_size", lambda *args, **kwargs: pytest.fail("measured"))
    monkeypatch.setattr(decode_module, "REMEASURE", 1)
    answerer = Answerer(
        tiny_model("llama"),
        tiny_tokenizer(),
        None,
        Settings(max_new_tokens=4, batch_size=2),
        on_skip=lambda number, reason: None,
    )
    assert len(list(answerer([parse_request({"prompt": f"hello {n}"}, n) for n in range(5)]))) == 5


@pytest.mark.parametrize("dtype, exact", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, None)])
def test_the_batch_size_is_measured_once_and_kept(fresh_store, monkeypatch, tmp_path, dtype, exact) -> None:
    """A first run measures size 2 (the machine busy), a later process would measure 4 (quiet): every run takes the
    kept 2 (a file of a few requests does not wait for a measurement each run; in ordinary bf16, where rows round by
    the size of their pass, every run answers alike: the mutant measuring per run fails)."""
    sizes = iter([2, 4, 4, 4])
    monkeypatch.setattr(batch_size_module, "fastest_batch_size", lambda model, largest, **kwargs: next(sizes))
    monkeypatch.setattr(decode_module, "fastest_batch_size", lambda model, largest, **kwargs: next(sizes))
    requests = [
        parse_request({"id": n, "prompt": f"the quick brown fox {n} jumps over the lazy dog"}, n) for n in range(4)
    ]
    runs = []
    for _ in range(2):  # (the second as a new process: the calibrations from the file)
        store.forget()
        model = tiny_model("llama").to(dtype)
        answerer = Answerer(
            model,
            tiny_tokenizer(),
            specula.PromptLookup(),
            Settings(max_new_tokens=6, exact=exact),
            on_skip=lambda request, reason: None,
        )
        runs.append(
            (
                [answer["text"] for _, answer in sorted(answerer(requests), key=lambda item: item[0].line)],
                answerer.slots,
            )
        )
    assert [slots for _, slots in runs] == [2, 2] and runs[0][0] == runs[1][0]
    store.forget()


def test_without_a_length_a_request_decodes_to_the_end_of_the_context(monkeypatch) -> None:
    """``max_new_tokens=None`` (the server's default, OpenAI's): each request of a batch runs to the model's context,
    not to its generation config's length (a request that gives ``max_tokens`` keeps it), its cache growing past the
    room it first had, and its tokens are
    ``model.generate``'s (greedy, fp32)."""
    from specula.decoding import loop

    monkeypatch.setattr(loop, "FIRST_ROOM", 4)
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    model.config.max_position_embeddings = 256
    model.generation_config.eos_token_id = None
    model.generation_config.max_length = 30  # (not what a server's request is held to)
    requests = [
        parse_request({"id": n, "prompt": f"the quick brown fox {n} jumps over the lazy dog"}, n) for n in range(3)
    ] + [parse_request({"id": 3, "prompt": "print hello world", "max_tokens": 5}, 3)]
    answerer = Answerer(
        model,
        tokenizer,
        specula.PromptLookup(),
        Settings(max_new_tokens=None, batch_size=2),
        on_skip=lambda request, reason: pytest.fail(reason),
    )
    answers = {request.line: answer for request, answer in answerer(requests)}
    assert sorted(answers) == [0, 1, 2, 3]
    for request in requests:
        ids = tokenizer(request.prompt, return_tensors="pt")["input_ids"]
        new = 5 if request.id == 3 else 256 - ids.shape[1]
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        answer = answers[request.line]
        assert answer["stats"]["new_tokens"] == new
        assert answer["text"] == tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
        assert answer["finish_reason"] == "length"
    # (a draining batch takes those bound by the context alone to end last: specula.decoding.loop._left)
    assert [job.open_ended for r in requests for job in jobs_of(model, tokenizer, r, answerer.settings)] == [
        True,
        True,
        True,
        False,
    ]
