"""OpenAI's ``tools``: what the request reader takes and refuses, the calls read back from an answer's text (and
what of it may stream first), and the answer lines that carry them. No model: the decoding is in
``tests/e2e/test_tool_calls.py``."""

from __future__ import annotations

import json

import pytest
from helpers import WEATHER
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import tiny_tokenizer

from specula.hf.tools import ToolCall, read_calls, sendable, shows_tools
from specula.jobs.line_formats import answer_line
from specula.jobs.requests import BadRequest, encode, parse_request

ASK = [{"role": "user", "content": "Weather in Paris?"}]
SHOWS = (  # a chat template that shows its tools (as Qwen2.5's does, shorter)
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "</s>{% endfor %}<s>assistant:"
)


def read(**fields):
    return parse_request({"messages": ASK, **fields}, 1)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tools": {"name": "f"}}, '"tools" must be a list'),
        ({"tools": [{"type": "function", "name": "f"}]}, '"tools"[0] must be {"type": "function", "function"'),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "1-64 letters, digits, _ or -"),
        ({"tools": [WEATHER, WEATHER]}, "each function needs its own name"),
        ({"tools": [WEATHER], "tool_choice": "always"}, '"tool_choice" must be "none", "auto", "required"'),
        ({"tool_choice": "required"}, '"tool_choice": "required" needs "tools"'),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            'names the function "get_time", which "tools" does not offer',
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, '"parallel_tool_calls" must be true or false'),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot hold one answer together"),
        ({"functions": [{"name": "f"}]}, 'older shape of "tools": give "tools"'),
    ],
)
def test_bad_tool_settings_are_bad_lines_that_say_what_is_wrong(fields, says) -> None:
    request = read(**fields)
    assert isinstance(request, BadRequest) and says in str(request), request


def test_tools_on_a_text_completion_are_refused() -> None:
    request = parse_request({"prompt": "hi", "tools": [WEATHER]}, 1)
    assert isinstance(request, BadRequest) and "chat completions field" in str(request)


def test_tool_settings_are_kept_as_they_decide_the_answer() -> None:
    assert read(tools=[WEATHER]).options == {"tools": [WEATHER]}  # (auto: the default, left out)
    assert read(tools=[WEATHER], tool_choice="none").options == {}  # (not shown to the model)
    assert read(tools=[], tool_choice="auto").options == {}
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert read(tools=[WEATHER], tool_choice=named, parallel_tool_calls=True).options == {
        "tools": [WEATHER],
        "tool_choice": named,
    }
    assert (
        read(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).options["parallel_tool_calls"] is False
    )


def test_a_chat_with_calls_and_their_results_reads_as_templates_take_it() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    request = parse_request({"messages": messages, "tools": [WEATHER]}, 1)
    assert request.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [call | {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = SHOWS
    text = tokenizer.apply_chat_template(request.messages, tools=request.options["tools"], tokenize=False)
    assert '"arguments": {"city": "Paris"}' in text  # (an object, not its JSON text quoted again)
    broken = [ASK[0], {"role": "assistant", "tool_calls": [call | {"function": {"name": "f", "arguments": "{x"}}]}]
    assert "tool_calls" in str(parse_request({"messages": broken}, 1))


def test_a_template_that_does_not_show_tools_refuses_them() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not shows_tools(tokenizer)
    with pytest.raises(ValueError, match="does not show the model its tools"):
        encode(tokenizer, read(tools=[WEATHER]))
    assert len(encode(tokenizer, read(tools=[WEATHER], tool_choice="none"))[0]) > 0
    tokenizer.chat_template = SHOWS
    assert shows_tools(tokenizer)
    assert "weather" in tokenizer.decode(encode(tokenizer, read(tools=[WEATHER]))[0])  # (its vocabulary: no "_")


NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Checking.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
            "",
            [("get_weather", {"city": "A"}), ("get_time", {"zone": "UTC"})],
        ),
        ('{"name": "get_weather", "parameters": {"city": "B"}}', "", [("get_weather", {"city": "B"})]),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
        ('```json\n{"name": "get_time", "arguments": {}}\n```', "", [("get_time", {})]),
        ('{"name": "get_date", "arguments": {}}', None, []),  # (a function it was not offered)
        ('{"name": "get_time", "arguments": [1]}', None, []),  # (arguments not an object)
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and more', None, []),  # (text after)
        ('<tool_call>{"name": "get_time", "arguments": {', None, []),  # (cut short)
        ('{"city": "Paris"}', None, []),
        ("Sunny, 21 degrees.", None, []),
    ],
)
def test_calls_are_read_only_where_every_one_is_a_call_of_an_offered_function(text, content, calls) -> None:
    got_content, got_calls = read_calls(text, NAMES)
    assert got_calls == [ToolCall(*call) for call in calls]
    assert got_content == (text if content is None else content)


PIECES = [
    "Let me check",
    " the weather.",
    "\n",
    " ",
    "<tool_call>",
    "</tool_call>",
    '{"name": "get_time", "arguments": {}}',
    "<tool",
    "{",
    "```",
    "ok",
]


@given(st.lists(st.sampled_from(PIECES), max_size=8))
def test_what_streams_first_is_always_the_start_of_the_final_content(pieces) -> None:
    text = "".join(pieces)
    final, _ = read_calls(text, NAMES)
    for end in range(len(text) + 1):
        assert final.startswith(sendable(text[:end])), (text[:end], final)


def test_answer_lines_carry_the_calls_in_each_shape() -> None:
    call = ToolCall("get_weather", {"city": "Paris"}).openai("call_1")
    assert call["function"]["arguments"] == '{"city": "Paris"}'
    choice = {"text": "", "finish_reason": "tool_calls", "logprobs": None, "tool_calls": [call]}
    own = answer_line(read(tools=[WEATHER]), [choice], 5, 9, {}, "m")
    assert own["tool_calls"] == [call] and own["finish_reason"] == "tool_calls"
    batch = parse_request(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": ASK, "tools": [WEATHER]},
        },
        1,
    )
    body = answer_line(batch, [choice], 5, 9, {}, "m")["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    json.dumps(body)
