"""How much of the CPUs other programs took while a measurement ran: a measurement made while they took much is
used for the run at hand but not kept, so that what the store keeps (and every later run decides by) is the
machine's, not the moment's.

Read from ``/proc/stat`` (every CPU's busy time, the hypervisor's steal included) less this process's own CPU time;
where there is no ``/proc/stat`` (not Linux) nothing is known, and every measurement is kept.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

BUSY = 0.25  # CPUs' worth of time other programs took, on average over a measurement, that makes it disturbed
# what the CPUs' busy time may read high by over a span: a tick of each CPU's counter at either end
GRAIN = 2 * (os.cpu_count() or 1) / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.0
MIN_SPAN = 0.5  # seconds: a shorter span is judged with the time just before it, back to this long
_READINGS: deque = deque(maxlen=64)  # recent readings of cpu_seconds(), oldest first, at least MIN_SPAN / 16 apart


def cpu_seconds() -> tuple[float, float, float] | None:
    """(seconds every CPU was busy so far, seconds this process ran so far, wall seconds now); ``None`` where the
    CPUs' busy time is not readable."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (
        (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
        time.process_time(),
        time.monotonic(),
    )


def _reading() -> tuple[float, float, float] | None:
    """:func:`cpu_seconds`, kept among the recent readings (:data:`_READINGS`) where the last is older than
    :data:`MIN_SPAN` / 16."""
    now = cpu_seconds()
    if now is not None and (not _READINGS or now[2] - _READINGS[-1][2] >= MIN_SPAN / 16 or now[2] < _READINGS[-1][2]):
        _READINGS.append(now)
    return now


def busy_now() -> bool:
    """Whether other programs took at least :data:`BUSY` of the CPUs over the last :data:`MIN_SPAN` seconds (since
    this process's first reading, made as specula was imported, where that is younger: waiting for the rest). Not
    where that cannot be read."""
    now = _reading()
    if now is None:
        return False
    if now[2] - _READINGS[0][2] < MIN_SPAN:
        time.sleep(min(MIN_SPAN - (now[2] - _READINGS[0][2]), MIN_SPAN))
        now = _reading()
    earlier = [reading for reading in _READINGS if reading[2] <= now[2] - MIN_SPAN]
    start = earlier[-1] if earlier else _READINGS[0]
    return now[2] > start[2] and _others(start, now) >= BUSY


def _others(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """CPUs' worth of time other programs took on average between two readings (beyond :data:`GRAIN`)."""
    busy, own, wall = (after - before for after, before in zip(end, start))
    return max(busy - own - GRAIN, 0.0) / wall


class LoadMeter:
    """What other programs took of the CPUs since it was made (or :meth:`restart` ed); over a span shorter than
    :data:`MIN_SPAN`, since the latest reading at least that long before (else the oldest kept): over a few
    milliseconds the counters' ticks (:data:`GRAIN`) hide a busy CPU, and a measurement that short would be kept as
    quiet.

    Worked example: over 2 wall seconds the CPUs were busy 3.5 s, this process ran 3 s of it: others took 0.25 of
    a CPU on average, which is :data:`BUSY`, so the span was disturbed."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._start = _reading()

    def others(self) -> float | None:
        """CPUs' worth of time other programs took on average since the start (beyond what the counters' ticks
        may add: :data:`GRAIN`); ``None`` where unknown or no time passed."""
        now = _reading()
        if now is None or self._start is None or now[2] <= self._start[2]:
            return None
        start = self._start
        if now[2] - start[2] < MIN_SPAN:
            earlier = [reading for reading in _READINGS if reading[2] <= now[2] - MIN_SPAN]
            start = min(start, earlier[-1] if earlier else min(_READINGS, key=_wall), key=_wall)
        return _others(start, now)

    def disturbed(self) -> bool:
        """Whether other programs took at least :data:`BUSY` of the CPUs since the start."""
        others = self.others()
        return others is not None and others >= BUSY


def _wall(reading: tuple[float, float, float]) -> float:
    return reading[2]


_reading()  # (the first: what a measurement that starts soon after is judged by, busy_now)
