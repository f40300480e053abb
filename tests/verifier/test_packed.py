"""Verification passes with prepacked weights: used in ordinary passes (and ordinary decoding's one-token steps and
prefills) only, output still model.generate's, packed again after an in-place change of a weight, within a memory
budget."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Oracle, hf_greedy
from tiny_models import tiny_model

import specula
from specula.machine.profile import profile_of
from specula.verifier import packed as packed_module

PROMPT = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8] * 2])


@pytest.fixture
def always_packed(monkeypatch):
    """Every packable layer is packed (whatever the clock finds here); counts the packed calls by width."""
    if packed_module._pack(torch.zeros(4, 4)) is None:
        pytest.skip("oneDNN cannot pack on this CPU")
    calls = []
    monkeypatch.setattr(packed_module, "_faster_packed", lambda layer, packed, rows=9, streamed=False: True)
    forward = packed_module._packed_forward

    def counting(packed, bias, layer):
        inner = forward(packed, bias, layer)
        return lambda x: calls.append(x.shape[-2]) or inner(x)

    monkeypatch.setattr(packed_module, "_packed_forward", counting)
    return calls


def test_packed_weights_serve_ordinary_decoding_only(always_packed) -> None:
    """Ordinary passes over several tokens, ordinary decoding's one-token steps and its prompts' prefills (their LM
    head over the last token alone); neither plain decoding's steps nor exact decoding's passes, nor their
    prefills."""
    model = copy.deepcopy(tiny_model("llama"))
    layers = len([m for m in model.modules() if isinstance(m, torch.nn.Linear)])  # (the LM head among them)
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist()
    prefill = always_packed.count(PROMPT.shape[1])
    assert prefill == layers - 1 and max(x for x in always_packed if x != PROMPT.shape[1]) <= 7
    assert out.stats.accepted > 12
    always_packed.clear()
    steps = specula.generate(model, PROMPT, Oracle(expected, 0), max_new_tokens=8, eos_token_id=[])
    assert steps.sequences.tolist() == expected[:, : PROMPT.shape[1] + 8].tolist()
    assert always_packed.count(1) == 7 * layers + 1 and always_packed.count(PROMPT.shape[1]) == layers - 1
    seen = len(always_packed)
    specula.generate(model, PROMPT, None, max_new_tokens=8, eos_token_id=[])
    specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=8, eos_token_id=[], exact=True)
    assert len(always_packed) == seen  # plain decoding: the model's own one-token steps; exact: row-exact passes


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "made-under-inference-mode"])
def test_a_weight_changed_in_place_or_replaced_is_packed_again(always_packed, inference) -> None:
    """Also for a model made under ``torch.inference_mode`` (its weights keep no version: sampled values tell)."""
    with torch.inference_mode(inference):
        model = copy.deepcopy(tiny_model("llama"))
    assert model.model.layers[0].mlp.down_proj.weight.is_inference() == inference
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist() and always_packed
    with torch.inference_mode() if inference else torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist() and out.stats.accepted > 12
    for layer in model.model.layers:  # another weight tensor (as loading a state dict with assign=True gives)
        layer.mlp.up_proj.weight = torch.nn.Parameter(layer.mlp.up_proj.weight.detach() * -2)
    expected = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(expected, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == expected.tolist() and out.stats.accepted > 12


def test_nothing_is_packed_beyond_the_memory_budget(always_packed, monkeypatch) -> None:
    model = copy.deepcopy(tiny_model("llama"))
    monkeypatch.setattr(packed_module, "spare_bytes", lambda device: 0)
    assert packed_module.packed_for(model) is None
    profile_of(model).packed = None
    monkeypatch.setattr(packed_module, "spare_bytes", lambda device: 10**12)
    layers = packed_module.packed_for(model).layers
    assert len(layers) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_invariant_passes_pack_every_layer_whatever_the_clock(monkeypatch) -> None:
    """Which layers are packed changes a pass's bits, so invariant passes' packing follows no timing: every layer
    oneDNN packs is packed for passes and prefills where the clock finds packing dearer (mutant: timed)."""
    if packed_module._pack(torch.zeros(4, 4, dtype=torch.bfloat16)) is None:
        pytest.skip("oneDNN cannot pack bf16 on this CPU")
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    monkeypatch.setattr(packed_module, "_faster_packed", lambda *args, **kwargs: False)
    assert packed_module.packed_for(model) is None  # (timed: nothing faster packed)
    layers = packed_module.packed_for(model, timed=False).layers
    assert len(layers) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(uses[packed_module.PASS] and uses[packed_module.PREFILL] for *_, uses in layers)
