"""Benchmark workloads: JSONL files, one request a line, with ``messages`` (chat) or ``prompt`` (raw text)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_workloads(directory: Path, limit: int, names: list[str] | None = None) -> dict[str, list[dict]]:
    """The first ``limit`` rows of every ``*.jsonl`` in ``directory`` (or only ``names``), by workload name."""
    workloads = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        if names and path.stem not in names:
            continue
        with path.open() as lines:
            workloads[path.stem] = [json.loads(line) for line in lines if line.strip()][:limit]
    return workloads


def encode(tokenizer, row: dict) -> torch.Tensor:
    """Token ids of one workload row, through the chat template when it has ``messages``."""
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
