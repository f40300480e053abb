"""The one clock, the one pass timer and the robust statistics every measurement of specula uses."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

import torch

CLOCK = time.perf_counter  # what every measurement is timed with (tests put a fake clock here)
TIMING_REPEATS = 5


def time_pass(run: Callable[[], object], device: torch.device | None = None) -> float:
    """The seconds ``run()`` (one pass of a model on ``device``) takes by :data:`CLOCK`, the device's queued work
    included."""
    started = CLOCK()
    run()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return CLOCK() - started


def lower_median(values: Iterable[float]) -> float:
    """The median, the lower of the two middle values for an even count (other work only ever adds time).

    >>> lower_median([3.0, 1.0, 2.0, 9.0])
    2.0
    """
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


def seconds_of(
    run: Callable[[], object], clock: Callable[[], float] | None = None, repeats: int = TIMING_REPEATS
) -> float:
    """The fastest of ``repeats`` runs of ``run`` after one warm-up (other work on the machine only ever adds time,
    so the minimum is the steadiest estimate)."""
    clock = clock or CLOCK
    run()
    times = []
    for _ in range(repeats):
        started = clock()
        run()
        times.append(clock() - started)
    return min(times)


def cheapest(strategies: dict[Hashable, Callable[[], object]], clock: Callable[[], float] | None = None) -> Hashable:
    """The name of the fastest of ``strategies`` (each already known to be exact); the first on a tie.

    >>> ticks = iter(range(100))
    >>> cheapest({"a": lambda: [next(ticks) for _ in range(5)], "b": lambda: None}, clock=lambda: next(ticks))
    'b'
    """
    costs = {name: seconds_of(run, clock) for name, run in strategies.items()}
    return min(costs, key=costs.get)
