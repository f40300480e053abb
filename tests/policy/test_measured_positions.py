"""What the store measures fits the model's positions: a model with few (GPT-2's learned position embeddings) is
timed over a shorter context, never past its last position (on a GPU an index past it is a device-side assert that
ends the process's CUDA context; on a CPU an IndexError)."""

from __future__ import annotations

import torch
import transformers
from tiny_models import CONFIGS

from specula.policy import kept_costs
from specula.policy.batch_size import fastest_batch_size
from specula.verifier import exactness


def few_positions(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = CONFIGS["gpt2"]()
    config.n_positions = 96  # (under every context the store's measurements take)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def test_pass_costs_and_batch_size_are_measured_within_the_positions(fresh_store) -> None:
    model = few_positions()
    for rows in (1, 2):
        table = kept_costs._measure(model, rows)
        assert table is not None and len(table) == len(kept_costs.widths(rows))
    assert fastest_batch_size(model, largest=8, again=True) in (1, 2, 4, 8)


def test_the_cost_of_exactness_is_measured_within_the_positions(fresh_store) -> None:
    assert exactness._measure(few_positions(torch.bfloat16)) is not None
