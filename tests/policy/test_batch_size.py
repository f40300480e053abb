"""The default batch size: the one whose passes make the most tokens per second, as measured."""

from __future__ import annotations

import pytest
from architectures import tiny_causal_lm
from tiny_models import tiny_model

from specula.machine import timing
from specula.machine.profile import profile_of
from specula.policy import batch_size
from specula.verifier.runner import CachedModel


@pytest.mark.parametrize(
    "cost, expected",
    [
        (lambda rows: 1.0, 8),  # a pass costs the same whatever its rows (a GPU far from full): the largest
        (lambda rows: float(rows), 1),  # a pass costs by the row (a full CPU): one at a time
        (lambda rows: 1.0 if rows <= 4 else rows / 4, 4),  # flat up to 4 rows, then by the row
        (lambda rows: 1.0 if rows <= 2 else 1.05 * rows / 2, 2),  # 4 rows would gain under 10%
    ],
)
def test_the_fastest_batch_size_follows_the_pass_costs(monkeypatch, cost, expected) -> None:
    clock = [0.0]
    monkeypatch.setattr(timing, "CLOCK", lambda: clock[0])
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits):
        clock[0] += cost(len(blocks))
        return forward_rows(self, blocks, num_logits)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    model = tiny_model("llama")
    profile_of(model).batch_size = None
    assert batch_size.fastest_batch_size(model, largest=8) == expected
    assert batch_size.fastest_batch_size(model, largest=1) == 1


@pytest.mark.parametrize("busy_from", [4, 9, 14])
def test_a_machine_that_gets_busy_during_the_measurement_does_not_change_the_size(monkeypatch, busy_from) -> None:
    """Passes cost the same whatever their rows (the largest is fastest), until another program makes every pass 3x
    slower: each size is weighed against a one-row pass timed at about the same moment, so the load changes
    nothing. (The mutant that compares the sizes' own rates stops at the size measured before the load.)"""
    clock, passes = [0.0], [0]
    monkeypatch.setattr(timing, "CLOCK", lambda: clock[0])
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits):
        passes[0] += 1
        clock[0] += 3.0 if passes[0] >= busy_from else 1.0
        return forward_rows(self, blocks, num_logits)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    model = tiny_model("llama")
    profile_of(model).batch_size = None
    assert batch_size.fastest_batch_size(model, largest=8) == 8
    clock[0], passes[0] = 0.0, 0
    assert batch_size.fastest_batch_size(model, largest=8) == 8 and passes[0] == 0  # (measured once)
    assert batch_size.fastest_batch_size(model, largest=8, again=True) == 8 and passes[0] > 0


def test_the_kept_size_is_not_measured_while_other_programs_take_the_cpus(fresh_store, monkeypatch) -> None:
    """Busy as it would be measured: the largest size (the cache's budget bounds it), nothing measured nor kept
    (mutant: measured whatever the load); quiet, the next process measures and keeps it."""
    from specula.machine import store

    monkeypatch.setattr(store, "busy_now", lambda: True)
    monkeypatch.setattr(batch_size, "fastest_batch_size", lambda *args, **kwargs: pytest.fail("measured"))
    model = tiny_model("llama")
    assert batch_size.kept_batch_size(model, largest=8) == 8
    monkeypatch.setattr(store, "busy_now", lambda: False)
    monkeypatch.setattr(batch_size, "fastest_batch_size", lambda *args, **kwargs: 2)
    store.forget()
    assert batch_size.kept_batch_size(model, largest=8) == 2
    monkeypatch.setattr(batch_size, "fastest_batch_size", lambda *args, **kwargs: pytest.fail("measured again"))
    store.forget()
    assert batch_size.kept_batch_size(model, largest=8) == 2


def test_models_that_cannot_be_batched_get_one() -> None:
    assert batch_size.fastest_batch_size(tiny_causal_lm("zaya"), largest=8) == 1  # (its state in its attention)
    assert batch_size.fastest_batch_size(tiny_causal_lm("mamba"), largest=4) in (1, 2, 4)  # (rows computed, not copied)
