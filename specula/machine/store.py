"""The one store of measured state: every calibration, kept pass-cost table, weight layout and kernel choice, in one
JSON file (``$SPECULA_CALIBRATIONS``, else ``measurements.json`` in specula's cache folder).

A measurement is kept under a key of what it depends on (:func:`key`): the device (the GPU's name, or the CPU's
model and threads), torch's version and CPU capability, :data:`PASSES`, and the operation and its shape. A second
process on the same machine starts from what the first measured; any change of key measures again. Within a
process, what is derived from the file (each model's profile, memos on the hot path) lives beside it and is dropped
with it by the one reset, :func:`forget`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

import torch

from .load import LoadMeter, busy_now

# How specula computes passes: part of every key, changed whenever what a kept measurement measured changes (pass
# costs and the cost of exactness follow how ordinary passes are computed), so that none outlives its subject.
PASSES = 3
FILE = "measurements.json"

T = TypeVar("T")


def cache_dir() -> Path:
    """specula's cache folder (converted models, the measurements): ``$SPECULA_CACHE``, else ``~/.cache/specula``."""
    return Path(os.environ.get("SPECULA_CACHE") or Path.home() / ".cache" / "specula")


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, read once per process."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [
            line.partition(":")[2].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return cpu


def device_name(device: torch.device) -> str:
    """What a measurement on ``device`` depends on besides torch: the GPU's name, or the CPU's model and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def key(device: torch.device, operation: str, *shape: Hashable) -> str:
    """The key of one measurement of ``operation`` on ``device``."""
    return json.dumps(
        [
            device_name(device),
            torch.__version__,
            torch.backends.cpu.get_cpu_capability(),
            PASSES,
            operation,
            *map(str, shape),
        ]
    )


def store_path() -> Path:
    """Where measurements are kept."""
    return _store_path(*_where())


def _where() -> tuple[str | None, ...]:
    """What :func:`store_path` follows (read at every pass: cheaper than the path)."""
    return tuple(map(os.environ.get, ("SPECULA_CALIBRATIONS", "SPECULA_CACHE", "HOME")))


@functools.lru_cache(maxsize=8)
def _store_path(calibrations: str | None, *_: str | None) -> Path:
    return Path(calibrations or cache_dir() / FILE)


class Store:
    """The measurements file: read once, written whenever a new measurement is made (an unreadable or unwritable
    file only means measuring again)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or store_path()
        try:
            self.known: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.seconds = 0.0  # spent measuring in this process
        self.made = 0  # measurements made in this process (a pass that made one is no measure of its cost)
        self.unkept: dict = {}  # measurements made (or not made) while other programs took the CPUs: this process's
        self.skipped = 0  # measurements not made for it (their ``busy`` taken instead)
        self._told = (0.0, 0, 0)  # (seconds, unkept measurements, skipped ones) said on stderr so far
        self._depth = 0  # measurements under way (one may make others: counted once)

    def get(self, key: str, measure: Callable[[], T], timed: bool = True, busy: Callable[[], T] | None = None) -> T:
        """The measurement under ``key``: kept, else made by ``measure()`` (JSON-serialisable) and kept, unless other
        programs took the CPUs meanwhile (:mod:`.load`): then this process uses it, and a later one measures again.
        ``timed=False``: a check of bits, not of time (whether passes round alike), which the load cannot change:
        kept whatever it was. ``busy``: what to take instead, unmeasured and not kept, where other programs take the
        CPUs as the measurement would start (:func:`~.load.busy_now`): timed then, it would measure the load more than
        the machine, slowly (torch's threads wait for each other: on the 2-core AMX Xeon with a core busy, a first run
        of the README's requests measured for 70 s), and not be kept anyway."""
        if key in self.known:
            return self.known[key]
        if key not in self.unkept and busy is not None and timed and busy_now():
            self.unkept[key] = busy()
            self.skipped += 1
        if key not in self.unkept:
            meter, started = LoadMeter(), time.perf_counter()
            self._depth += 1
            try:
                value = measure()
            finally:
                self._depth -= 1
            self.seconds += 0.0 if self._depth else time.perf_counter() - started
            self.made += 1
            if not timed or not meter.disturbed():
                self.keep(key, value)
                return self.known[key]
            self.unkept[key] = value
        return self.unkept[key]

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
        """Say on stderr what measuring cost since this was last said, if anything was measured."""
        seconds, unkept = self.seconds - self._told[0], len(self.unkept) - self.skipped - self._told[1]
        if self.skipped > self._told[2]:
            print(
                f"specula: other programs take the CPUs: {self.skipped - self._told[2]} measurement(s) not made, "
                "defaults taken (a later run measures them; docs/hardware.md, 'While other programs run')",
                file=sys.stderr,
            )
        if seconds > 0:
            busy = (
                (
                    f"; {unkept} of its measurements ran while other programs took the CPUs, so they are not kept: a "
                    "later run measures them again"
                )
                if unkept
                else ""
            )
            print(
                f"specula: measured this machine in {seconds:.1f} s{' more' if self._told[0] else ''} (kept in "
                f"{self.path}; later runs reuse it{busy})",
                file=sys.stderr,
            )
        self._told = (self.seconds, len(self.unkept) - self.skipped, self.skipped)


_SHARED: Store | None = None
_MEMOS: dict[str, object] = {}


def shared() -> Store:
    """This process's store (the file is read on first use; tests point ``$SPECULA_CALIBRATIONS`` elsewhere and call
    :func:`forget`)."""
    global _SHARED
    if _SHARED is None or _SHARED.path != _store_path(*_where()):
        forget()
        _SHARED = Store()
    return _SHARED


def memo(name: str, make: Callable[[], T] = dict) -> T:
    """This process's memo ``name`` (made by ``make()`` on first use): what is derived from the store and asked on the
    hot path, dropped with the store by :func:`forget`."""
    if name not in _MEMOS:
        _MEMOS[name] = make()
    return _MEMOS[name]


def forget() -> None:
    """Start again as a new process would: the file read again on next use, every model's profile and every memo
    dropped."""
    global _SHARED
    _SHARED = None
    _MEMOS.clear()
