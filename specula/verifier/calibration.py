"""Row-exact strategies chosen by cost on the machine at hand, and remembered on disk.

Each operation a row-exact pass computes (attention of one geometry, a linear layer of one weight shape) has
several ways to give every row the bits of its one-token step. Which of them are exact, and which is cheapest,
differs between CPUs, GPUs and torch builds, so :mod:`specula.verifier.row_exact` finds the exact ones by testing them on
data chosen to expose a changed summation order, times those, and keeps the cheapest. The choices are kept in a
JSON file (``$SPECULA_CALIBRATIONS``, else ``row_exact.json`` in specula's cache folder), keyed by what they depend
on: the device's model name and threads, torch's version and CPU capability, and the operation's shape and dtype.
A second process on the same machine starts at once; any change of key calibrates again.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import torch

TIMING_REPEATS = 5
CLOCK = time.perf_counter  # what strategies are timed with (tests put a fake clock here)
CALIBRATION_ROWS = 33  # the widest pass calibrated (32 drafts); a wider one chunks every linear layer row-exactly
TIMED_ROWS = 9  # strategies are timed on a typical pass: the last token and 8 drafts ...
TIMED_KEYS = 700  # ... after this many tokens
# How specula computes passes: part of every key, changed whenever what a kept measurement measured changes (pass
# costs and the cost of exactness follow how ordinary passes are computed), so that none outlives its subject.
PASSES = 3


def device_name(device: torch.device) -> str:
    """What a calibration on ``device`` depends on besides torch: the GPU's name, or the CPU's model and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} threads"


def calibration_key(device: torch.device, operation: str, *shape: Hashable) -> str:
    """The key of one operation's calibration on ``device``."""
    return json.dumps([device_name(device), torch.__version__, torch.backends.cpu.get_cpu_capability(), PASSES,
                       operation, *map(str, shape)])


def calibrations_path() -> Path:
    """Where calibrations are kept."""
    from ..hf.loading import cache_dir

    return Path(os.environ.get("SPECULA_CALIBRATIONS") or cache_dir() / "row_exact.json")


class Calibrations:
    """The calibrations file: read once, written whenever a new calibration is made (an unreadable or unwritable
    file only means calibrating again)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or calibrations_path()
        try:
            self.known: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.seconds = 0.0  # spent calibrating in this process
        self.made = 0  # calibrations made in this process (a pass that made one is no measure of its cost)
        self._told = False

    def get(self, key: str, calibrate: Callable[[], object]):
        """The calibration under ``key``: remembered, else made by ``calibrate()`` (JSON-serialisable) and kept."""
        if key not in self.known:
            started = time.perf_counter()
            value = calibrate()
            self.seconds += time.perf_counter() - started
            self.made += 1
            self.keep(key, value)
        return self.known[key]

    def keep(self, key: str, value: object) -> None:
        """Keep ``value`` (JSON-serialisable) under ``key``, replacing what was there."""
        if key not in self.known or self.known[key] != value:
            self.known[key] = value
            self._write()

    def drop(self, operation: str) -> None:
        """Forget what is kept of ``operation`` (tests: each starts without what the ones before it kept)."""
        dropped = [key for key in self.known if f", {json.dumps(operation)}, " in key]
        for key in dropped:
            del self.known[key]
        if dropped:
            self._write()

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.known, indent=1))

    def tell(self) -> None:
        """Say once per process, on stderr, what calibrating cost, if anything was calibrated."""
        if self.seconds and not self._told:
            print(f"specula: calibrated row-exact verification for this machine in {self.seconds:.1f} s (kept in "
                  f"{self.path}; later runs reuse it)", file=sys.stderr)
            self._told = True


_SHARED: Calibrations | None = None


def shared() -> Calibrations:
    """This process's calibrations (the file is read on first use; tests point ``$SPECULA_CALIBRATIONS`` elsewhere
    and call :func:`forget`)."""
    global _SHARED
    if _SHARED is None or _SHARED.path != calibrations_path():
        _SHARED = Calibrations()
    return _SHARED


def forget() -> None:
    """Drop this process's copy of the calibrations (the next use reads the file again)."""
    global _SHARED
    _SHARED = None


def lower_median(values: Iterable[float]) -> float:
    """The median, the lower of the two middle values for an even count (other work only ever adds time).

    >>> lower_median([3.0, 1.0, 2.0, 9.0])
    2.0
    """
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


def seconds_of(run: Callable[[], object], clock: Callable[[], float] | None = None,
               repeats: int = TIMING_REPEATS) -> float:
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


def spread(shape: tuple, generator: torch.Generator, octaves: float) -> torch.Tensor:
    """Random values of both signs whose magnitudes spread over ``octaves`` powers of two: sums of them cancel and
    are dominated by a few terms, so that a sum taken in another order rounds otherwise far more often than for
    Gaussian values."""
    magnitudes = torch.exp2((torch.rand(shape, generator=generator) - 0.5) * octaves)
    return torch.randn(shape, generator=generator) * magnitudes


def cheapest(strategies: dict[Hashable, Callable[[], object]], clock: Callable[[], float] | None = None) -> Hashable:
    """The name of the fastest of ``strategies`` (each already known to be exact); the first on a tie.

    >>> ticks = iter(range(100))
    >>> cheapest({"a": lambda: [next(ticks) for _ in range(5)], "b": lambda: None}, clock=lambda: next(ticks))
    'b'
    """
    costs = {name: seconds_of(run, clock) for name, run in strategies.items()}
    return min(costs, key=costs.get)
