"""OpenAI's ``tools`` on a model whose chat template takes them (Qwen2.5-Coder-0.5B-Instruct, fp32): a required or
named call is held to the request's functions at every verified position, as ``model.generate`` holds it with the
same processor, drafts or none; request files answer with the calls read back, in either line shape; a chat that
carries a call and its result is decoded."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from helpers import WEATHER
from test_qwen_pair import qwen as qwen_pair
from transformers import LogitsProcessor, LogitsProcessorList

import specula
from specula.hf.grammar import GrammarConstraint
from specula.hf.tools import call_grammar, read_calls
from specula.jobs.decode import Answerer, Settings
from specula.jobs.requests import parse_request

pytestmark = pytest.mark.slow
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def qwen():
    return qwen_pair("0.5b")  # (one copy a process: a worker holding it and the 1.5B model takes 8 GB)


@pytest.fixture(scope="module", autouse=True)
def _released():
    """The model goes when this file's tests are done (the served tools' server loads its own next)."""
    yield
    qwen_pair.cache_clear()
    gc.collect()


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_required_call_is_held_to_the_tools_as_model_generate_holds_it(choice, drafts_cost_nothing) -> None:
    """Drafts sent whatever the CI machine's clock (drafts_cost_nothing): the cost model of a busy machine had sent
    none, and the call was held to the tools by the processor alone."""
    model, tokenizer = qwen()
    ask = [{"role": "user", "content": "Write a haiku about autumn."}]  # (unheld, it writes one: no call)
    request = parse_request({"messages": ask, "tools": [WEATHER], "tool_choice": choice}, 1)
    ids = tokenizer.apply_chat_template(
        request.messages, tools=[WEATHER], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    grammar = call_grammar(tokenizer, [WEATHER], None if choice == "required" else "get_weather")

    def held() -> LogitsProcessorList:
        return LogitsProcessorList([GrammarConstraint(tokenizer, model.config.vocab_size, grammar, ids.shape[1])])

    eos = model.generation_config.eos_token_id
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, logits_processor=held(), eos_token_id=eos
    )
    out = specula.generate(
        model, ids, specula.PromptLookup(), max_new_tokens=40, logits_processor=held(), eos_token_id=eos
    )
    assert torch.equal(out.sequences, expected) and out.stats.drafted > 0
    text = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    if choice == NAMED:  # (one call, then the end)
        content, calls = read_calls(text, {"get_weather"})
        assert content == "" and len(calls) == 1 and isinstance(calls[0].arguments["city"], str), text
    else:  # (calls until the tokens run out: the first whole)
        assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'), text


def on_skip(request, reason: str) -> None:
    raise AssertionError(f"request {request.id} skipped: {reason}")


def line_of(answered) -> int:
    return answered[0].line


def test_request_files_answer_with_the_calls_in_either_shape() -> None:
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    haiku = [{"role": "user", "content": "Write a haiku about autumn."}]
    own = [
        {"id": "auto", "messages": weather, "tools": [WEATHER]},
        {"id": "named", "messages": haiku, "tools": [WEATHER], "tool_choice": NAMED},  # (held: else a haiku)
        {"id": "none", "messages": weather, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 8},
        {
            "id": "result",
            "messages": weather
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21, "sky": "sunny"}'},
            ],
            "tools": [WEATHER],
            "max_tokens": 8,
        },
    ]
    batch = [
        {"custom_id": line["id"], "method": "POST", "url": "/v1/chat/completions", "body": without_id}
        for line in own[:2]
        for without_id in [{name: value for name, value in line.items() if name != "id"}]
    ]
    model, tokenizer = qwen()
    answerer = Answerer(
        model, tokenizer, specula.PromptLookup(), Settings(max_new_tokens=48, sampling={"do_sample": False}), on_skip
    )
    answers = {
        name: [
            answer
            for _, answer in sorted(answerer([parse_request(line, n) for n, line in enumerate(lines)]), key=line_of)
        ]
        for name, lines in (("own", own), ("batch", batch))
    }
    auto, named, none, result = answers["own"]
    for answer in (auto, named):
        assert answer["finish_reason"] == "tool_calls", answer
        (call,) = answer["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert json.loads(auto["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    assert none["finish_reason"] == "length" and "tool_calls" not in none and none["text"]
    assert result["stats"]["new_tokens"] == 8  # (a chat that goes on from a call and its result: decoded)
    for line, own_line in zip(answers["batch"], (auto, named)):
        message = line["response"]["body"]["choices"][0]["message"]
        assert message["content"] is None and line["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls"
        assert [call["function"] for call in message["tool_calls"]] == [
            call["function"] for call in own_line["tool_calls"]
        ]


class Unguided(LogitsProcessor):
    """The same mask, without the grammar's drafts (the loop finds no guide among the processors)."""

    def __init__(self, inner: GrammarConstraint) -> None:
        self.inner = inner

    def __call__(self, input_ids, scores):
        return self.inner(input_ids, scores)


def test_what_the_call_grammar_forces_is_drafted_and_accepted() -> None:
    model, tokenizer = qwen()
    ask = [{"role": "user", "content": "Is it cold in Oslo? Answer in fahrenheit."}]
    ids = tokenizer.apply_chat_template(
        ask, tools=[WEATHER], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    grammar = call_grammar(tokenizer, [WEATHER], "get_weather")
    eos = model.generation_config.eos_token_id
    runs = {}
    for name, wrap in (("guided", lambda held: held), ("unguided", Unguided)):
        held = wrap(GrammarConstraint(tokenizer, model.config.vocab_size, grammar, ids.shape[1]))
        runs[name] = specula.generate(
            model,
            ids,
            specula.PromptLookup(),
            max_new_tokens=48,
            logits_processor=LogitsProcessorList([held]),
            eos_token_id=eos,
            adaptive_draft=False,  # (every draft sent whole: what is drafted, not what the clock says pays)
        )
    assert torch.equal(runs["guided"].sequences, runs["unguided"].sequences)
    text = tokenizer.decode(runs["guided"].sequences[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'), text
    guided, unguided = runs["guided"].stats, runs["unguided"].stats
    assert guided.passes < unguided.passes and guided.accepted > unguided.accepted, (guided, unguided)
