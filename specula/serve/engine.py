"""Continuous batching for the server: one thread drives the loop (:func:`specula.decoding.driver.finished_rows`)
over a live stream of jobs; requests join and leave between passes, each with its own settings.

The stream blocks while no request is in flight and says "none waiting now" (``None``) while some are, so the loop
runs as long as it has rows and picks up a request at the first pass after it arrived. A request whose client went
away is cancelled: its row ends after the pass under way and frees its slot. A failure of the loop is told to every
request in flight; the next request starts a fresh loop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..core.logprobs import TokenLogprob
from ..decoding.driver import finished_rows
from ..decoding.loop import Decoder, Job, Row
from ..machine.memory import give_back_freed

_CLOSE = object()


@dataclass
class Handle:
    """One request in the engine: its job, and how it is told what its row did (from the engine's thread)."""

    job: Job
    on_tokens: Callable[[list[int], list[TokenLogprob] | None], None]  # the tokens a pass kept for it (theirs)
    on_done: Callable[[Row | None, BaseException | None], None]  # its finished row, or why it failed
    done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop decoding it: its row ends after the pass under way (its client went away)."""
        self.job.cancelled = True


class Engine:
    """Decodes the jobs submitted to it in the same passes, through loops that ``make_decoder()`` builds (each
    measured before its first pass: the first before the engine is made, so a server answers its first requests at
    full speed). Counts what it did, for the health route."""

    def __init__(self, make_decoder: Callable[[], Decoder]) -> None:
        self.make_decoder = make_decoder
        self._next: Decoder | None = make_decoder()  # the loop the next requests run in (None: make a fresh one)
        self._waiting: queue.Queue = queue.Queue()  # handles submitted, not yet in the loop
        self._running: dict[int, Handle] = {}  # by id of the job: those the loop holds (its thread alone changes it)
        self._decoder: Decoder | None = None  # the loop running now
        self.submitted = self.answered = self.cancelled = self.failed = self.tokens = 0
        self._thread = threading.Thread(target=self._drive, name="specula-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        job: Job,
        on_tokens: Callable[[list[int], list[TokenLogprob] | None], None],
        on_done: Callable[[Row | None, BaseException | None], None],
    ) -> Handle:
        """Queue ``job``; ``on_tokens`` (the tokens a pass kept, and their log probabilities where the job asks) and
        ``on_done`` are called from the engine's thread."""
        handle = Handle(job, on_tokens, on_done)
        self.submitted += 1
        self._waiting.put(handle)
        return handle

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        return self.submitted - self.answered - self.cancelled - self.failed

    def close(self, timeout: float | None = None) -> None:
        """Finish what is in flight and waiting (their callers are answered), then stop the thread."""
        self._waiting.put(_CLOSE)
        self._thread.join(timeout)

    def _stream(self) -> Iterator[Job | None]:
        """The loop's live stream of jobs: blocks while the loop holds no row, else ``None`` when none is waiting."""
        while True:
            if not self._running and self._waiting.empty() and self._decoder is not None:
                self._decoder.release()  # (idle: the cache, and what the last passes freed, go back to the system)
                give_back_freed()
            try:
                handle = self._waiting.get(block=not self._running)
            except queue.Empty:
                yield None
                continue
            if handle is _CLOSE:
                return
            if handle.job.cancelled:  # (its client went away before it started)
                self._end(handle, None, None)
                continue
            self._running[id(handle.job)] = handle
            yield handle.job

    def _drive(self) -> None:
        while True:
            decoder, self._next = self._next or self.make_decoder(), None
            self._decoder = decoder
            try:
                for row in finished_rows(decoder, self._stream(), self._tokens):
                    self._end(self._running.pop(id(row.job)), row, None)
                return  # (closed)
            except Exception as error:  # every request the loop held is told; the next ones get a fresh loop
                running, self._running = list(self._running.values()), {}
                for handle in running:
                    self._end(handle, None, error)

    def _tokens(self, row: Row, kept: list[int]) -> None:
        self.tokens += len(kept)
        if kept:
            logprobs = row.logprobs[len(row.logprobs) - len(kept) :] if row.job.logprobs is not None else None
            self._running[id(row.job)].on_tokens(kept, logprobs)

    def _end(self, handle: Handle, row: Row | None, error: BaseException | None) -> None:
        if error is not None:
            self.failed += 1
        elif handle.job.cancelled:
            self.cancelled += 1
        else:
            self.answered += 1
        handle.on_done(row, error)
        handle.done.set()
