"""fp32 linear layers in panels: the kernel's sums (panels' padding, groups of panels and rows left over), a row's
result whatever its batch mates, and a model decoding with them as its own generate does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import Oracle, hf_greedy
from tiny_models import tiny_model

import specula
from specula.verifier import packed as packed_module
from specula.verifier import panels as panels_module
from specula.verifier.panels import panel_forward, panel_matmul, panels

PROMPT = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8] * 2])


@pytest.mark.parametrize("outputs", [16, 40, 64, 100, 160])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_panel_sums_are_the_product(outputs, rows) -> None:
    """Outputs past the last whole panel, groups of fewer than four panels, rows past the last block of four."""
    generator = torch.Generator().manual_seed(outputs * 10 + rows)
    weight = torch.randn(outputs, 37, generator=generator)
    x = torch.randn(rows, 37, generator=generator)
    out = torch.full((rows, outputs), float("nan"))
    panel_matmul(x.numpy(), panels(weight).panels.numpy(), out.numpy())
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_rows_sums_are_the_same_whatever_rows_are_beside_it() -> None:
    """Bit for bit: alone, in a block of four, or left over after the blocks."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(100, 576, generator=generator), torch.randn(9, 576, generator=generator)
    laid_out = panels(weight).panels.numpy()
    together = np.empty((9, 100), np.float32)
    panel_matmul(x.numpy(), laid_out, together)
    for row in range(9):
        alone = np.empty((1, 100), np.float32)
        panel_matmul(x[row : row + 1].numpy(), laid_out, alone)
        assert (alone[0] == together[row]).all(), row


def test_a_panel_forward_takes_its_bias_and_hands_wider_products_on() -> None:
    layer = torch.nn.Linear(24, 40)
    own = []
    forward = panel_forward(panels(layer.weight)._replace(most_rows=4), layer.bias, lambda x: own.append(x) or 0)
    x = torch.randn(2, 2, 24)
    torch.testing.assert_close(forward(x), layer(x), rtol=1e-5, atol=1e-5)
    assert forward(torch.randn(5, 24)) == 0 and len(own) == 1  # (past its most rows: the layer's own)


def test_a_model_in_panels_decodes_as_its_own_generate(monkeypatch) -> None:
    """Every fp32 layer in panels (whatever the clock finds here): passes and steps compute with them, and the output
    is model.generate's (mutant: a panel's last input left out of the sums fails)."""
    monkeypatch.setattr(packed_module, "STREAMED", 0)  # (its weights outgrow the caches)
    monkeypatch.setattr(packed_module, "_faster_in_panels", lambda layer, packed: True)
    monkeypatch.setattr(packed_module, "_faster_packed", lambda layer, packed, rows=9, streamed=False: True)
    calls = []
    kernel = panels_module.panel_matmul
    monkeypatch.setattr(panels_module, "panel_matmul", lambda x, *rest: calls.append(len(x)) or kernel(x, *rest))
    model = copy.deepcopy(tiny_model("llama"))
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist() and out.stats.accepted > 12
    assert 7 in calls  # (passes of the last token and 6 drafts, in panels)


def test_only_a_model_whose_weights_outgrow_the_caches_takes_panels(fresh_store, monkeypatch) -> None:
    """A small model's passes read their weights from the caches: packed for oneDNN, each timed as it is, panels not
    tried; past :data:`STREAMED` bytes, panels where faster, products timed over copies of each weight (mutant: panels
    tried whatever the model's size fails)."""
    asked, copied = [], []
    monkeypatch.setattr(packed_module, "_faster_in_panels", lambda layer, packed: asked.append(layer) or True)
    monkeypatch.setattr(packed_module, "_copies", lambda weight: copied.append(weight) or 2)
    model = copy.deepcopy(tiny_model("llama"))
    packed_module.PackedLinears(model)
    assert not asked and not copied
    weights = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(packed_module, "STREAMED", weights // 2)
    packed_module.PackedLinears(model)
    assert asked and copied
