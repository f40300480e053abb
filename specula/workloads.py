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
