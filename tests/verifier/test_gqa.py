"""Ordinary passes attend without repeating the key/value heads (over them as they are, with each one's query heads
folded into one, or by specula's kernel): the same attention as transformers' SDPA function with the heads repeated,
only where timed faster here, never in the steps of plain or exact decoding or in row-exact passes."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Oracle, hf_greedy
from tiny_models import tiny_model

import specula
from specula.machine import store, timing
from specula.verifier import gqa as gqa_module
from specula.verifier.gqa import unrepeated_kv_heads
from specula.verifier.runner import OneSequence, RaggedRows

PROMPT = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8] * 2])


@pytest.fixture(params=["unrepeated", "folded", "kernel"])
def calls(monkeypatch, request):
    """The query shapes of attention computed without repeating the key/value heads (each way in turn taken as the
    fastest; "kernel": specula's, :mod:`specula.verifier.attend`)."""
    seen = []
    grouped, attend = gqa_module._grouped, gqa_module.attend
    monkeypatch.setattr(gqa_module, "_way", lambda *args: request.param)
    monkeypatch.setattr(
        gqa_module, "_grouped", lambda way, q, *rest: seen.append(tuple(q.shape)) or grouped(way, q, *rest)
    )
    monkeypatch.setattr(gqa_module, "attend", lambda q, *rest: seen.append(tuple(q.shape)) or attend(q, *rest))
    return seen


@pytest.mark.parametrize("name", ["llama", "gemma3"])  # (gemma3: sliding-window layers, a mask per layer type)
def test_the_same_logits_as_with_repeated_heads(name, calls) -> None:
    model = tiny_model(name)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    logits = []
    for unrepeated in (False, True):
        runner = OneSequence(model, rollback=True, capacity=64, row_exact=False)
        runner.unrepeated = unrepeated
        runner.start_row(0, PROMPT[0, :20])
        logits.append(runner.forward_rows([PROMPT[0, 20:28]], [8])[0])
    assert calls and all(shape[2] == 8 for shape in calls)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-6)


def test_a_batch_of_trees_the_same_as_with_repeated_heads(calls) -> None:
    """Rows of different lengths, one a tree (every query its own mask row): each query keeps its own mask row
    when its heads are folded."""
    model = tiny_model("llama")
    logits = []
    for unrepeated in (False, True):
        runner = RaggedRows(model, rollback=True, capacity=64, row_exact=False, slots=2)
        runner.unrepeated = unrepeated
        runner.start_row(0, PROMPT[0, :20])
        runner.start_row(1, PROMPT[0, 3:14])
        logits.append(
            torch.cat(
                runner.forward_rows([PROMPT[0, 20:26], PROMPT[0, 14:18]], [6, 4], trees=[[-1, 0, 0, 1, 2, 4], None])
            )
        )
    assert calls and all(shape[:3] == (2, model.config.num_attention_heads, 6) for shape in calls)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-6)


def test_ordinary_passes_over_several_tokens_only(calls) -> None:
    model = copy.deepcopy(tiny_model("llama"))
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(
        model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False, exact=False
    )
    assert out.sequences.tolist() == expected.tolist() and out.stats.accepted > 12
    layers = model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0 and all(1 < shape[2] <= 7 for shape in calls)  # never the prefill
    seen = len(calls)
    specula.generate(model, PROMPT, None, max_new_tokens=8, eos_token_id=[])  # plain: one-token steps
    specula.generate(
        model.to(torch.bfloat16),
        PROMPT,
        Oracle(expected, 6),
        max_new_tokens=8,
        eos_token_id=[],
        adaptive_draft=False,
        exact=True,
    )
    assert len(calls) == seen


def test_left_to_transformers_where_not_faster(fresh_store, monkeypatch, tmp_path) -> None:
    """A machine where attention without repeated heads is slower either way (a fake clock charges both more) keeps
    transformers' SDPA function; the answer is kept with the calibrations."""
    now = [0.0]
    monkeypatch.setattr(timing, "CLOCK", lambda: now[0])
    grouped, attend, seen = gqa_module._grouped, gqa_module.attend, []

    def dear(way, q, *rest):
        now[0] += 1.0
        seen.append(q.shape[2])
        return grouped(way, q, *rest)

    def dear_kernel(q, *rest):
        now[0] += 1.0
        seen.append(q.shape[2])
        return attend(q, *rest)

    monkeypatch.setattr(gqa_module, "_grouped", dear)
    monkeypatch.setattr(gqa_module, "attend", dear_kernel)
    model = tiny_model("llama")
    runner = OneSequence(model, rollback=True, capacity=64, row_exact=False)
    runner.start_row(0, PROMPT[0, :20])
    runner.forward_rows([PROMPT[0, 20:28]], [8])
    timed = len(seen)
    assert timed == 3 * (timing.TIMING_REPEATS + 1)  # (the calibration's own calls: a warm-up, the timed ones)
    assert any("grouped attention" in key and value == "repeated" for key, value in store.shared().known.items())
    runner.forward_rows([PROMPT[0, 28:32]], [4])
    assert len(seen) == timed
    store.forget()


def test_the_model_attention_is_restored() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with unrepeated_kv_heads():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_one_token_steps_of_ordinary_decoding_only(calls) -> None:
    """Ordinary decoding's one-token steps attend the cheapest way too (a proposer with nothing to send: every pass
    is one); plain decoding and exact decoding keep model.generate's own steps."""
    model = copy.deepcopy(tiny_model("llama"))
    expected = hf_greedy(model, PROMPT, 12, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 0), max_new_tokens=12, eos_token_id=[], exact=False)
    assert out.sequences.tolist() == expected.tolist()
    layers = model.config.num_hidden_layers
    assert len(calls) == 11 * layers and all(shape[:3] == (1, model.config.num_attention_heads, 1) for shape in calls)
    calls.clear()
    for exact in (None, True):
        specula.generate(
            model,
            PROMPT,
            None if exact is None else Oracle(expected, 0),
            max_new_tokens=12,
            eos_token_id=[],
            exact=exact,
        )
    assert calls == []


def test_a_batchs_one_token_steps_take_the_cheapest_way_too(monkeypatch) -> None:
    """A batch's one-token steps (transformers folds them itself) attend by specula's kernel where it is the
    cheapest: the logits of transformers' own attention (fp32; mutant: the rows' keys mixed up)."""
    seen, attend = [], gqa_module.attend
    monkeypatch.setattr(gqa_module, "_way", lambda *args: "kernel")
    monkeypatch.setattr(gqa_module, "attend", lambda q, *rest: seen.append(tuple(q.shape[:3])) or attend(q, *rest))
    model = tiny_model("llama")
    logits = []
    for unrepeated in (False, True):
        runner = RaggedRows(model, rollback=True, capacity=64, row_exact=False, slots=2, cheap_steps=True)
        runner.unrepeated = unrepeated
        runner.start_row(0, PROMPT[0, :20])
        runner.start_row(1, PROMPT[0, 3:14])
        logits.append(torch.cat(runner.forward_rows([PROMPT[0, 20:21], PROMPT[0, 14:15]], [1, 1], [None, None])))
    assert seen and all(shape == (2, model.config.num_attention_heads, 1) for shape in seen)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-6, atol=1e-6)
