"""tune_cpu_layout: keeps the faster weight layout, changes strides only, and generation stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import Oracle, hf_greedy
from tiny_models import ARCHITECTURES, tiny_model

import specula
from specula.machine import store
from specula.verifier import cpu_layout

PROMPT = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14]])


def linear_weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def column_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


def with_costs(monkeypatch, as_is: float, transposed: float) -> None:
    """Make the timings report ``as_is`` ms for the stored layout, ``transposed`` ms for the other, ``as_is`` again."""
    costs = iter([as_is, transposed, as_is])
    monkeypatch.setattr(cpu_layout, "_pass_cost_ms", lambda model, repeats: next(costs))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_column_major_when_faster_same_values_same_parameters(monkeypatch, name):
    model = tiny_model(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    parameters = [id(p) for p in model.parameters()]
    logits = model(PROMPT).logits
    with_costs(monkeypatch, as_is=100.0, transposed=50.0)

    assert specula.tune_cpu_layout(model) is True
    assert linear_weights(model) and all(column_major(w) for w in linear_weights(model))
    assert [id(p) for p in model.parameters()] == parameters
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    torch.testing.assert_close(model(PROMPT).logits, logits, rtol=1e-5, atol=1e-5)


def test_kept_as_stored_when_not_faster(monkeypatch):
    model = tiny_model("llama")
    with_costs(monkeypatch, as_is=100.0, transposed=95.0)  # under the 10% it takes

    assert specula.tune_cpu_layout(model) is False
    assert all(w.is_contiguous() for w in linear_weights(model))


def test_tied_embeddings_transposed_once(monkeypatch):
    model = tiny_model("gemma3")  # ties lm_head to the input embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with_costs(monkeypatch, as_is=100.0, transposed=50.0)

    specula.tune_cpu_layout(model)
    assert column_major(model.lm_head.weight)


def test_real_timing_runs_and_generation_stays_exact(tmp_path):
    model = tiny_model("llama")
    changed = specula.tune_cpu_layout(model)  # whichever layout this machine prefers

    assert changed == all(column_major(w) for w in linear_weights(model))
    if changed:
        assert specula.tune_cpu_layout(model) is False  # nothing row-major left to change
    reference = hf_greedy(model, PROMPT, 30)
    out = specula.generate(model, PROMPT, Oracle(reference, 5), max_new_tokens=30)
    assert out.sequences.tolist() == reference.tolist()
    model.save_pretrained(tmp_path)  # safetensors needs contiguous tensors; save_pretrained makes them so
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_decision_remembered_per_machine_and_shapes(fresh_store, monkeypatch):
    with_costs(monkeypatch, as_is=100.0, transposed=50.0)
    assert specula.tune_cpu_layout(tiny_model("llama"), remember=True) is True

    monkeypatch.setattr(cpu_layout, "_pass_cost_ms", lambda model, repeats: pytest.fail("timed again"))
    model = tiny_model("llama", seed=1)  # other weights, same shapes: the decision stands
    assert specula.tune_cpu_layout(model, remember=True) is True
    assert all(column_major(w) for w in linear_weights(model))

    with_costs(monkeypatch, as_is=100.0, transposed=95.0)  # other shapes: timed, and remembered beside the first
    assert specula.tune_cpu_layout(tiny_model("gpt2"), remember=True) is False
    kept = {key: value for key, value in json.loads(fresh_store.read_text()).items() if '"cpu layout"' in key}
    assert sorted(kept.values()) == [False, True]
    store.forget()  # a new process: the decisions read from the file
    monkeypatch.setattr(cpu_layout, "_pass_cost_ms", lambda model, repeats: pytest.fail("timed again"))
    assert specula.tune_cpu_layout(tiny_model("gpt2"), remember=True) is False


def test_not_timed_while_other_programs_take_the_cpus(fresh_store, monkeypatch):
    """Busy as it would be timed: the weights stay as stored, nothing timed nor kept (mutant: timed whatever the
    load); quiet, the next process times and keeps it."""
    monkeypatch.setattr(store, "busy_now", lambda: True)
    monkeypatch.setattr(cpu_layout, "_pass_cost_ms", lambda model, repeats: pytest.fail("timed"))
    model = tiny_model("llama")
    assert specula.tune_cpu_layout(model, remember=True) is False
    assert not any(column_major(w) for w in linear_weights(model))
    monkeypatch.setattr(store, "busy_now", lambda: False)
    store.forget()
    with_costs(monkeypatch, as_is=100.0, transposed=50.0)
    assert specula.tune_cpu_layout(tiny_model("llama"), remember=True) is True


def test_unreadable_measurements_file_means_timing_again(fresh_store, monkeypatch):
    fresh_store.write_text("{not json")
    with_costs(monkeypatch, as_is=100.0, transposed=50.0)
    assert specula.tune_cpu_layout(tiny_model("llama"), remember=True) is True
