"""The thread count of ordinary passes, with a fake clock: torch's while that is faster, one thread while another
program makes torch's threads wait, back again when the machine is quiet; one-token steps and row-exact passes keep
torch's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from bf16_cases import NEW_TOKENS, model, prompt, reference
from helpers import Oracle

import specula
from specula.machine import store
from specula.verifier import threads as threads_module
from specula.verifier.threads import CREDIT, KEEP, ThreadChoice


def test_the_cheaper_count_is_chosen_both_ways_at_a_bounded_cost() -> None:
    """While other programs take the CPUs (the load read says so throughout: ``busy``): where two threads are
    cheaper, then where one is, then two again, each phase ends mostly on the cheaper count, losing at most about
    :data:`CREDIT` of its time to trying the other (mutants: never tried, tried regardless of its cost)."""
    now, busy = [0.0], [False]
    choice = ThreadChoice(2, clock=lambda: now[0], busy=lambda: True)
    cost = {False: {2: 1.0, 1: 1.3}, True: {2: 4.5, 1: 1.5}}  # quiet: two threads cheaper; busy: one

    def run_pass(shape=(1, 9)) -> int:
        with choice.applied(shape):
            used = torch.get_num_threads()
            now[0] += cost[busy[0]][used]
        return used

    def phase(cheaper: int) -> None:
        used = [run_pass() for _ in range(400)]
        last, table = used[-300:], cost[busy[0]]
        lost = sum(table[count] - table[cheaper] for count in last)
        assert last.count(cheaper) > len(last) / 2 and 0 < lost <= 1.5 * CREDIT * sum(map(table.get, last))

    before = torch.get_num_threads()
    phase(2)
    assert torch.get_num_threads() == before  # (restored after each pass)
    busy[0] = True
    phase(1)
    busy[0] = False
    phase(2)
    run_pass((1, 12))
    assert len(choice.seconds[(1, 4), 2]) == KEEP  # (passes of 8 to 15 tokens share one shape)


def test_a_quiet_machine_keeps_torchs_count_and_explores_nothing() -> None:
    """Where other programs take nothing, every pass runs with torch's threads, even where one thread would be
    cheaper, and nothing is timed: exploring there only costs. Once the load read says busy, one thread at once
    (mutant: the load ignored, passes on one thread from the start)."""
    now, others = [0.0], [False]
    choice = ThreadChoice(2, clock=lambda: now[0], busy=lambda: others[0])

    def run_pass(shape=(4, 1)) -> int:
        with choice.applied(shape):
            used = torch.get_num_threads()
            now[0] += 1.0 if used == 1 else 3.0  # (one thread cheaper)
        return used

    assert [run_pass() for _ in range(100)] == [2] * 100 and not choice.seconds
    others[0] = True
    assert [run_pass() for _ in range(4)] == [1] * 4


def test_the_load_is_read_over_a_window(monkeypatch) -> None:
    """``OthersBusy``: quiet until its first window (from its first call) was read, then what the load meter says,
    read again each window."""
    readings, clock = iter([0.1, 0.9, None]), [0.0]
    monkeypatch.setattr(threads_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads_module.LoadMeter, "others", lambda self: next(readings))
    busy = threads_module.OthersBusy()
    clock[0] += 100.0  # (made long before its first call: the model's load)
    assert busy() is False
    clock[0] += threads_module.FIRST_WINDOW
    assert busy() is False  # (0.1 of a CPU)
    clock[0] += threads_module.WINDOW / 2
    assert busy() is False  # (within the window: not read)
    clock[0] += threads_module.WINDOW
    assert busy() is True  # (0.9)
    clock[0] += threads_module.WINDOW
    assert busy() is True  # (unknown: measured)


@pytest.fixture
def two_threads_at_least():
    """torch with two threads at least: one (a parallel test worker's share of two cores) leaves nothing to choose."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    yield
    torch.set_num_threads(threads)


def test_only_ordinary_fp32_passes_over_several_tokens_and_prefills_change_the_thread_count(
    monkeypatch, two_threads_at_least
) -> None:
    seen = []
    pick = ThreadChoice.pick

    def recording(self, shape):
        seen.append(shape)
        return pick(self, shape)

    monkeypatch.setattr(ThreadChoice, "pick", recording)
    fp32 = model("llama", torch.float32)
    expected = fp32.generate(
        prompt(), attention_mask=torch.ones_like(prompt()), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[]
    )
    out = specula.generate(
        fp32, prompt(), Oracle(expected, 8), max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == expected.tolist()
    assert seen and all(tokens > 1 for _, tokens in seen) and len(seen) < out.stats.passes + 1  # (not the steps)
    assert seen.count((0, prompt().shape[1])) == 1  # (the prompt's prefill: no rows)
    seen.clear()
    specula.generate(
        model("llama"),
        prompt(),
        Oracle(expected, 8),
        max_new_tokens=8,
        eos_token_id=[],
        exact=True,
        adaptive_draft=False,
    )
    specula.generate(
        model("llama"),
        prompt(),
        Oracle(expected, 8),
        max_new_tokens=8,
        eos_token_id=[],
        exact=False,
        adaptive_draft=False,
    )
    assert not seen  # bf16: row-exact, or ordinary whose rounding must not follow the clock
    assert threads_module.thread_choice(fp32) is threads_module.thread_choice(fp32)  # kept with the model


def test_fp32_prefills_take_one_thread_under_load(monkeypatch, two_threads_at_least) -> None:
    """fp32 with other programs taking the CPUs: the prompt's prefill runs on one thread (it waits for none), and the
    output is still model.generate's (mutant: prefills keep torch's count)."""
    counts = []
    forward = torch.nn.Module.__call__
    monkeypatch.setattr(threads_module.OthersBusy, "__call__", lambda self: True)
    fp32 = model("llama", torch.float32)
    threads_module.profile_of(fp32).threads = None  # (a new choice: nothing timed yet)
    expected = fp32.generate(
        prompt(), attention_mask=torch.ones_like(prompt()), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[]
    )

    def recording(module, *args, **kwargs):
        if module is fp32 and kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == prompt().shape[1]:
            counts.append(torch.get_num_threads())  # (the prefill: the prompt's tokens at once)
        return forward(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", recording)
    out = specula.generate(
        fp32, prompt(), Oracle(expected, 8), max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == expected.tolist() and counts == [1]


def test_invariant_passes_that_round_alike_on_one_thread_follow_the_load(
    fresh_store, monkeypatch, two_threads_at_least
) -> None:
    """bf16 invariant passes whose check holds on one thread too (the tiny Llama here) take the thread count the load
    calls for, steps included, and decode the same tokens under a load read as busy throughout as on a quiet
    machine; a stand-in product that rounds otherwise on one thread fails that part of the check, and the passes
    keep torch's count (mutant: one thread not checked)."""
    from specula.verifier import invariant

    model_ = model("llama")

    def decode() -> tuple[list, list]:
        seen = []
        pick = ThreadChoice.pick
        monkeypatch.setattr(ThreadChoice, "pick", lambda self, shape: seen.append(pick(self, shape)) or seen[-1])
        out = specula.generate(
            model_,
            prompt(),
            Oracle(reference("llama"), 6),
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            exact="invariant",
        )
        assert out.stats.exactness.invariant
        return out.sequences.tolist(), seen

    assert invariant.any_threads(model_)
    monkeypatch.setattr(threads_module.OthersBusy, "__call__", lambda self: False)
    quiet, seen = decode()
    assert seen and set(seen) == {torch.get_num_threads()}
    monkeypatch.setattr(threads_module.OthersBusy, "__call__", lambda self: True)
    threads_module.profile_of(model_).threads = None  # (a new choice: nothing timed yet)
    loaded, seen = decode()
    assert 1 in seen and loaded == quiet

    real_linear = torch.nn.functional.linear

    def on_one_thread_otherwise(x, weight, bias=None):
        return real_linear(x, weight, bias) * (1.0 + 0.01 * (torch.get_num_threads() == 1))

    monkeypatch.setattr(torch.nn.functional, "linear", on_one_thread_otherwise)
    from specula.verifier import runner

    monkeypatch.setattr(runner, "packed_for", lambda model, **_: None)  # (every product through the stand-in)
    monkeypatch.setenv("SPECULA_CALIBRATIONS", str(fresh_store.with_name("other.json")))
    store.forget()
    assert invariant.holds(model_) and not invariant.any_threads(model_)
    threads_module.profile_of(model_).threads = None
    _, seen = decode()
    assert not seen


def test_starting_numbas_pool_leaves_torchs_thread_count_as_asked(model_folder) -> None:
    """A process that asked torch for one thread keeps one after specula's first parallel kernel call (numba's pool,
    sharing torch's OpenMP once a model was loaded, had set the count to all the cores: each of CI's two pytest
    workers then ran on two threads). In a new process: the pool starts once a process (mutant: not set back fails)."""
    check = f"""
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
AutoModelForCausalLM.from_pretrained({str(model_folder)!r})
from specula.verifier import panels, threads
weight, x, out = panels.panels(torch.randn(64, 32)), torch.randn(3, 32), torch.empty(3, 64)
with threads.kernel_threads():
    panels.panel_matmul(x.numpy(), weight.panels.numpy(), out.numpy())
assert torch.get_num_threads() == 1, torch.get_num_threads()
"""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
