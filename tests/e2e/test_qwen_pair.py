"""The real pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct, fp32, on code prompts.

The converted model folders come from ``../shared/scripts/get-models.sh`` (the README's test command runs it);
``SPECULA_MODELS`` points elsewhere.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from helpers import hf_greedy, qwen_folder
from test_smollm2 import workloads

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import encode, load_workloads

pytestmark = pytest.mark.slow


@functools.cache
def qwen(size: str):
    return load_model(qwen_folder(size), dtype=torch.float32, tune_layout=False)  # (the layout is not checked here)


@pytest.fixture(scope="module", autouse=True)
def _released():
    """The pair's models go when this file's tests are done: a worker holding both takes half of a 24 GB machine,
    beside the other worker and the processes tests start."""
    yield
    qwen.cache_clear()
    gc.collect()


@pytest.mark.parametrize("index", [0, 1])
def test_qwen_05b_drafting_for_15b_is_identical_in_fp32(index: int) -> None:
    target, tokenizer = qwen("1.5b")
    drafter_model, drafter_tokenizer = qwen("0.5b")
    prompt = encode(tokenizer, load_workloads(workloads(), 2, ["code"])["code"][index])
    drafter = specula.SmallModelDrafter(drafter_model, tokenizer=drafter_tokenizer, target_tokenizer=tokenizer)
    eos = target.generation_config.eos_token_id
    out = specula.generate(target, prompt, drafter, max_new_tokens=32, eos_token_id=eos)
    assert out.sequences.tolist() == hf_greedy(target, prompt, 32, eos_token_id=eos).tolist()
    assert out.stats.acceptance_rate > 0.5 and out.stats.tokens_per_pass > 2
