"""What a run writes for each request, in its line's shape: specula's answer line, or an OpenAI Batch API output
line (a ``chat.completion`` or ``text_completion`` body, or the Batch API's ``error`` object). Nothing here needs
torch.

specula's own::

    {"id", "text", "finish_reason", ["logprobs": [{"token", "logprob", "bytes", "top_logprobs"}]],
     (with "n" > 1, "choices": [{"index", "text", "finish_reason", ["logprobs"]}] in place of the first three)
     "stats": {"new_tokens", "passes", "accepted", "drafted", "seconds", "exact", "compiled",
               ["accepted_prediction_tokens", "rejected_prediction_tokens"]}}

Batch API (specula's stats under the body's ``"specula"``)::

    {"id": "batch_req_...", "custom_id", "response": {"status_code": 200, "request_id", "body": {"id", "object",
     "created", "model", "choices": [...], "usage": {..., ["completion_tokens_details"]}, "specula": stats}},
     "error": null}
    {"id": "batch_req_...", "custom_id", "response": null, "error": {"code": "invalid_request", "message"}}
"""

from __future__ import annotations

import itertools
import time
import uuid

from .requests import Request, answer_key


def answer_line(
    request: Request, choices: list[dict], prompt_tokens: int, completion_tokens: int, stats: dict, model: str
) -> dict:
    """The line answering ``request`` with ``choices`` (each ``{"text", "finish_reason": "stop" or "length",
    "logprobs": its tokens' where asked, OpenAI's chat completion entries (:func:`choice_logprobs`), else None}``;
    several where it asked for ``n``); ``completion_tokens`` counts their tokens, ``stats`` are specula's (with the
    prediction's counts where it had one), ``model`` the loaded model's name."""
    if not request.batch:
        own = [
            {"text": choice["text"], "finish_reason": choice["finish_reason"]}
            | ({} if choice["logprobs"] is None else {"logprobs": choice["logprobs"]})
            | ({"tool_calls": choice["tool_calls"]} if "tool_calls" in choice else {})
            for choice in choices
        ]
        several = request.options.get("n", 1) > 1  # (then a list of them, each with its index)
        listed = {"choices": [{"index": index} | choice for index, choice in enumerate(own)]} if several else own[0]
        return {"id": request.id} | listed | {"stats": stats}
    chat = request.url == "/v1/chat/completions"
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if "accepted_prediction_tokens" in stats:  # (OpenAI's names and place for a request with a prediction)
        usage["completion_tokens_details"] = {
            name: stats[name] for name in ("accepted_prediction_tokens", "rejected_prediction_tokens")
        }
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                **({"message": message(choice)} if chat else {"text": choice["text"]}),
                "logprobs": choice_logprobs(request.url, choice["logprobs"]),
                "finish_reason": choice["finish_reason"],
            }
            for index, choice in enumerate(choices)
        ],
        "usage": usage,
        "specula": stats,
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def message(choice: dict) -> dict:
    """A chat choice's ``message``: its text, and the tools it called (where it called one and wrote nothing
    before, its content is null, as OpenAI's)."""
    if "tool_calls" not in choice:
        return {"role": "assistant", "content": choice["text"]}
    return {"role": "assistant", "content": choice["text"] or None, "tool_calls": choice["tool_calls"]}


def choice_logprobs(url: str, entries: list[dict] | None, offset: int = 0) -> dict | None:
    """A choice's ``"logprobs"`` for ``entries`` (chat completion entries, ``None``: not asked) at endpoint ``url``:
    ``{"content": entries, "refusal": null}`` for chat; text completions' own shape (``tokens``, ``token_logprobs``,
    ``top_logprobs``, ``text_offset``, counted from ``offset`` characters), for text.

    >>> entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5}]}
    >>> listed = choice_logprobs("/v1/completions", [entry, entry], offset=3)
    >>> listed["tokens"], listed["token_logprobs"], listed["top_logprobs"], listed["text_offset"]
    (['a', 'a'], [-0.5, -0.5], [{'a': -0.5}, {'a': -0.5}], [3, 4])
    """
    if entries is None:
        return None
    if url == "/v1/chat/completions":
        return {"content": entries, "refusal": None}
    offsets = list(itertools.accumulate((len(entry["token"]) for entry in entries), initial=offset))
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [  # (a prompt's first token, with echo: none)
            None if entry["logprob"] is None else {top["token"]: top["logprob"] for top in entry["top_logprobs"]}
            for entry in entries
        ],
        "text_offset": offsets[:-1],
    }


def error_line(custom_id: str | None, message: str) -> dict:
    """A Batch API output line for a request that was not answered (a bad line, a prompt the model cannot take)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": message},
    }


def answer_stats(line: dict) -> dict | None:
    """specula's stats of an answer line's answer (``None``: an error line)."""
    if "custom_id" not in line:
        return line["stats"]
    return None if line.get("response") is None else line["response"]["body"]["specula"]


def line_key(line: object) -> str:
    """The key of the request an output line answers (:func:`answer_key` of its ``id``, a Batch API line's
    ``custom_id``); ``ValueError`` for what is not an answer line."""
    if not isinstance(line, dict) or "id" not in line:
        raise ValueError('not a JSON object with an "id"')
    return answer_key(line["custom_id"] if "custom_id" in line else line["id"])
