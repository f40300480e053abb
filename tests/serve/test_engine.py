"""The server's engine in process: a failure of the loop is told to the requests it held and the next request gets a
fresh loop; a request cancelled before it started is never decoded; closing finishes what is in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers import arena_on_cpu, hf_greedy
from tiny_models import tiny_model

import specula
from specula.serve.engine import Engine
from specula.verifier import cache_layers

PROMPT = np.array([1, 40, 3, 77, 12, 55, 23, 9, 60, 14])
NEW = 6


class FailsOn(specula.Proposer):
    """Drafts nothing, and fails for a prompt that starts with ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        if context_ids[0] == self.token:
            raise ValueError("this request breaks the proposer")
        return specula.Draft.empty()


def submit(engine: Engine, prompt: np.ndarray, cancelled: bool = False):
    """Submit a job; what its callbacks were told: (tokens, (row, error)) once it ended."""
    told: dict = {"tokens": []}
    job = specula.Job(prompt, NEW, cancelled=cancelled)
    handle = engine.submit(
        job, lambda kept, logprobs: told["tokens"].extend(kept), lambda row, error: told.setdefault("end", (row, error))
    )
    return handle, told


def test_a_failure_is_told_and_the_next_request_gets_a_fresh_loop() -> None:
    model = tiny_model("llama")
    loops = []

    def make_decoder():
        loops.append(specula.Decoder(model, FailsOn(token=5), slots=2))
        return loops[-1]

    engine = Engine(make_decoder)
    handle, told = submit(engine, np.concatenate([[5], PROMPT]))
    assert handle.done.wait(60)
    row, error = told["end"]
    assert row is None and "breaks the proposer" in str(error) and engine.failed == 1
    handle, told = submit(engine, PROMPT)
    assert handle.done.wait(60)
    row, error = told["end"]
    expected = hf_greedy(model, torch.from_numpy(PROMPT)[None], NEW, eos_token_id=[])[0, len(PROMPT) :].tolist()
    assert error is None and row.output.tolist() == told["tokens"] == expected
    assert len(loops) == 2 and engine.answered == 1 and engine.in_flight == 0
    engine.close(60)


def test_a_request_cancelled_before_it_starts_is_not_decoded_and_close_finishes_the_others() -> None:
    model = tiny_model("llama")
    engine = Engine(lambda: specula.Decoder(model, specula.PromptLookup(), slots=1))
    first, first_told = submit(engine, PROMPT)
    cancelled, cancelled_told = submit(engine, PROMPT[::-1].copy(), cancelled=True)
    engine.close(120)  # (queued after both: the first is finished, the cancelled one dropped)
    assert first.done.is_set() and cancelled.done.is_set()
    assert first_told["end"][1] is None and len(first_told["tokens"]) == NEW
    assert cancelled_told == {"tokens": [], "end": (None, None)}
    assert (engine.answered, engine.cancelled, engine.in_flight) == (1, 1, 0)


def test_the_first_loop_is_made_before_the_engine_takes_requests() -> None:
    """A server is up only once its loop is measured (``make_decoder`` prepares it), so its first requests do not
    wait for the measuring (the mutant making it in the engine's thread fails)."""
    model, made = tiny_model("llama"), []

    def make_decoder():
        time.sleep(0.5)  # (measuring takes a while)
        made.append(specula.Decoder(model, specula.PromptLookup()).prepare())
        return made[-1]

    engine = Engine(make_decoder)
    assert len(made) == 1 and made[0].policy is not None
    handle, told = submit(engine, PROMPT)
    assert handle.done.wait(60) and told["end"][1] is None and len(made) == 1
    engine.close(60)


def test_concurrent_requests_share_compiled_passes_inside_the_row_buckets(monkeypatch) -> None:
    """Continuous batching with compiled passes (dynamo's graphs, 3 slots: buckets of 1, 2 and 3 rows): requests
    joining and leaving as they come each get model.generate's tokens."""
    monkeypatch.setattr(specula.verifier.static, "BACKEND", "eager")
    torch._dynamo.reset()
    model = tiny_model("llama")
    engine = Engine(lambda: specula.Decoder(model, specula.PromptLookup(), slots=3, compile=True).prepare())
    prompts = [np.roll(PROMPT, shift) for shift in range(5)]
    submitted = [submit(engine, prompt) for prompt in prompts]
    engine.close(120)
    for prompt, (handle, told) in zip(prompts, submitted):
        expected = hf_greedy(model, torch.from_numpy(prompt)[None], NEW, eos_token_id=[])[0, len(prompt) :].tolist()
        assert handle.done.is_set() and told["end"][1] is None and told["tokens"] == expected
        assert told["end"][0].stats.compiled
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["paged", "rectangle", "arena"])
def test_an_idle_engine_gives_its_cache_back(monkeypatch, kind) -> None:
    """Once every request ended and none waits, the loop's cache gives its memory back before the engine waits for
    more: paged (the CPU's), every page; a rectangle, down to one row of the room it was first asked for (mutant: the
    rows of the last batch kept until the next request comes)."""
    paged = kind != "rectangle"
    if kind == "rectangle":
        monkeypatch.setattr(cache_layers, "PAGED", ())
    if kind == "arena":  # (a GPU's, here over the CPU's pages)
        arena_on_cpu(monkeypatch)
    model, loops = tiny_model("llama"), []

    def make_decoder():
        loops.append(specula.Decoder(model, specula.PromptLookup(), slots=4))
        return loops[-1]

    engine = Engine(make_decoder)
    long = np.tile(PROMPT, 40)  # (400 tokens)
    handles = [submit(engine, np.roll(long, shift))[0] for shift in range(3)]
    assert all(handle.done.wait(60) for handle in handles)
    layer = loops[0]._target.cache.layers[0]

    def released() -> bool:
        return layer.held_bytes() == 0 if paged else len(layer._key_buffer) == 1

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not released():
        time.sleep(0.05)
    assert released() and (paged or layer.capacity == loops[0]._target.capacity)
    engine.close(60)
