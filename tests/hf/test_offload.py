"""A model accelerate offloads (weights on ``meta`` until a hook brings them for a forward) decodes as before
(specula.verifier.support.model_device)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy
from tiny_models import tiny_model

import specula
from specula.verifier.exactness import model_key

PROMPT = torch.arange(3, 23).repeat(3)[None]


def new_tokens(out: torch.Tensor) -> list[int]:
    return out[0, PROMPT.shape[1] :].tolist()


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_model_accelerate_offloads_decodes_as_before(offload, tmp_path) -> None:
    """accelerate's ``cpu_offload`` / ``disk_offload`` (weights on ``meta`` until a hook brings them): passes run where
    the hooks compute, every draft sent, model.generate's output (mutant: the device taken from the embedding's
    weight, ``meta``, fails in accelerate's hooks)."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama")
    expected, key = new_tokens(hf_greedy(model, PROMPT, 16, eos_token_id=[])), model_key(model)
    if offload == "cpu":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(model, tmp_path, execution_device=torch.device("cpu"))
    assert model.get_input_embeddings().weight.device.type == "meta"
    assert model_key(model) != key  # (its passes cost otherwise: it measures them anew, not the model's kept ones)
    out = specula.generate(
        model, PROMPT, specula.PromptLookup(), max_new_tokens=16, eos_token_id=[], adaptive_draft=False
    )
    assert new_tokens(out.sequences) == expected and out.stats.accepted > 0
