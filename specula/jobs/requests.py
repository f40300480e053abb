"""Benchmark workloads: JSONL files, one request a line, with ``messages`` (chat) or ``prompt`` (raw text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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


def _request_problem(request: object) -> str | None:
    """Why a line's JSON value is not a request, or None."""
    if not isinstance(request, dict) or not ("messages" in request or "prompt" in request):
        return 'each line must be a JSON object with "messages" (chat) or "prompt" (text)'
    if "messages" in request and not isinstance(request["messages"], list):
        return '"messages" must be a list of {"role": ..., "content": ...}'
    if "prompt" in request and "messages" not in request and not isinstance(request["prompt"], str):
        return '"prompt" must be a string'
    return None


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


def left_padded(prompts: list[torch.Tensor], pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token ids of 1-D ``prompts`` padded on the left (as ``model.generate`` wants a batch), and the
    attention mask that marks the padding."""
    width = max(len(prompt) for prompt in prompts)
    pad = 0 if pad_token_id is None else pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask
