"""OpenAI's ``tools`` through ``specula serve`` (a real process on 127.0.0.1, Qwen2.5-Coder-0.5B-Instruct, fp32)
and the official client: a call comes back as ``tool_calls`` with ``finish_reason: "tool_calls"``, whole or
streamed alike (no text of the call streamed as content first), and an answer without a call streams as text."""

from __future__ import annotations

import json

import pytest
from helpers import WEATHER, qwen_folder
from test_server import start_server, stop

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    process, url = start_server(qwen_folder("0.5b"), "--batch-size", "2")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    stop(process)


def ask(client, text: str, stream: bool, **settings):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": text}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=40,
        stream=stream,
        **settings,
    )


@pytest.mark.parametrize("choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_comes_back_whole_and_streamed_alike(client, choice) -> None:
    whole = ask(client, "What is the weather in Paris?", False, tool_choice=choice).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] == "Paris"
    chunks = list(ask(client, "What is the weather in Paris?", True, tool_choice=choice))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == ""
    streamed = [call for delta in deltas for call in delta.tool_calls or []]
    assert [(call.index, call.function.name, call.function.arguments) for call in streamed] == [
        (0, "get_weather", whole.message.tool_calls[0].function.arguments)
    ]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"


def test_an_answer_without_a_call_streams_as_text(client) -> None:
    whole = ask(client, "Write a haiku about autumn.", False).choices[0]
    assert whole.message.tool_calls is None and whole.message.content and whole.finish_reason != "tool_calls"
    chunks = list(ask(client, "Write a haiku about autumn.", True))
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == whole.message.content and len(pieces) > 1  # (as it was written, not at the end)
