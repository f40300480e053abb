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
        ({"guided_grammar": 3}, '"guided_grammar" must be a grammar'),
        ({"guided_grammar": "start: x", "guided_regex": "a"}, '"guided_regex" and "guided_grammar" cannot hold'),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, 'holds one of "regex" and "choice": give one'),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, '"structured_outputs" and "guided_regex" cannot'),
        ({"structured_outputs": {"structural_tag": "{}"}}, '"structural_tag": "{}" cannot be honoured'),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "takes any white space"),
        ({"structured_outputs": {"jsn": {}}}, '"structured_outputs" must be an object of one of "json"'),
        ({"structured_outputs": {"json_object": 1}}, '"json_object" must be true or false'),
        ({"allowed_token_ids": []}, '"allowed_token_ids" must be a non-empty list of token ids'),
        ({"allowed_token_ids": [1, True]}, '"allowed_token_ids" must be a non-empty list of token ids'),
        ({"bad_words": "x"}, '"bad_words" must be a list of words'),
        ({"bad_words": [" "]}, '"bad_words" must be a list of words'),
        ({"truncate_prompt_tokens": 0}, '"truncate_prompt_tokens" must be a whole number >= 1'),
        ({"chat_template": "{{ x }}"}, "specula uses the model's own chat template"),
    ],
)
def test_bad_vllm_settings_are_bad_lines_that_say_what_is_wrong(fields, says) -> None:
    request = parse_request({"messages": ASK, **fields}, 1)
    assert isinstance(request, BadRequest), request
    assert re.search(says, str(request)), str(request)


def test_structured_outputs_are_the_guided_setting_they_hold() -> None:
    schema = {"type": "object"}
    for held, setting in (
        ({"json": schema}, {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}),
        ({"json_object": True, "disable_fallback": True}, {"response_format": {"type": "json_object"}}),
        ({"regex": "a+", "json_object": False}, {"guided_regex": "a+"}),
        ({"choice": ["a", "b"]}, {"guided_choice": ["a", "b"]}),
        ({"grammar": 'root ::= "a"'}, {"guided_grammar": 'root ::= "a"'}),
        ({"json": None}, {}),
    ):
        assert parse_request({"messages": ASK, "structured_outputs": held}, 1).options == setting, held


def test_a_prompt_cut_to_its_last_tokens_echoes_nothing() -> None:
    tokenizer = tiny_tokenizer()
    whole = encode(tokenizer, parse_request({"prompt": "the quick brown fox jumps"}, 1))
    cut = encode(tokenizer, parse_request({"prompt": "the quick brown fox jumps", "truncate_prompt_tokens": 3}, 1))
    assert whole.shape[1] > 3 and cut.tolist() == whole[:, -3:].tolist()
    request = parse_request({"prompt": "hi", "truncate_prompt_tokens": 3, "echo": True}, 1)
    assert isinstance(request, BadRequest) and "an answer echoes its whole prompt" in str(request)


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
