"""The thread count of ordinary passes, with a fake clock: torch's while that is faster, one thread while another
program makes torch's threads wait, back again when the machine is quiet; one-token steps and row-exact passes keep
torch's."""

from __future__ import annotations

import pytest
import torch
from bf16_cases import NEW_TOKENS, model, prompt
from helpers import Oracle

import specula
from specula.verifier import threads as threads_module
from specula.verifier.threads import EVERY, ThreadChoice


def test_the_cheaper_count_is_chosen_both_ways_at_a_bounded_cost() -> None:
    """While other programs take the CPUs (the load read says so throughout: ``busy``)."""
    now, busy = [0.0], [False]
    choice = ThreadChoice(2, clock=lambda: now[0], busy=lambda: True)

    def run_pass(shape=(1, 9)) -> int:
        with choice.applied(shape):
            used = torch.get_num_threads()
            # quiet: 2 threads 1.0, one 1.3; busy: 2 threads 4.5, one 1.5
            now[0] += (4.5 if busy[0] else 1.0) if used == 2 else (1.5 if busy[0] else 1.3)
        return used

    before = torch.get_num_threads()
    quiet = [run_pass() for _ in range(10 * EVERY)]
    assert torch.get_num_threads() == before  # (restored after each pass)
    assert quiet[-5 * EVERY :].count(2) == 5 * EVERY - 5  # torch's, but for one pass in EVERY
    busy[0] = True
    loaded = [run_pass() for _ in range(10 * EVERY)]
    assert loaded[-5 * EVERY :].count(1) == 5 * EVERY - 5  # one thread
    busy[0] = False
    again = [run_pass() for _ in range(10 * EVERY)]
    assert again[-5 * EVERY :].count(2) == 5 * EVERY - 5
    assert run_pass((4, 1)) in (1, 2) and choice.passes[(4, 1)] == 1  # shapes apart ...
    run_pass((1, 12))
    assert choice.passes[(1, 4)] == 30 * EVERY + 1  # ... but passes of 8 to 15 tokens share one


def test_a_quiet_machine_keeps_torchs_count_and_explores_nothing() -> None:
    """Where other programs take nothing, every pass runs with torch's threads, even where one thread timed cheaper
    (a warm-up, noise): exploring there only costs. Once the load read says busy, the choice is measured (mutant:
    the load ignored, passes on one thread at once)."""
    now, others = [0.0], [False]
    choice = ThreadChoice(2, clock=lambda: now[0], busy=lambda: others[0])

    def run_pass(shape=(4, 1)) -> int:
        with choice.applied(shape):
            used = torch.get_num_threads()
            now[0] += 1.0 if used == 1 else 3.0  # (one thread timed cheaper)
        return used

    assert [run_pass() for _ in range(3 * EVERY)] == [2] * 3 * EVERY and not choice.passes
    others[0] = True
    assert 1 in [run_pass() for _ in range(4)]


def test_the_load_is_read_over_a_window(monkeypatch) -> None:
    """``OthersBusy``: quiet until its first window was read, then what the load meter says, read again each window."""
    readings, clock = iter([0.1, 0.9, None]), [0.0]
    monkeypatch.setattr(threads_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads_module.LoadMeter, "others", lambda self: next(readings))
    busy = threads_module.OthersBusy()
    assert busy() is False
    clock[0] += threads_module.WINDOW
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


def test_only_ordinary_fp32_passes_over_several_tokens_change_the_thread_count(
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
    assert seen and all(tokens > 1 for _, tokens in seen) and len(seen) < out.stats.passes  # (not the prefill)
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
