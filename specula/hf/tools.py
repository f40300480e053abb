"""Tools (OpenAI's ``tools`` and ``tool_choice``): the functions a chat offers, shown to the model by its own chat
template, and the calls it writes read back from its output.

Chat templates that take tools ask the model to write each call in a format of their family: Hermes' (Qwen2.5,
Hermes, many fine-tunes) as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Llama 3.1's as a bare JSON
object with ``"parameters"``, Mistral's after ``[TOOL_CALLS]`` as a JSON list; small models often leave Hermes' tags
out. :func:`read_calls` reads any of these, and only where every call names one of the request's functions with an
object of arguments; anything else stays the answer's text. ``tool_choice`` ``"required"`` or a named function
holds the output to calls (one where a function is named) of the request's functions, with arguments of their
schemas, in the template's format (:func:`call_grammar`, an llguidance grammar: :mod:`.grammar`). Nothing here needs
torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes' tags around a call
_PREFIXES = ("[TOOL_CALLS]",)  # what a format writes before its calls' JSON (Mistral's)
_PROBE = [{"type": "function", "function": {"name": "specula_probe", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: a request's function and its arguments."""

    name: str
    arguments: dict

    def openai(self, id: str) -> dict:
        """The call as OpenAI's ``tool_calls`` list it (``arguments`` as JSON text)."""
        return {"id": id, "type": "function", "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def shows_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template shows the model the tools it is given (many ignore them): a chat
    rendered with a tool and without (a millisecond)."""
    if tokenizer.chat_template is None:
        return False
    chat = [{"role": "user", "content": "hi"}]
    rendered = [
        tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
        for tools in (None, _PROBE)
    ]
    return rendered[0] != rendered[1]


def tagged(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template asks for Hermes' tagged calls."""
    return isinstance(tokenizer.chat_template, str) and OPEN in tokenizer.chat_template


def read_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """The text before the calls and the calls in ``text`` (an answer), where every call it holds names one of
    ``names`` with an object of arguments; else ``(text, [])``.

    >>> read_calls('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>', {"f"})
    ('Sure.', [ToolCall(name='f', arguments={'x': 1})])
    >>> read_calls('```json\\n{"name": "f", "parameters": {"x": 1}}\\n```', {"f"})
    ('', [ToolCall(name='f', arguments={'x': 1})])
    >>> read_calls('{"name": "g", "arguments": {}}', {"f"})
    ('{"name": "g", "arguments": {}}', [])
    """
    if OPEN in text:
        before, _, rest = text.partition(OPEN)
        blocks = [block.split(CLOSE)[0] for block in (OPEN + rest).split(OPEN)[1:]]
        tail = rest.rsplit(CLOSE, 1)[-1] if CLOSE in rest else ""
        calls = [_call(_json(block), names) for block in blocks]
        if calls and None not in calls and not tail.strip():
            return before.rstrip(), calls
        return text, []
    body = text.strip()
    for prefix in _PREFIXES:
        body = body.removeprefix(prefix).strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    found = _json(fenced.group(1) if fenced else body)
    calls = [_call(value, names) for value in (found if isinstance(found, list) else [found])]
    if calls and None not in calls:
        return "", calls
    return text, []


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(value: object, names: set[str]) -> ToolCall | None:
    """``value`` as a call of one of ``names`` (``{"name", "arguments" or "parameters": an object or its JSON}``)."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def sendable(text: str) -> str:
    """What of ``text`` (an answer so far, to a request with tools) may be streamed as its content: nothing while
    it may be a call in JSON; up to its first call's tag, less a tail that may become one and trailing white space.

    >>> sendable("Let me check."), sendable("Let me check.\\n<tool"), sendable(' {"name"'), sendable("a <tool_call>")
    ('Let me check.', 'Let me check.', '', 'a')
    """
    if not text.strip() or text.lstrip()[0] in "{[`":  # (JSON, a fence, Mistral's [TOOL_CALLS])
        return ""
    text = text.split(OPEN)[0]
    held = max((n for n in range(1, len(OPEN)) if text.endswith(OPEN[:n])), default=0)
    return text[: len(text) - held].rstrip()


def call_grammar(tokenizer, tools: list[dict], name: str | None = None, one: bool = False) -> str:
    """An llguidance grammar (:mod:`.grammar`) of what the model may write where a call is required: one or more
    calls of ``tools`` (one where ``one``; one of ``name`` where it names one, as OpenAI's ``tool_choice`` does),
    each ``{"name": ..., "arguments": ...}`` with arguments of the function's schema, on one line as chat templates
    show calls (``", "`` and ``": "`` between items and after keys: what the grammar then forces, drafts take), in
    Hermes' tags where the template asks for them (each tag the token it is in the vocabulary, where it is one)."""
    from llguidance import LLMatcher

    functions = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    schema = {
        "x-guidance": {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
        },  # (as templates show)
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": function.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for function in functions
        ],
    }
    call = f"%json {json.dumps(schema)}"
    if tagged(tokenizer):
        open_, close = (_literal(tokenizer, tag) for tag in (OPEN, CLOSE))
        call = f'{open_} "\\n" {call} "\\n" {close}'
    calls = "call" if one or name else 'call ("\\n" call)*'
    lark = f"start: {calls}\ncall: {call}\n"
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
    if error:
        raise ValueError(f'"tools": a function\'s "parameters" cannot be used ({error})')
    return LLMatcher.grammar_from_lark(lark)


def _literal(tokenizer, text: str) -> str:
    """``text`` in a grammar: its token (``<[id]>``) where the vocabulary holds it as one, else the string."""
    ids = tokenizer.convert_tokens_to_ids([text])
    known = ids[0] is not None and ids[0] != tokenizer.unk_token_id
    return f"<[{ids[0]}]>" if known else json.dumps(text)
