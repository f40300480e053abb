"""A measurement made while other programs took the CPUs is used by its run and not kept: what the store keeps, and
every later run decides by, is the machine's (specula.machine.load, specula.machine.store)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from specula.machine import load, store
from specula.policy import kept_costs


class Machine:
    """A fake ``/proc/stat``: the CPUs' busy seconds, this process's and the wall clock, advanced by :meth:`spend`."""

    def __init__(self) -> None:
        self.busy = self.own = self.wall = 0.0

    def spend(self, wall: float, own: float, others: float) -> None:
        self.wall += wall
        self.own += own
        self.busy += own + others

    def __call__(self) -> tuple[float, float, float]:
        return self.busy, self.own, self.wall


@pytest.fixture
def machine(monkeypatch):
    fake = Machine()
    monkeypatch.setattr(load, "cpu_seconds", fake)
    monkeypatch.setattr(load, "BUSY", 0.25)  # (the suite's conftest turns the check off)
    monkeypatch.setattr(load, "GRAIN", 0.0)
    monkeypatch.setattr(load, "_READINGS", load.deque(maxlen=64))  # (readings of this fake clock only)
    return fake


def test_the_worked_example(machine) -> None:
    meter = load.LoadMeter()
    machine.spend(wall=2.0, own=3.0, others=0.5)
    assert meter.others() == pytest.approx(0.25) and meter.disturbed()
    meter.restart()
    machine.spend(wall=2.0, own=3.9, others=0.1)
    assert meter.others() == pytest.approx(0.05) and not meter.disturbed()


def test_a_short_span_is_not_disturbed_by_the_counters_ticks(machine, monkeypatch) -> None:
    """Over 0.1 s the CPUs' counters (a tick a CPU each end, two CPUs) may read 0.04 s more than this process ran."""
    monkeypatch.setattr(load, "GRAIN", 0.04)
    meter = load.LoadMeter()
    machine.spend(wall=0.1, own=0.16, others=0.04)
    assert meter.others() == pytest.approx(0.0) and not meter.disturbed()
    machine.spend(wall=0.1, own=0.1, others=0.1)
    assert meter.disturbed()


def test_a_span_too_short_for_the_counters_is_judged_with_the_time_before_it(machine, monkeypatch) -> None:
    """A 20 ms measurement while another program spins on a CPU: its own span, less the counters' ticks, shows
    nothing; judged over the half second before it too, it is disturbed; after a quiet half second it is not (mutant:
    the span as it is)."""
    monkeypatch.setattr(load, "GRAIN", 0.04)
    machine.spend(wall=1.0, own=1.0, others=0.0)
    load.LoadMeter()  # (a reading: what came before, say the model's load)
    machine.spend(wall=0.6, own=0.6, others=0.6)  # another program spinning
    meter = load.LoadMeter()
    machine.spend(wall=0.02, own=0.02, others=0.02)
    assert meter.disturbed()
    machine.spend(wall=1.0, own=1.0, others=0.0)
    load.LoadMeter()
    machine.spend(wall=0.6, own=0.6, others=0.0)  # quiet again
    meter = load.LoadMeter()
    machine.spend(wall=0.02, own=0.02, others=0.0)
    assert not meter.disturbed() and meter.others() == pytest.approx(0.0)


def test_a_measurement_made_while_others_took_the_cpus_is_used_but_not_kept(machine, fresh_store) -> None:
    """Busy: the run uses what it measured (once), the file keeps nothing, the next process measures again and, quiet,
    keeps that (mutant: kept whatever the load, the busy value would be read back for good)."""
    made = []

    def measure(value: float, others: float):
        def run():
            machine.spend(wall=1.0, own=1.8, others=others)
            made.append(value)
            return value

        return run

    key = store.key(__import__("torch").device("cpu"), "pass costs", "a model")
    assert store.shared().get(key, measure(2.0, others=1.0)) == 2.0  # a core busy meanwhile
    assert store.shared().get(key, measure(3.0, others=0.0)) == 2.0 and made == [2.0]  # (this process: as measured)
    assert not fresh_store.exists() or key not in json.loads(fresh_store.read_text())
    store.forget()  # the next process
    assert store.shared().get(key, measure(1.3, others=0.05)) == 1.3
    store.forget()
    assert store.shared().get(key, measure(9.0, others=0.0)) == 1.3 and made == [2.0, 1.3]


def test_a_check_of_bits_is_kept_whatever_the_load(machine, fresh_store) -> None:
    """A check that compares bits, not times (``timed=False``: whether passes round alike), made while a core was
    busy, is kept, and the next process reads it back (mutant: judged by the load like a timing)."""
    made = []

    def check():
        machine.spend(wall=1.0, own=1.8, others=1.0)
        made.append(True)
        return True

    key = store.key(__import__("torch").device("cpu"), "invariant passes", "a model")
    assert store.shared().get(key, check, timed=False) is True
    store.forget()  # the next process
    assert store.shared().get(key, check, timed=False) is True and made == [True]


def test_busy_now_reads_the_last_half_second_waiting_for_it_where_the_process_is_younger(machine, monkeypatch) -> None:
    """Another program spinning on a CPU over the last half second is busy, one that stopped before it is not; a
    process whose first reading is younger waits for the rest of the half second (mutants: the whole past read, no
    wait)."""
    waited = []
    monkeypatch.setattr(load.time, "sleep", lambda s: waited.append(s) or machine.spend(wall=s, own=0.0, others=s))
    load._reading()  # (specula imported)
    machine.spend(wall=0.2, own=0.2, others=0.0)
    assert load.busy_now() and waited == [pytest.approx(0.3)]  # (the 0.3 s waited for: another program spinning)
    machine.spend(wall=0.6, own=0.6, others=0.0)  # it stopped: quiet since
    assert not load.busy_now() and len(waited) == 1
    machine.spend(wall=5.0, own=5.0, others=5.0)
    machine.spend(wall=0.2, own=0.2, others=0.0)  # (readings: the load of the moment, say a model loading)
    load._reading()
    machine.spend(wall=0.2, own=0.2, others=0.0)
    load._reading()
    machine.spend(wall=0.6, own=0.6, others=0.0)
    assert not load.busy_now()
    machine.spend(wall=0.6, own=0.6, others=0.6)
    assert load.busy_now()


def test_a_measurement_that_would_start_while_others_take_the_cpus_is_not_made(machine, fresh_store, capsys) -> None:
    """Busy as it would start: what ``busy`` gives is taken, nothing measured nor kept, and stderr says so; the next
    process, quiet, measures and keeps (mutant: ``busy`` ignored, the measurement made)."""
    made = []

    def measure():
        machine.spend(wall=1.0, own=1.8, others=0.0)
        made.append(1.3)
        return 1.3

    key = store.key(__import__("torch").device("cpu"), "exact pass", "a model")
    load._reading()  # (specula imported)
    machine.spend(wall=1.0, own=1.0, others=1.0)  # a core busy
    assert store.shared().get(key, measure, busy=lambda: 9.0) == 9.0 and not made
    assert store.shared().get(key, measure, busy=lambda: 8.0) == 9.0  # (this process: as taken)
    store.shared().tell()
    assert "1 measurement(s) not made, defaults taken" in capsys.readouterr().err
    assert not fresh_store.exists() or key not in json.loads(fresh_store.read_text())
    store.forget()  # the next process, quiet
    machine.spend(wall=1.0, own=1.0, others=0.0)
    assert store.shared().get(key, measure, busy=lambda: 9.0) == 1.3 and made == [1.3]
    store.forget()
    assert store.shared().get(key, measure, busy=lambda: 9.0) == 1.3 and made == [1.3]


def test_a_busy_runs_correction_holds_for_that_run_only(machine, fresh_store) -> None:
    """A kept table underpricing a run's passes is corrected in that run; kept only where other programs did not take
    the CPUs meanwhile."""
    for others, kept in ((1.0, False), (0.0, True)):
        costs = kept_costs.KeptCosts(1, 34, 33, kept=f"corrections {others}")
        for width in kept_costs.WIDTHS:
            costs.record(width, 1.0 + 0.1 * (width - 1))
        machine.spend(wall=10.0, own=18.0, others=10.0 * others)
        costs.check(1, 1.0)
        for _ in range(kept_costs.STRIKES):  # (spans between plain passes)
            for _ in range(kept_costs.SPAN):
                costs.check(5, 5.0)  # (the table says 1.4)
            costs.check(1, 1.0)
        assert costs.seconds()[4] == pytest.approx(5.0)
        assert (costs.kept in store.shared().known) is kept


def test_a_program_spinning_on_a_cpu_is_seen() -> None:
    """The real ``/proc/stat``: another process spinning for a second took about one CPU."""
    if load.cpu_seconds() is None:
        pytest.skip("no /proc/stat on this system: nothing is known of other programs (every measurement is kept)")
    meter = load.LoadMeter()
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"]
    )
    spinner.wait(timeout=30)
    time.sleep(0.05)
    assert meter.others() > 0.5
