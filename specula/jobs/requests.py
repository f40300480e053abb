"""The one reader of request files (``generate``'s input, benchmark workloads): JSONL, one request a line, with
``messages`` (chat) or ``prompt`` (raw text), and optionally ``id`` and ``prediction`` (the output it expects back:
text, or OpenAI's ``{"type": "content", "content": ...}``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class BadRequest(ValueError):
    """A line of a requests file that is not a request; its message says where (``path:line``) and why."""


def read_requests(path: Path) -> Iterator[tuple[int, dict | BadRequest]]:
    """(line number, request) for every non-empty line of a JSONL file of requests (``generate``'s input, a
    workload); a line that is not a request comes as a :class:`BadRequest` instead."""
    with Path(path).open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except json.JSONDecodeError as error:  # the decoder's words alone ("Expecting value") do not say it
                yield number, BadRequest(f"{path}:{number}: not JSON ({error})")
                continue
            problem = _request_problem(request)
            yield number, request if problem is None else BadRequest(f"{path}:{number}: {problem}")


def prediction_content(prediction: object) -> object:
    """The content of OpenAI's prediction shape ``{"type": "content", "content": text or [{"type": "text", "text":
    ...}]}`` (a ``TypeError`` saying what is wrong with another dict); anything else as it is.

    >>> prediction_content({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    'ab'
    """
    if not isinstance(prediction, dict):
        return prediction
    if prediction.get("type") != "content" or "content" not in prediction:
        raise TypeError(f'a prediction given as an object must be OpenAI\'s {{"type": "content", "content": ...}}, '
                        f"got keys {sorted(prediction)}")
    content = prediction["content"]
    if isinstance(content, list):  # text parts
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise TypeError('a prediction\'s "content" list must hold {"type": "text", "text": ...} parts')
        return "".join(part["text"] for part in content)
    return content


def _request_problem(request: object) -> str | None:
    """Why a line's JSON value is not a request, or None."""
    if not isinstance(request, dict) or not ("messages" in request or "prompt" in request):
        return 'each line must be a JSON object with "messages" (chat) or "prompt" (text)'
    if "messages" in request and not isinstance(request["messages"], list):
        return '"messages" must be a list of {"role": ..., "content": ...}'
    if "prompt" in request and "messages" not in request and not isinstance(request["prompt"], str):
        return '"prompt" must be a string'
    if request.get("prediction") is not None:
        try:
            content = prediction_content(request["prediction"])
        except TypeError as error:
            return f'"prediction": {error}'
        if not isinstance(content, str):
            return '"prediction" must be text, or {"type": "content", "content": text}'
    return None


def answer_key(request_id: object) -> str:
    """The id of a request or answer as a comparable string (``1`` and ``"1"`` differ, as in the files)."""
    return json.dumps(request_id, sort_keys=True)


def unique_requests(path: Path) -> Iterator[tuple[int, dict | BadRequest]]:
    """:func:`read_requests`, where a request whose id is an earlier line's comes as a
    :class:`BadRequest` (answers are matched to requests by id: in the output, and by ``--resume``)."""
    first: dict[str, int] = {}  # id -> the line that has it
    for number, request in read_requests(path):
        if not isinstance(request, BadRequest):
            key = answer_key(request.get("id", number))
            if key in first:
                request = BadRequest(f"{path}:{number}: its id {key} is line {first[key]}'s too; give each request "
                                     "its own \"id\" (a line without one is known by its line number)")
            first.setdefault(key, number)
        yield number, request


def load_workloads(directory: Path, limit: int, names: list[str] | None = None) -> dict[str, list[dict]]:
    """The first ``limit`` rows of every ``*.jsonl`` in ``directory`` (or only ``names``), by workload name; every
    line of those files is checked first (:class:`BadRequest` names the first bad one)."""
    workloads = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        if names and path.stem not in names:
            continue
        rows = []
        for _, request in read_requests(path):
            if isinstance(request, BadRequest):
                raise request
            rows.append(request)
        workloads[path.stem] = rows[:limit]
    return workloads


def encode(tokenizer, row: dict) -> torch.Tensor:
    """Token ids of one workload row, through the chat template when it has ``messages``."""
    if "messages" in row and tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; give \"prompt\" (plain text) instead")
    if "messages" in row:
        return tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(row["prompt"], return_tensors="pt")["input_ids"]
