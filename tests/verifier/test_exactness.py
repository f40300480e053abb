"""Exact or ordinary verification, chosen by what exactness costs here: cheap -> exact, dear -> ordinary, asked ->
as asked; measured once and kept; in both modes a request decodes the same on every run, in one process or two."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from bf16_cases import CONFIGS, NEW_TOKENS, model, prompt

import specula
from specula.machine import store, timing
from specula.verifier import exactness
from specula.verifier.runner import CachedModel


@pytest.fixture
def exact_costs(monkeypatch, fresh_store):
    """Makes a row-exact pass cost ``costs[0]`` times an ordinary one on a fake clock (each pass advances it by 1.0,
    or by that many if row-exact), with the real measurement around it; records how often it was measured."""
    costs, measured, now = [1.0], [], [0.0]
    forward_rows = CachedModel.forward_rows

    def timed(self, *args, **kwargs):
        now[0] += costs[0] if self.row_exact is not None else 1.0
        return forward_rows(self, *args, **kwargs)

    measure = exactness._measure
    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    monkeypatch.setattr(timing, "CLOCK", lambda: now[0])
    monkeypatch.setattr(exactness, "_measure", lambda m: measured.append(m) or measure(m))
    return costs, measured


@pytest.mark.parametrize("cost, chosen", [(1.04, True), (exactness.THRESHOLD, True), (1.3, False), (2.5, False)])
def test_exactness_is_chosen_where_it_is_cheap(exact_costs, cost: float, chosen: bool) -> None:
    exact_costs[0][0] = cost
    choice = exactness.choose(model("llama"), None)
    assert choice.exact is chosen and choice.cost == pytest.approx(cost)
    assert ("bitwise model.generate" in str(choice)) is chosen and f"{cost:.2f}x" in str(choice)


def test_a_cheap_exactness_measured_while_the_machine_was_busy_is_taken_as_dear(exact_costs, monkeypatch) -> None:
    """Measured while other programs took the CPUs (not kept), a cheap exactness is not chosen: a busy machine's
    threads wait alike in both kinds of pass, and the answers must not follow the load; quiet, it is (mutant: the
    load not looked at)."""
    from specula.machine import load

    exact_costs[0][0] = 1.04
    monkeypatch.setattr(load.LoadMeter, "disturbed", lambda self: True)
    busy = exactness.choose(model("llama"), None)
    assert not busy.exact and "other programs" in str(busy) and busy.cost == pytest.approx(1.04)
    monkeypatch.setattr(load.LoadMeter, "disturbed", lambda self: False)
    store.forget()  # (the next process, quiet)
    assert exactness.choose(model("llama"), None).exact


def test_exactness_is_not_measured_while_the_machine_is_busy_as_it_would_start(exact_costs, monkeypatch) -> None:
    """Other programs taking the CPUs as it would be measured: nothing measured, taken as dear, said; quiet, the next
    process measures it (mutant: measured whatever the load)."""
    from specula.machine import store as store_module

    exact_costs[0][0] = 1.04
    monkeypatch.setattr(store_module, "busy_now", lambda: True)
    busy = exactness.choose(model("llama"), None)
    assert not busy.exact and not exact_costs[1] and "not measured while other programs" in str(busy)
    monkeypatch.setattr(store_module, "busy_now", lambda: False)
    store.forget()  # (the next process, quiet)
    assert exactness.choose(model("llama"), None).exact and len(exact_costs[1]) == 1


def test_asked_for_is_what_is_done_whatever_it_costs(exact_costs) -> None:
    costs, measured = exact_costs
    costs[0] = 3.0
    assert exactness.choose(model("llama"), True).exact and not exactness.choose(model("llama"), False).exact
    costs[0] = 1.0
    assert not exactness.choose(model("llama"), False).exact
    assert not measured  # (nothing measured when asked)
    out = specula.generate(
        model("llama"), prompt(), specula.PromptLookup(), max_new_tokens=4, eos_token_id=[], exact=True
    )
    assert out.stats.exactness.exact and out.stats.exactness.reason == "asked"


def test_fp32_is_ordinary_unmeasured_and_plain_decoding_is_exact(exact_costs) -> None:
    _, measured = exact_costs
    assert not exactness.choose(model("llama", torch.float32), None).exact and not measured
    out = specula.generate(model("llama"), prompt(), None, max_new_tokens=4, eos_token_id=[])
    assert out.stats.exactness.exact and out.stats.exactness.reason == "plain" and not measured


def test_the_cost_is_measured_once_per_machine_and_model_and_kept(exact_costs, fresh_store) -> None:
    costs, measured = exact_costs
    costs[0] = 1.5
    assert not exactness.choose(model("llama"), None).exact
    costs[0] = 1.0  # a later measurement would choose otherwise: none is made
    assert not exactness.choose(model("llama"), None).exact
    store.forget()  # as a new process on this machine: from the file
    assert not exactness.choose(model("llama"), None).exact and len(measured) == 1
    assert any('"exact pass"' in key for key in json.loads(fresh_store.read_text()))
    exactness.choose(model("qwen2"), None)  # another model: its own measurement
    assert len(measured) == 2


def test_the_choice_is_in_the_stats_the_answer_lines_and_the_summary(exact_costs) -> None:
    exact_costs[0][0] = 2.0
    out = specula.generate(model("llama"), prompt(), specula.PromptLookup(), max_new_tokens=4, eos_token_id=[])
    assert not out.stats.exactness.exact and out.stats.exactness.cost == pytest.approx(2.0)
    assert "ordinary verification" in str(out.stats) and "2.00x" in str(out.stats)
    assert all(row.exactness is out.stats.exactness for row in out.stats.rows)


def test_a_request_decodes_the_same_on_every_run_in_one_process_and_in_two(tmp_path) -> None:
    """bf16, exact and ordinary, the cost model timing the passes where it may: twice here, once in a fresh
    interpreter, the same tokens."""
    runs = {}
    for exact in (True, False):
        runs[exact] = [
            specula.generate(
                model("qwen2"),
                prompt(),
                specula.PromptLookup(),
                max_new_tokens=NEW_TOKENS,
                eos_token_id=[],
                exact=exact,
            )
            .sequences[0]
            .tolist()
            for _ in range(2)
        ]
        assert runs[exact][0] == runs[exact][1]
    script = textwrap.dedent("""
        import json, sys
        sys.path[:0] = sys.argv[1:]
        import specula
        from bf16_cases import CONFIGS, NEW_TOKENS, model, prompt
        print(json.dumps({exact: specula.generate(model("qwen2"), prompt(), specula.PromptLookup(),
                                                  max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                  exact=exact).sequences[0].tolist() for exact in (True, False)}))
    """)
    tests = str(__import__("pathlib").Path(__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", script, tests], capture_output=True, text=True, check=True)
    other = json.loads(done.stdout.strip().splitlines()[-1])
    assert other == {"true": runs[True][0], "false": runs[False][0]}


def test_a_models_measurements_are_its_own_by_shape_dtype_and_kind_of_weight() -> None:
    """Pass costs and the rest are kept by model_key: a model with one weight quantized (here: in another dtype, or a
    tensor subclass, as torchao's weights are) is measured apart from the plain one, the same model alike."""

    class Quantized(torch.Tensor):
        pass

    def fresh() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32)

    plain, other, subclassed = fresh(), fresh(), fresh()
    assert exactness.model_key(plain) == exactness.model_key(fresh())
    layer = other.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.data.bfloat16(), requires_grad=False)
    assert exactness.model_key(other) != exactness.model_key(plain)
    layer = subclassed.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.data.as_subclass(Quantized), requires_grad=False)
    assert exactness.model_key(subclassed) != exactness.model_key(plain)
