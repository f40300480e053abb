"""vLLM's names for what OpenAI's API lacks (``vllm run-batch`` reads the same files): what the request reader takes,
what it refuses, and what the chat template is given. Their decoding: ``tests/jobs/test_request_settings.py``
(``min_p``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``) and ``tests/e2e/test_guided.py``."""

from __future__ import annotations

import json
import re

import pytest
from tiny_models import tiny_tokenizer

from specula.jobs.requests import BadRequest, encode, parse_request

ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"min_p": 2}, '"min_p" must be a number from 0 to 1'),
        ({"stop_token_ids": [1, -2]}, '"stop_token_ids" must be a list of token ids'),
        ({"ignore_eos": "yes"}, '"ignore_eos" must be true or false'),
        ({"skip_special_tokens": 0}, '"skip_special_tokens" must be true or false'),
        ({"chat_template_kwargs": {"tools": []}}, '"chat_template_kwargs" must be an object of the template'),
        ({"chat_template_kwargs": [1]}, '"chat_template_kwargs" must be an object of the template'),
        ({"continue_final_message": True}, 'give "add_generation_prompt": false'),
        ({"guided_choice": []}, '"guided_choice" must be a non-empty list of texts'),
        ({"guided_json": "{x"}, '"guided_json" must be a JSON schema'),
        ({"guided_regex": 5}, '"guided_regex" must be a regular expression'),
        ({"guided_regex": "a+", "guided_choice": ["b"]}, '"guided_regex" and "guided_choice" cannot hold one answer'),
        ({"guided_json": {}, "response_format": {"type": "json_object"}}, "cannot hold one answer together"),
        ({"use_beam_search": True}, '"use_beam_search": true cannot be honoured: specula does not search beams'),
        ({"bad_words": ["x"]}, '"bad_words": \\["x"\\] cannot be honoured'),
        ({"chat_template": "{{ x }}"}, "specula uses the model's own chat template"),
    ],
)
def test_bad_vllm_settings_are_bad_lines_that_say_what_is_wrong(fields, says) -> None:
    request = parse_request({"messages": ASK, **fields}, 1)
    assert isinstance(request, BadRequest), request
    assert re.search(says, str(request)), str(request)


def test_a_text_completion_has_no_template_settings() -> None:
    request = parse_request({"prompt": "hi", "chat_template_kwargs": {"x": 1}}, 1)
    assert isinstance(request, BadRequest) and "are a chat's" in str(request)


def test_settings_at_their_default_are_left_out_and_guided_json_is_a_response_format() -> None:
    defaults = {"ignore_eos": False, "skip_special_tokens": True, "min_p": 0, "stop_token_ids": [], "priority": 3}
    assert parse_request({"messages": ASK, **defaults}, 1).options == {}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for given in (schema, json.dumps(schema)):
        assert parse_request({"messages": ASK, "guided_json": given}, 1).options == {
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}
        }


def test_the_template_is_given_its_own_variables_and_may_go_on_with_the_last_message() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>{% if brief %}b {% endif %}{% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]

    def text(**fields) -> str:
        return tokenizer.decode(encode(tokenizer, parse_request({"messages": chat, **fields}, 1))[0])

    assert text() == "<s> hi</s><s> the</s><s>"
    assert text(chat_template_kwargs={"brief": True}) == "<s> hi</s><s> the</s><s> b "
    assert text(add_generation_prompt=False, continue_final_message=True) == "<s> hi</s><s> the"
