"""How many CPU threads an ordinary verification pass runs with: torch's, or one where that is faster now.

On a machine another program keeps busy, torch's threads wait for the slowest of them at every operation, and a
pass over several tokens loses most (one thread can then be several times faster than two: docs/hardware.md). So
while other programs take the CPUs (:mod:`specula.machine.load`, read every :data:`WINDOW` seconds), each ordinary
pass over several tokens runs with the thread count whose recent passes of its shape were cheaper
(:class:`ThreadChoice`), and every :data:`EVERY`-th pass of a shape runs with the other one, so that the choice
follows the machine both ways at a bounded cost. On a quiet machine every pass keeps torch's count: exploring one
thread there only costs (a file of a few requests has more shapes of pass than it has passes to learn them in).
One-token steps and row-exact passes keep torch's thread count (their bits are ``model.generate``'s).
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

EVERY = 32  # one pass of a shape in this many runs with the thread count not chosen, to measure it again
KEEP = 4  # recent passes kept per shape and thread count
WINDOW = 2.0  # seconds over which what other programs take of the CPUs is read
_KERNELS = threading.Lock()  # (numba's fallback threading layer takes one parallel call at a time)


class ThreadChoice:
    """The thread count of each shape of pass (``(rows, tokens a row)``, tokens taken by powers of two: passes of
    4 to 7 tokens share one), from the recent times of both counts."""

    def __init__(
        self, threads: int, clock: Callable[[], float] = time.perf_counter, busy: Callable[[], bool] | None = None
    ) -> None:
        self.counts = (threads, 1)
        self.clock = clock
        self.busy = busy or OthersBusy()  # whether other programs take the CPUs now
        self.seconds: dict[tuple, deque] = {}  # (shape, threads): recent seconds
        self.passes: dict[tuple, int] = {}  # passes per shape

    def pick(self, shape: tuple) -> int:
        """The thread count for the next pass of ``shape``: torch's on a quiet machine; while other programs take
        the CPUs, each count until both were timed, then the cheaper by the lower median of recent passes, but every
        :data:`EVERY`-th pass the other."""
        if not self.busy():
            return self.counts[0]
        shape = _bucket(shape)
        count = self.passes.get(shape, 0)
        self.passes[shape] = count + 1
        estimates = [self.seconds.get((shape, threads)) for threads in self.counts]
        if not all(estimates):
            return self.counts[count % 2]
        cheaper = min(range(2), key=lambda i: lower_median(estimates[i]))
        return self.counts[1 - cheaper] if count % EVERY == EVERY - 1 else self.counts[cheaper]

    @contextlib.contextmanager
    def applied(self, shape: tuple) -> Iterator[None]:
        """Within the block (one pass of ``shape``), torch runs with the picked thread count, and the block's time
        is recorded for it."""
        threads, before = self.pick(shape), torch.get_num_threads()
        shape = _bucket(shape)
        torch.set_num_threads(threads)
        started = self.clock()
        try:
            yield
        finally:
            torch.set_num_threads(before)
        self.seconds.setdefault((shape, threads), deque(maxlen=KEEP)).append(self.clock() - started)


class OthersBusy:
    """Whether other programs took :data:`~specula.machine.load.BUSY` of the CPUs over the last :data:`WINDOW`
    seconds or so (quiet until the first window is read; busy where that cannot be read, so that the choice is
    measured)."""

    def __init__(self) -> None:
        self.meter, self.since, self.state = LoadMeter(), time.monotonic(), False

    def __call__(self) -> bool:
        if time.monotonic() - self.since >= WINDOW:
            others = self.meter.others()
            self.state = others is None or others >= BUSY
            self.meter.restart()
            self.since = time.monotonic()
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
    kernel calls: docs/hardware.md). torch's own OpenMP read its settings when it loaded, so it keeps them."""
    asked = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        _touch(np.zeros(2))
    finally:
        if asked is None:
            del os.environ["OMP_WAIT_POLICY"]


@njit(cache=True, parallel=True)
def _touch(x: np.ndarray) -> None:
    """A parallel call that does nothing: numba starts its pool at the first."""
    for i in prange(len(x)):
        x[i] = 0.0
