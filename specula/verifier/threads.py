"""How many CPU threads an ordinary verification pass runs with: torch's, or one where that is faster now.

On a machine another program keeps busy, torch's threads wait for the slowest of them at every operation, and a
pass over several tokens loses most (one thread can then be several times faster than two: docs/hardware.md; on the
2-core AMX Xeon with a core busy, SmolLM2's passes on two threads took 13-20x their quiet time, on one about 1.6x).
So while other programs take the CPUs (:mod:`specula.machine.load`, read :data:`FIRST_WINDOW` seconds after the
first pass, then every :data:`WINDOW` seconds), each ordinary pass runs with the thread count that recent passes of
the same shapes, timed with both while busy, found cheaper (one thread before any shape was timed with both), and
tries the other one where what it would lose is at most :data:`CREDIT` of the time passes took since it was last
tried (:class:`ThreadChoice`): the choice follows the machine both ways at a bounded cost. On a quiet machine every
pass keeps torch's count and nothing is timed: exploring one thread there only costs. One-token steps (but invariant
passes' steps, two-token passes) and row-exact passes keep torch's thread count (their bits are ``model.generate``'s).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Callable

import numba
import numpy as np
import torch
from numba import njit, prange

from ..machine.load import BUSY, LoadMeter
from ..machine.profile import profile_of
from ..machine.timing import lower_median

CREDIT = 0.05  # the count not chosen is tried where it would lose at most this share of the time since its last try
PRIOR = 2.0  # how much dearer the count not chosen is taken to be before any shape was timed with both
KEEP = 4  # recent passes kept per shape and thread count
FIRST_WINDOW = 0.25  # seconds after the first pass over which what other programs take of the CPUs is first read
WINDOW = 2.0  # seconds over which it is read after that
_KERNELS = threading.Lock()  # (numba's fallback threading layer takes one parallel call at a time)


class ThreadChoice:
    """The thread count of each pass while other programs take the CPUs, from the recent times of both counts on
    shapes of pass (``(rows, tokens a row)``, tokens taken by powers of two: passes of 4 to 7 tokens share one)
    timed with both.

    Worked example (two threads): busy, nothing timed yet: one thread. After passes of shape (4, 1) on one thread
    at 0.05 s each, two threads are tried there once 0.05 * (PRIOR - 1) <= CREDIT * the time since: 20 passes on.
    That one takes 0.5 s: two threads are 10x dearer on the shapes timed with both, so one thread goes on, and two
    are tried again after 0.05 * 9 / CREDIT = 9 s of passes."""

    def __init__(
        self, threads: int, clock: Callable[[], float] = time.perf_counter, busy: Callable[[], bool] | None = None
    ) -> None:
        self.counts = (threads, 1)
        self.clock = clock
        self.busy = busy or OthersBusy()  # whether other programs take the CPUs now
        self.seconds: dict[tuple, deque] = {}  # (shape, threads): recent seconds, timed while busy
        self.since = 0.0  # seconds of busy passes since the count not chosen was last tried

    def dearer(self) -> float | None:
        """torch's count's time over one thread's: the lower median over shapes timed with both of each one's
        ratio of lower medians; ``None`` before any."""
        ratios = [
            lower_median(self.seconds[shape, self.counts[0]]) / lower_median(times)
            for (shape, threads), times in self.seconds.items()
            if threads == self.counts[1] and (shape, self.counts[0]) in self.seconds
        ]
        return lower_median(ratios) if ratios else None

    def pick(self, shape: tuple) -> int:
        """The thread count for the next pass of ``shape``: torch's on a quiet machine; while other programs take
        the CPUs, the count cheaper on the shapes timed with both (one thread before any), or the other where this
        shape was timed with the chosen one and trying the other here costs at most :data:`CREDIT` of the time
        since it was last tried."""
        if not self.busy():
            return self.counts[0]
        ratio = self.dearer()
        chosen = 0 if ratio is not None and ratio < 1 else 1
        worse = PRIOR if ratio is None else ratio if chosen else 1 / ratio
        mine = self.seconds.get((_bucket(shape), self.counts[chosen]))
        if mine and lower_median(mine) * (worse - 1) <= CREDIT * self.since:
            self.since = 0.0
            return self.counts[1 - chosen]
        return self.counts[chosen]

    @contextlib.contextmanager
    def applied(self, shape: tuple) -> Iterator[None]:
        """Within the block (one pass of ``shape``), torch runs with the picked thread count, and the block's time
        is recorded for it while other programs take the CPUs."""
        threads = self.pick(shape)
        started = self.clock()
        with on_threads(threads):
            yield
        if threads != self.counts[0] or self.busy():
            elapsed = self.clock() - started
            self.seconds.setdefault((_bucket(shape), threads), deque(maxlen=KEEP)).append(elapsed)
            self.since += elapsed


@contextlib.contextmanager
def on_threads(count: int) -> Iterator[None]:
    """Within the block, torch's operations (and so specula's kernels: :func:`kernel_threads`) run on ``count``
    threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class OthersBusy:
    """Whether other programs took :data:`~specula.machine.load.BUSY` of the CPUs over the last :data:`WINDOW`
    seconds or so (over the :data:`FIRST_WINDOW` seconds after the first call at first, quiet until it was read;
    busy where that cannot be read, so that the choice is measured)."""

    def __init__(self) -> None:
        self.meter, self.since, self.state, self.window = None, 0.0, False, FIRST_WINDOW

    def __call__(self) -> bool:
        if self.meter is None:
            self.meter, self.since = LoadMeter(), time.monotonic()
        elif time.monotonic() - self.since >= self.window:
            others = self.meter.others()
            self.state = others is None or others >= BUSY
            self.meter.restart()
            self.since, self.window = time.monotonic(), WINDOW
        return self.state


def _bucket(shape: tuple[int, int]) -> tuple[int, int]:
    """``(rows, tokens)`` with the tokens by power of two (1; 2-3; 4-7 ...)."""
    return shape[0], shape[1].bit_length()


def thread_choice(model: torch.nn.Module) -> ThreadChoice | None:
    """``model``'s :class:`ThreadChoice` (kept with it, so that later generations start from what earlier ones
    measured; again if torch's thread count changed): on a CPU with several threads, ``None`` elsewhere."""
    if next(model.parameters()).device.type != "cpu" or torch.get_num_threads() < 2:
        return None
    profile = profile_of(model)
    if profile.threads is None or profile.threads.counts[0] != torch.get_num_threads():
        profile.threads = ThreadChoice(torch.get_num_threads())
    return profile.threads


@contextlib.contextmanager
def kernel_threads() -> Iterator[None]:
    """Within the block, numba's parallel kernels (:mod:`.attend`, :mod:`.int8`) run on as many threads as torch's
    operations do now, one call at a time."""
    with _KERNELS:
        _pool_started()
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        yield


@functools.cache
def _pool_started() -> None:
    """Start numba's thread pool with idle threads that sleep at once: by default (OpenMP's) they spin for a while
    after each call, and took half the cores from torch's operations for as long (a prefill ran 2-4x slower between
    kernel calls: docs/hardware.md). torch's own OpenMP read its settings when it loaded, so it keeps them; its thread
    count is set back after (where numba's pool shares torch's OpenMP, starting it set the count to numba's: a process
    that had asked torch for one thread ran on all the cores after its first kernel call, its pytest workers on twice
    the cores there are)."""
    asked, threads = os.environ.get("OMP_WAIT_POLICY"), torch.get_num_threads()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        _touch(np.zeros(2))
    finally:
        if asked is None:
            del os.environ["OMP_WAIT_POLICY"]
        torch.set_num_threads(threads)


@njit(cache=True, parallel=True)
def _touch(x: np.ndarray) -> None:
    """A parallel call that does nothing: numba starts its pool at the first."""
    for i in prange(len(x)):
        x[i] = 0.0
