"""The one reader of request files (``generate``'s input, benchmark workloads): JSONL, one request a line, in either
of two shapes, each line checked into a :class:`Request`:

- specula's own: ``{"id", "messages" (a chat) or "prompt" (raw text), "prediction", settings ...}``; fields it does not
  know are the line's own data (a workload's ``reference``), unless they are a near miss of a setting's name;
- OpenAI's Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
  "body": {...}}``, the body a chat or text completion request; a body field it does not know is refused, as OpenAI
  refuses it.

Settings go under OpenAI's chat-completions names (:data:`SETTINGS`); a request field specula cannot honour
(:data:`DEFAULT_ONLY` away from its default value) makes the line bad, with a reason that names the field: never
silently ignored. Nothing here needs torch, so the command line reads every line before the model loads.
"""

from __future__ import annotations

import difflib
import enum
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..hf.openai import prediction_content
from ..hf.tools import shows_tools

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what requests may call the embedded default model
ENDPOINTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}  # url -> body object
BATCH_KEYS = ("custom_id", "method", "url", "body")
SETTINGS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "echo",
    "top_logprobs",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    # vLLM's names for what OpenAI's API lacks
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
)
MAX_CHOICES = 128  # OpenAI's most choices a request may ask for
TOP_LOGPROBS = {"/v1/chat/completions": 20, "/v1/completions": 5}  # OpenAI's most alternatives a token may list
# Fields specula honours only at their default (null is the default too), and why it cannot honour another value.
DEFAULT_ONLY = {
    "best_of": (1, "specula ranks no answers: n makes several, each returned"),
    "suffix": ("", "specula does not insert text before a suffix"),
    "stream": (False, "a file's answers are written whole, not streamed"),
    "stream_options": ({}, "a file's answers are written whole, not streamed"),
    "functions": ([], 'OpenAI\'s older shape of "tools": give "tools"'),
    "function_call": ("none", 'OpenAI\'s older shape of "tool_choice": give "tools" and "tool_choice"'),
    "modalities": (["text"], "specula answers in text"),
    "audio": (None, "specula answers in text"),
    "reasoning_effort": (None, "specula does not reason apart from its answer"),
    "verbosity": (None, "specula does not set a verbosity"),
    "web_search_options": (None, "specula does not search the web"),
    # vLLM's
    "use_beam_search": (False, "specula does not search beams"),
    "length_penalty": (1, "specula does not search beams"),
    "prompt_logprobs": (None, 'a text completion lists its prompt\'s with "echo" and "logprobs"'),
    "guided_whitespace_pattern": (None, "specula's JSON grammar takes any white space"),
    "structural_tag": (
        None,
        'give "guided_json", "guided_regex", "guided_choice", "guided_grammar" or "response_format"',
    ),
    "logits_processors": (None, "specula runs no processors named in a request"),
    "return_tokens_as_token_ids": (False, "specula lists tokens as text"),
    "spaces_between_special_tokens": (True, "specula decodes as the tokenizer does"),
    "add_special_tokens": (False, "the chat template adds what the model needs"),
    "documents": (None, "give the documents in the messages"),
    "chat_template": (None, "specula uses the model's own chat template"),
    "mm_processor_kwargs": (None, "specula reads text only"),
    "vllm_xargs": (None, "specula runs no vLLM extensions"),
}
# Fields that do not change an answer: accepted and kept out of its decoding.
NO_EFFECT = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "priority",
    "request_id",
    "cache_salt",
    "guided_decoding_backend",
)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat roles
_OWN_FIELDS = ("id", "messages", "prompt", "prediction", "model")
_KNOWN = set(SETTINGS) | set(DEFAULT_ONLY) | set(NO_EFFECT) | set(_OWN_FIELDS)


class Shape(enum.Enum):
    """What a request line looks like: specula's own (``messages`` or ``prompt``), an OpenAI Batch API line, or
    neither (a line too broken to say)."""

    OWN = "specula's own request lines"
    BATCH_API = "OpenAI Batch API lines"
    NEITHER = "neither"


class BadRequest(ValueError):
    """A line of a requests file that is not a request; its message says where (``path:line``) and why. ``shape``:
    what the line looks like, ``id`` its ``custom_id`` where it could be read, for the error line that answers it."""

    def __init__(self, message: str, id: object = None, shape: Shape = Shape.NEITHER) -> None:
        super().__init__(message)
        self.id, self.shape = id, shape


@dataclass(frozen=True)
class Request:
    """One request line, checked. ``options`` holds the settings the line gives itself, under :data:`SETTINGS`'s
    names, checked for type and range (``stop`` as a list, ``max_completion_tokens`` as ``max_tokens``); what it
    leaves out comes from the run's defaults."""

    line: int  # its line number in the file
    id: object  # "id" (a Batch API line: "custom_id"); a line without one: its line number
    messages: list | None = None  # a chat, through the model's chat template
    prompt: str | None = None  # raw text (used when there are no messages)
    prediction: str | None = None  # the output it expects back
    options: dict = field(default_factory=dict)
    model: str | None = None  # the model it names, if any
    url: str | None = None  # a Batch API line's endpoint (None: specula's own shape)
    data: dict = field(default_factory=dict, repr=False, compare=False)  # the line as read

    @property
    def batch(self) -> bool:
        """Whether it is a Batch API line (answered with a Batch API output line)."""
        return self.url is not None

    @property
    def shape(self) -> Shape:
        return Shape.BATCH_API if self.batch else Shape.OWN


def read_requests(path: Path, model: str | tuple[str, ...] | None = None) -> Iterator[tuple[int, Request | BadRequest]]:
    """(line number, request) for every non-empty line of a JSONL file of requests; a line that is not a request
    comes as a :class:`BadRequest` instead, as does one that names a model other than ``model`` (the loaded model's
    name, :func:`model_name`, or it and its adapters' names; ``None``: not checked)."""
    with Path(path).open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as error:  # the decoder's words alone ("Expecting value") do not say it
                yield number, BadRequest(f"{path}:{number}: not JSON ({error})")
                continue
            yield number, parse_request(data, number, model, where=f"{path}:{number}")


def parse_request(
    data: object, number: int, model: str | tuple[str, ...] | None = None, where: str = ""
) -> Request | BadRequest:
    """Line ``number``'s JSON value as a :class:`Request`, or a :class:`BadRequest` saying why it is not one
    (``where`` prefixes its message)."""
    batch = isinstance(data, dict) and any(key in data for key in BATCH_KEYS)
    own = isinstance(data, dict) and ("messages" in data or "prompt" in data)
    shape = Shape.BATCH_API if batch else Shape.OWN if own else Shape.NEITHER
    try:
        request = _batch_request(data, number) if batch else _own_request(data, number)
        names = (model,) if isinstance(model, str) else model
        if names and request.model is not None and not any(names_model(request.model, name) for name in names):
            adapters = f" with the adapters {', '.join(map(repr, names[1:]))}" if len(names) > 1 else ""
            raise _Problem(
                f'"model" is {request.model!r}, but the loaded model is {names[0]!r}{adapters}; name '
                f'{"one" if adapters else "it"} or leave "model" out'
            )
    except _Problem as problem:
        custom_id = data.get("custom_id") if batch and isinstance(data.get("custom_id"), str) else None
        return BadRequest(f"{where}: {problem}" if where else str(problem), custom_id, shape)
    return request


class _Problem(Exception):
    """Why a line is not a request (becomes a :class:`BadRequest` with its place)."""


def _own_request(data: object, number: int) -> Request:
    for name in data if isinstance(data, dict) else ():
        if name not in _KNOWN and (near := difflib.get_close_matches(name, _KNOWN, n=1, cutoff=0.8)):
            raise _Problem(f'unknown field "{name}": did you mean "{near[0]}"?')
    if not isinstance(data, dict) or not ("messages" in data or "prompt" in data):
        raise _Problem(
            'each line must be a JSON object with "messages" (chat) or "prompt" (text), or an OpenAI '
            'Batch API request ("custom_id", "method", "url", "body")'
        )
    return _request(data, number, data.get("id", number), "messages" in data, None, data)


def _batch_request(data: dict, number: int) -> Request:
    missing = [key for key in BATCH_KEYS if key not in data]
    if missing:
        raise _Problem(f"an OpenAI Batch API line needs {', '.join(BATCH_KEYS)}; this one lacks {', '.join(missing)}")
    if not isinstance(data["custom_id"], str) or not data["custom_id"]:
        raise _Problem('"custom_id" must be a non-empty string')
    if data["method"] != "POST":
        raise _Problem(f'"method" must be "POST", got {data["method"]!r}')
    if data["url"] not in ENDPOINTS:
        raise _Problem(
            f'"url" must be one of {", ".join(ENDPOINTS)} (the endpoints specula answers), got {data["url"]!r}'
        )
    body = data["body"]
    if not isinstance(body, dict):
        raise _Problem('"body" must be a JSON object: the chat or text completion request')
    chat = data["url"] == "/v1/chat/completions"
    needed = "messages" if chat else "prompt"
    if needed not in body:
        raise _Problem(f'a {data["url"]} body needs "{needed}"')
    allowed = _KNOWN - {"id", "prompt" if chat else "messages"}
    unknown = [name for name in body if name not in allowed]
    if unknown:
        near = difflib.get_close_matches(unknown[0], allowed, n=1, cutoff=0.8)
        raise _Problem(
            f'body: unknown field "{unknown[0]}" for {data["url"]}' + (f': did you mean "{near[0]}"?' if near else "")
        )
    return _request(body, number, data["custom_id"], chat, data["url"], data)


def _request(fields: dict, number: int, key: object, chat: bool, url: str | None, data: dict) -> Request:
    """A :class:`Request` from a request's fields (a line of specula's, or a Batch API body)."""
    prompt = fields.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # (OpenAI's list of prompts, of one)
    if not chat and not isinstance(prompt, str):
        raise _Problem(
            '"prompt" must be a string: one prompt per line (several make several answers, and token '
            "ids are not read: give the text)"
        )
    if fields.get("model") is not None and not isinstance(fields["model"], str):
        raise _Problem('"model" must be a string')
    for name, (default, why) in DEFAULT_ONLY.items():
        value = fields.get(name)
        if (
            value is not None
            and value != default
            and not (name == "function_call" and value == "auto" and not fields.get("functions"))
        ):
            raise _Problem(f'"{name}": {json.dumps(value)[:60]} cannot be honoured: {why}')
    prediction = fields.get("prediction")
    if prediction is not None:
        try:
            prediction = prediction_content(prediction)
        except TypeError as error:
            raise _Problem(f'"prediction": {error}') from None
        if not isinstance(prediction, str):
            raise _Problem('"prediction" must be text, or {"type": "content", "content": text}')
    return Request(
        number,
        key,
        _messages(fields["messages"]) if chat else None,
        None if chat else prompt,
        prediction,
        _options(fields, url, chat),
        fields.get("model"),
        url,
        data,
    )


def _messages(messages: object) -> list[dict]:
    """A chat as chat templates read it: each message's text parts joined into its ``content``, OpenAI's
    ``developer`` role as ``system`` (what templates know it as).

    >>> _messages([{"role": "developer",
    ...             "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}])
    [{'role': 'system', 'content': 'Be brief.'}]
    """
    if not isinstance(messages, list) or not messages:
        raise _Problem('"messages" must be a non-empty list of {"role": ..., "content": ...}')
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Problem(f'"messages"[{index}] must be an object with a "role" and a "content"')
        if message["role"] not in ROLES:
            raise _Problem(
                f'"messages"[{index}]: unknown role {json.dumps(message["role"])}; OpenAI\'s roles are '
                + ", ".join(ROLES)
            )
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content
            ):
                raise _Problem(
                    f'"messages"[{index}]: specula reads text only; its content parts must be '
                    '{"type": "text", "text": ...}'
                )
            content = "".join(part["text"] for part in content)
        calls = message.get("tool_calls")
        if content is None and calls and message["role"] == "assistant":  # (an answer that only called tools)
            content = ""
        if not isinstance(content, str):
            raise _Problem(f'"messages"[{index}] must have a "content": text, or a list of text parts')
        role = "system" if message["role"] == "developer" else message["role"]
        chat.append(
            {**message, "role": role, "content": content} | ({"tool_calls": _calls(calls, index)} if calls else {})
        )
    return chat


def _calls(calls: object, index: int) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's arguments an object (OpenAI
    gives their JSON text; templates write them with ``tojson``).

    >>> _calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}], 0)
    [{'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}]
    """
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": JSON text of an object}}'
    if not isinstance(calls, list):
        raise _Problem(f'"messages"[{index}]: "tool_calls" must be a list of {shape}')
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        arguments = _json_text(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
            raise _Problem(f'"messages"[{index}]: each of its "tool_calls" must be {shape}')
        read.append(call | {"function": function | {"arguments": arguments}})
    return read


def _options(fields: dict, url: str | None = None, chat: bool = False) -> dict:
    """The settings a request gives itself (null: not given), checked and normalised (``logprobs``: how many
    alternatives each token lists, where asked; ``url``: a Batch API line's endpoint, whose field names they are;
    ``chat``: whether it is a chat)."""
    given = {name: fields[name] for name in SETTINGS if fields.get(name) is not None}
    _logprobs(given, url)
    if given.get("echo") is not None and not isinstance(given["echo"], bool):
        raise _Problem(f'"echo" must be true or false, got {json.dumps(given["echo"])}')
    if given.get("echo") and chat:
        raise _Problem('"echo" is a text completion\'s field: the answer after its "prompt"; a chat has none')
    if given.get("echo") is False:  # (the default)
        del given["echo"]
    limits = {name: given.pop(name) for name in ("max_tokens", "max_completion_tokens") if name in given}
    if len(set(map(repr, limits.values()))) > 1:
        raise _Problem(
            f'"max_tokens" ({limits["max_tokens"]}) and "max_completion_tokens" '
            f"({limits['max_completion_tokens']}) differ; give one"
        )
    if "n" in given and _whole("n", given["n"], 1, f" (at most {MAX_CHOICES})") > MAX_CHOICES:
        raise _Problem(f'"n" must be at most {MAX_CHOICES}, got {given["n"]}')
    if given.get("n") == 1:
        del given["n"]
    if "response_format" in given and _response_format(given["response_format"]) == "text":
        del given["response_format"]
    _tools(given, chat)
    _vllm(given, chat)
    echo = given.get("echo", False)
    for name, value in limits.items():  # (0 with echo: the prompt alone, and its log probabilities if asked)
        given["max_tokens"] = _whole(name, value, 0 if echo else 1, "" if echo else ' (0 only with "echo")')
    if "min_tokens" in given:
        _whole("min_tokens", given["min_tokens"], 0)
        if given["min_tokens"] > given.get("max_tokens", math.inf):
            raise _Problem(f'"min_tokens" ({given["min_tokens"]}) is more than "max_tokens" ({given["max_tokens"]})')
    if "seed" in given and _whole("seed", given["seed"], -(2**63)) >= 2**64:
        raise _Problem(f'"seed" must be less than 2**64, got {given["seed"]}')
    if "top_k" in given:
        _whole("top_k", given["top_k"], -1, " (-1 or 0: every token)")
    if "temperature" in given and not _number(given["temperature"]) >= 0:
        raise _Problem(f'"temperature" must be a number >= 0 (0: greedy), got {given["temperature"]!r}')
    if "top_p" in given and not 0 < _number(given["top_p"]) <= 1:
        raise _Problem(f'"top_p" must be a number in (0, 1], got {given["top_p"]!r}')
    if "repetition_penalty" in given and not _number(given["repetition_penalty"]) > 0:
        raise _Problem(f'"repetition_penalty" must be a number > 0 (1: none), got {given["repetition_penalty"]!r}')
    for name in ("frequency_penalty", "presence_penalty"):
        if name in given and not -2 <= _number(given[name]) <= 2:
            raise _Problem(f'"{name}" must be a number from -2 to 2 (0: none), got {json.dumps(given[name])}')
        if given.get(name) == 0:
            del given[name]
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
        if not given["logit_bias"]:
            del given["logit_bias"]
    if "stop" in given:
        stop = [given["stop"]] if isinstance(given["stop"], str) else given["stop"]
        if not isinstance(stop, list) or not all(isinstance(text, str) and text for text in stop):
            raise _Problem(f'"stop" must be a non-empty string or a list of them, got {json.dumps(given["stop"])}')
        given["stop"] = stop
        if not stop:  # (an empty list: no stop string)
            del given["stop"]
    return given


def _logprobs(given: dict, url: str | None) -> None:
    """``given``'s log probability settings as one, ``"logprobs"``: the alternatives each token lists (left out where
    none are asked for). Text completions ask with ``"logprobs": k``; chat completions and specula's own lines with
    ``"logprobs": true`` and ``"top_logprobs": k``.

    >>> given = {"logprobs": True, "top_logprobs": 2}; _logprobs(given, None); given
    {'logprobs': 2}
    """
    if url == "/v1/completions":
        if "top_logprobs" in given:
            raise _Problem('"top_logprobs" is a chat completions field; text completions ask with "logprobs": k')
        if "logprobs" in given:
            given["logprobs"] = _whole("logprobs", given["logprobs"], 0, f" (at most {TOP_LOGPROBS[url]})")
            if given["logprobs"] > TOP_LOGPROBS[url]:
                raise _Problem(f'"logprobs" must be at most {TOP_LOGPROBS[url]}, got {given["logprobs"]}')
        return
    most = TOP_LOGPROBS["/v1/chat/completions"]
    asked, top = given.pop("logprobs", False), given.pop("top_logprobs", 0)
    if not isinstance(asked, bool):
        raise _Problem(f'"logprobs" must be true or false, got {json.dumps(asked)}')
    if _whole("top_logprobs", top, 0, f" (at most {most})") > most:
        raise _Problem(f'"top_logprobs" must be at most {most}, got {top}')
    if top and not asked:
        raise _Problem('"top_logprobs" needs "logprobs": true')
    if asked:
        given["logprobs"] = top


def _tools(given: dict, chat: bool) -> None:
    """``given``'s tool settings, checked: ``tools`` (OpenAI's functions) left out where none are offered or
    ``tool_choice`` is ``"none"`` (the model is not shown them), ``tool_choice`` left out at ``"auto"``."""
    tools, choice = given.get("tools", []), given.get("tool_choice", "auto")
    if tools and not chat:
        raise _Problem('"tools" is a chat completions field: give "messages"')
    if not isinstance(tools, list):
        raise _Problem(
            f'"tools" must be a list of {{"type": "function", "function": {{...}}}}, got {json.dumps(tools)[:60]}'
        )
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise _Problem(
                f'"tools"[{index}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
            )
        if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", function["name"]):
            raise _Problem(f'"tools"[{index}]: a function\'s "name" must be 1-64 letters, digits, _ or -')
        if not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
            raise _Problem(f'"tools"[{index}]: "parameters" must be a JSON schema object, "description" text')
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise _Problem(f'"tools": each function needs its own name; {sorted(names)} repeat one')
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if choice not in ("none", "auto", "required") and not (choice == {"type": "function", "function": {"name": named}}):
        raise _Problem(
            '"tool_choice" must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(choice)[:60]}"
        )
    if choice == "required" and not names:
        raise _Problem('"tool_choice": "required" needs "tools"')
    if named is not None and named not in names:
        raise _Problem(f'"tool_choice" names the function {json.dumps(named)}, which "tools" does not offer')
    if not isinstance(given.get("parallel_tool_calls", True), bool):
        raise _Problem(f'"parallel_tool_calls" must be true or false, got {json.dumps(given["parallel_tool_calls"])}')
    if not tools or choice == "none":
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            given.pop(name, None)
        return
    if choice == "auto":
        given.pop("tool_choice", None)
    if given.get("parallel_tool_calls", True):
        given.pop("parallel_tool_calls", None)


def _vllm(given: dict, chat: bool) -> None:
    """``given``'s settings under vLLM's names, checked; those at their default left out, ``structured_outputs`` as
    the ``guided_*`` setting it holds, ``guided_json`` as the ``response_format`` of its schema."""
    _structured(given)
    _token_controls(given)
    defaults = {
        "ignore_eos": False,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
    for name, default in defaults.items():
        if not isinstance(given.get(name, default), bool):
            raise _Problem(f'"{name}" must be true or false, got {json.dumps(given[name])}')
        if given.get(name) == default:
            del given[name]
    if not chat and {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"} & set(given):
        raise _Problem('"chat_template_kwargs", "add_generation_prompt" and "continue_final_message" are a chat\'s')
    if given.get("continue_final_message") and given.get("add_generation_prompt", True):
        raise _Problem('"continue_final_message" goes on with the last message: give "add_generation_prompt": false')
    kwargs = given.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict) or set(kwargs) & _TEMPLATE_ARGUMENTS:
        raise _Problem(
            '"chat_template_kwargs" must be an object of the template\'s own variables (none of '
            f"{', '.join(sorted(_TEMPLATE_ARGUMENTS))}), got {json.dumps(kwargs)[:60]}"
        )
    if not kwargs:
        given.pop("chat_template_kwargs", None)
    if "min_p" in given and not 0 <= _number(given["min_p"]) <= 1:
        raise _Problem(f'"min_p" must be a number from 0 to 1 (0: none), got {json.dumps(given["min_p"])}')
    if given.get("min_p") == 0:
        del given["min_p"]
    ids = given.get("stop_token_ids", [])
    if not isinstance(ids, list) or not all(_token_id(id) for id in ids):
        raise _Problem(f'"stop_token_ids" must be a list of token ids, got {json.dumps(ids)[:60]}')
    if not ids:
        given.pop("stop_token_ids", None)
    guides = [
        name
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format", "tools")
        if name in given
    ]
    if len(guides) > 1:
        raise _Problem(f"{' and '.join(map(json.dumps, guides))} cannot hold one answer together: give one")
    if "guided_json" in given:
        schema = given.pop("guided_json")
        schema = _json_text(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise _Problem('"guided_json" must be a JSON schema: an object, or its JSON text')
        given["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    if "guided_regex" in given and not isinstance(given["guided_regex"], str):
        raise _Problem(
            f'"guided_regex" must be a regular expression (text), got {json.dumps(given["guided_regex"])[:60]}'
        )
    if "guided_grammar" in given and not (isinstance(given["guided_grammar"], str) and given["guided_grammar"]):
        raise _Problem(
            f'"guided_grammar" must be a grammar (Lark or GBNF text), got {json.dumps(given["guided_grammar"])[:60]}'
        )
    choices = given.get("guided_choice", ["-"])
    if not isinstance(choices, list) or not choices or not all(isinstance(text, str) and text for text in choices):
        raise _Problem(f'"guided_choice" must be a non-empty list of texts, got {json.dumps(choices)[:60]}')


STRUCTURED = {  # vLLM's structured_outputs: its constraints, under the names of the settings that hold them
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "response_format",
}
STRUCTURED_OPTIONS = {  # and its options: the value each takes here (None: any), and why no other
    "disable_fallback": (None, ""),
    "disable_any_whitespace": (False, "specula's JSON grammar takes any white space"),
    "disable_additional_properties": (False, 'give the schema "additionalProperties": false'),
    "whitespace_pattern": (None, "specula's JSON grammar takes any white space"),
    "structural_tag": (None, "give one of " + ", ".join(map(json.dumps, STRUCTURED))),
}


def _structured(given: dict) -> None:
    """vLLM's ``structured_outputs`` (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
    ``{"grammar": ...}`` or ``{"json_object": true}``) as the setting of vLLM's older names that holds the same."""
    if "structured_outputs" not in given:
        return
    shape = given.pop("structured_outputs")
    if not isinstance(shape, dict) or set(shape) - set(STRUCTURED) - set(STRUCTURED_OPTIONS):
        raise _Problem(
            '"structured_outputs" must be an object of one of '
            f"{', '.join(map(json.dumps, STRUCTURED))} (and vLLM's options), got {json.dumps(shape)[:80]}"
        )
    for name, (value, why) in STRUCTURED_OPTIONS.items():
        if why and shape.get(name) not in (None, value):
            raise _Problem(f'"structured_outputs": "{name}": {json.dumps(shape[name])[:60]} cannot be honoured: {why}')
    held = {name: value for name, value in shape.items() if name in STRUCTURED and value not in (None, False)}
    if len(held) > 1:
        raise _Problem(f'"structured_outputs" holds one of {" and ".join(map(json.dumps, held))}: give one')
    for name, value in held.items():
        if STRUCTURED[name] in given:
            raise _Problem(f'"structured_outputs" and "{STRUCTURED[name]}" cannot hold one answer together: give one')
        if name == "json_object" and value is not True:
            raise _Problem(f'"structured_outputs": "json_object" must be true or false, got {json.dumps(value)[:60]}')
        given[STRUCTURED[name]] = {"type": "json_object"} if name == "json_object" else value


def _token_controls(given: dict) -> None:
    """vLLM's ``allowed_token_ids`` (the only tokens an answer may hold), ``bad_words`` (words it may not hold) and
    ``truncate_prompt_tokens`` (the prompt's last tokens kept), checked; those at their default left out."""
    ids = given.get("allowed_token_ids", [0])
    if not isinstance(ids, list) or not ids or not all(_token_id(id) for id in ids):
        raise _Problem(f'"allowed_token_ids" must be a non-empty list of token ids, got {json.dumps(ids)[:60]}')
    words = given.get("bad_words", [])
    if not isinstance(words, list) or not all(isinstance(word, str) and word.strip() for word in words):
        raise _Problem(f'"bad_words" must be a list of words (texts), got {json.dumps(words)[:60]}')
    if not words:
        given.pop("bad_words", None)
    if "truncate_prompt_tokens" in given:
        _whole("truncate_prompt_tokens", given["truncate_prompt_tokens"], 1, " (the prompt's last tokens kept)")
        if given.get("echo"):
            raise _Problem('"truncate_prompt_tokens" and "echo": an answer echoes its whole prompt; give one')


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_TEMPLATE_ARGUMENTS = {  # what specula gives apply_chat_template itself
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_tensors",
    "return_dict",
}


def _json_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _response_format(shape: object) -> str:
    """The kind of OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with its ``schema``),
    checked."""
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(shape, dict) or shape.get("type") not in kinds:
        raise _Problem(f'"response_format" must be {{"type": one of {", ".join(kinds)}}}, got {json.dumps(shape)[:60]}')
    if shape["type"] == "json_schema" and not (
        isinstance(shape.get("json_schema"), dict) and isinstance(shape["json_schema"].get("schema", {}), dict)
    ):
        raise _Problem('"response_format": a json_schema one needs "json_schema": {"name": ..., "schema": {...}}')
    return shape["type"]


def _logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids, as JSON's string keys, to a number from -100 to 100 added to the token's
    logit) with whole-number keys.

    >>> _logit_bias({"50256": -100, "7": 2.5})
    {50256: -100.0, 7: 2.5}
    """
    if not isinstance(bias, dict) or not all(key.isdigit() for key in bias):
        raise _Problem(f'"logit_bias" must map token ids (as strings) to numbers, got {json.dumps(bias)[:60]}')
    if not all(-100 <= _number(value) <= 100 for value in bias.values()):
        raise _Problem(f'"logit_bias" values must be numbers from -100 to 100, got {json.dumps(bias)[:60]}')
    return {int(key): float(value) for key, value in bias.items()}


def _whole(name: str, value: object, minimum: int, meaning: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _Problem(f'"{name}" must be a whole number >= {minimum}{meaning}, got {json.dumps(value)}')
    return value


def _number(value: object) -> float:
    """``value`` as a finite number, else NaN (which fails every range check)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return math.nan
    return float(value)


def model_name(path: str | None) -> str:
    """What requests may call the model loaded from ``path`` (``None``: the embedded default): the name of its
    folder, or of its ``.gguf`` file without the suffix."""
    if path is None:
        return DEFAULT_MODEL_NAME
    path = Path(path)
    return path.stem if path.suffix == ".gguf" else path.name


def names_model(asked: str, name: str) -> bool:
    """Whether a request's ``"model"`` names the model called ``name``: the same name, or a hub-style
    ``owner/name`` of it (case aside)."""
    return asked.rstrip("/").rsplit("/", 1)[-1].lower() == name.lower()


def answer_key(request_id: object) -> str:
    """The id of a request or answer as a comparable string (``1`` and ``"1"`` differ, as in the files)."""
    return json.dumps(request_id, sort_keys=True)


def unique_requests(
    path: Path, model: str | tuple[str, ...] | None = None
) -> Iterator[tuple[int, Request | BadRequest]]:
    """:func:`read_requests`, where a request whose id is an earlier line's comes as a :class:`BadRequest`
    (answers are matched to requests by id: in the output, and by ``--resume``)."""
    first: dict[str, int] = {}  # id -> the line that has it
    for number, request in read_requests(path, model):
        if isinstance(request, Request):
            key = answer_key(request.id)
            if key in first:
                name = "custom_id" if request.batch else "id"
                request = BadRequest(
                    f"{path}:{number}: its {name} {key} is line {first[key]}'s too; give each "
                    f'request its own "{name}"'
                    + ("" if request.batch else " (a line without one is known by its line number)"),
                    None,
                    request.shape,
                )  # (its custom_id: an earlier line's answer has it)
            first.setdefault(key, number)
        yield number, request


def file_shape(path: Path) -> Shape:
    """What the request file's lines look like (:attr:`Shape.NEITHER`: no line says); a ``ValueError`` where it
    mixes OpenAI Batch API lines with specula's own, naming a line of each."""
    seen: dict[Shape, int] = {}
    for number, request in read_requests(path):
        if request.shape is not Shape.NEITHER:
            seen.setdefault(request.shape, number)
    if len(seen) == 2:
        raise ValueError(
            f"{path} mixes OpenAI Batch API lines (line {seen[Shape.BATCH_API]}) with specula's own request lines "
            f"(line {seen[Shape.OWN]}); one file holds one shape"
        )
    return next(iter(seen), Shape.NEITHER)


def load_workloads(directory: Path, limit: int, names: list[str] | None = None) -> dict[str, list[Request]]:
    """The first ``limit`` requests of every ``*.jsonl`` in ``directory`` (or only ``names``; or of ``directory``
    itself, a request file), by workload name; every line of those files is checked first (:class:`BadRequest`
    names the first bad one)."""
    workloads = {}
    for path in [Path(directory)] if Path(directory).is_file() else sorted(Path(directory).glob("*.jsonl")):
        if names and path.stem not in names:
            continue
        rows = []
        for _, request in read_requests(path):
            if isinstance(request, BadRequest):
                raise request
            rows.append(request)
        workloads[path.stem] = rows[:limit]
    return workloads


def encode(tokenizer, request: Request | dict) -> torch.Tensor:
    """Token ids of one request (a :class:`Request`, or a dict with ``messages`` or ``prompt``), through the chat
    template when it has messages; its last ``truncate_prompt_tokens`` only, where it gives that (vLLM's)."""
    if isinstance(request, dict):
        request = Request(0, None, request.get("messages"), request.get("prompt"))
    if request.messages is not None and tokenizer.chat_template is None:
        raise ValueError('this model\'s tokenizer has no chat template; give "prompt" (plain text) instead')
    tools = request.options.get("tools")
    if tools and not shows_tools(tokenizer):
        raise ValueError(
            '"tools": this model\'s chat template does not show the model its tools; give a model whose template '
            'takes them (Qwen2.5 ...), or leave "tools" out'
        )
    options = request.options
    if request.messages is not None:
        ids = tokenizer.apply_chat_template(
            request.messages,
            tools=tools,
            add_generation_prompt=options.get("add_generation_prompt", True),
            continue_final_message=options.get("continue_final_message", False),
            return_tensors="pt",
            return_dict=True,
            **options.get("chat_template_kwargs", {}),
        )["input_ids"]
    else:
        ids = tokenizer(request.prompt, return_tensors="pt")["input_ids"]
    return ids[:, -options.get("truncate_prompt_tokens", 0) :]  # [1, tokens] (vLLM's: the last ones kept)
