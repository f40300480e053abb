"""A layer whose result for one token depends on the other tokens of its pass (bitsandbytes' 8-bit matmul picks
outlier columns from every row) is found by its class when the loop is set up: drafts are refused before any pass, a
batch's rows decoded one at a time; never a silent difference from model.generate (specula.verifier.support)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy
from tiny_models import tiny_model

import specula
from specula.jobs.decode import Settings, batch_size
from specula.verifier import support


class Linear8bitLt(torch.nn.Linear):
    """A stand-in for bitsandbytes' layer, mixing the tokens of a pass as it does (every row's: it flattens them):
    each output also carries the largest inputs over the whole pass (one token alone: its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        every_token = tuple(range(x.dim() - 1))
        return super().forward(x) + x.abs().amax(dim=every_token, keepdim=True)[..., : self.out_features]


Linear8bitLt.__module__ = "bitsandbytes.nn.modules"  # (where bitsandbytes defines it)


def mixing_model() -> torch.nn.Module:
    model = tiny_model("llama")
    for layer in model.model.layers:
        old = layer.mlp.down_proj
        new = Linear8bitLt(old.in_features, old.out_features, bias=False)
        new.weight.data.copy_(old.weight.data)
        layer.mlp.down_proj = new
    return model


PROMPT = torch.arange(3, 23).repeat(3)[None]


def test_a_model_with_row_mixing_layers_is_refused_before_decoding(monkeypatch) -> None:
    model = mixing_model()
    with pytest.raises(specula.UnsupportedModelError, match="bitsandbytes 8-bit layers pick outlier columns"):
        specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=16, eos_token_id=[])
    # the check off: drafts verified in passes over several tokens leave model.generate's output
    monkeypatch.setattr(support, "_SPLIT_DEPENDENT_LAYERS", {})
    expected = hf_greedy(model, PROMPT, 16, eos_token_id=[])
    out = specula.generate(
        model, PROMPT, specula.PromptLookup(), max_new_tokens=16, eos_token_id=[], adaptive_draft=False
    )
    assert out.stats.accepted > 0 and out.sequences.tolist() != expected.tolist()


def test_plain_decoding_of_one_request_runs_its_one_token_steps() -> None:
    model = mixing_model()
    expected = hf_greedy(model, PROMPT, 8, eos_token_id=[])
    assert (
        specula.generate(model, PROMPT, None, max_new_tokens=8, eos_token_id=[]).sequences.tolist() == expected.tolist()
    )


def test_a_batch_of_such_a_model_decodes_each_row_alone(monkeypatch) -> None:
    """A batch's rows are the tokens of one pass too: with such layers its requests are decoded one at a time (said
    in a warning), each row as ``model.generate`` decodes it alone; the file jobs' batch size is 1."""
    model = mixing_model()
    rows = torch.stack([torch.arange(3, 33), torch.arange(40, 70).flip(0), torch.arange(5, 65, 2)])
    expected = [hf_greedy(model, row[None], 12, eos_token_id=[])[0].tolist() for row in rows]
    with pytest.warns(UserWarning, match="decoded one at a time"):
        out = specula.generate(model, rows, None, max_new_tokens=12, eos_token_id=[])
    assert out.sequences.tolist() == expected
    assert batch_size(model, Settings(batch_size=8)) == 1
    # the check off: the rows share passes, and leave what each decodes to alone
    monkeypatch.setattr(support, "_SPLIT_DEPENDENT_LAYERS", {})
    assert specula.generate(model, rows, None, max_new_tokens=12, eos_token_id=[]).sequences.tolist() != expected
