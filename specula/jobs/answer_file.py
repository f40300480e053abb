"""The answers file of a job, which survives a stopped run (:class:`AnswerFile`), answers written in their requests'
order (:class:`InputOrder`), the run's summary (:class:`Tally`) and a clean stop on Ctrl-C (:class:`StopOnInterrupt`).
Nothing here needs torch: the command line reads an answers
file (``--resume``) before it imports anything heavy."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .line_formats import answer_stats, line_key


def report_skipped(where: str) -> None:
    """Say on stderr that a request is skipped (``where``: ``path:line: reason``), on a line of its own: through
    tqdm, which lifts a progress bar drawn on that stream out of the way and draws it again below."""
    tqdm.write(f"skipped {where}", file=sys.stderr)


class AnswerFile:
    """The answers file: one complete JSON line per answer, flushed and synced as it is written, so that a run
    stopped at any point (Ctrl-C, a killed process, a lost node) loses none that was written.

    With ``resume``, the answers already in the file are kept (``done`` holds their ids) and new ones appended;
    a torn last line (the run stopped while writing it) is cut off, so that request is answered again. Any other
    line that is not an answer is an error: the file is not this job's output."""

    def __init__(self, path: Path, resume: bool = False) -> None:
        self.path, self.done, self.torn = Path(path), set(), False
        if resume and self.path.exists():
            self._recover()
        self.mode, self.file = "a" if resume else "w", None  # opened at the first answer: a run that fails first
        # (e.g. --strict finding a bad line) leaves an earlier file as it was

    def _recover(self) -> None:
        data = self.path.read_bytes()
        lines = data.splitlines(keepends=True)
        good = 0  # bytes of complete answer lines
        for number, line in enumerate(lines, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no end of line")
                key = line_key(json.loads(line))
            except ValueError as error:
                if number == len(lines):  # only the last line can have been cut short by a stopped run
                    self.torn = True
                    break
                raise ValueError(
                    f"--resume: {self.path}:{number} is not an answer ({error}); this file was not written by "
                    "specula generate. Choose another --output, or --overwrite to start again."
                ) from None
            self.done.add(key)
            good += len(line)
        if good < len(data):
            with self.path.open("r+b") as file:
                file.truncate(good)

    def write(self, answer: dict) -> None:
        if self.file is None:
            self.file = self.path.open(self.mode, encoding="utf-8")
        self.file.write(json.dumps(answer, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self, failed: bool = False) -> None:
        """Close the file; a run that wrote no answer still leaves one (empty), unless it ``failed``."""
        if self.file is None and not failed:
            self.file = self.path.open(self.mode, encoding="utf-8")
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> "AnswerFile":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=kind is not None)


class InputOrder:
    """Answers written in the order of their requests' lines, whatever order they finish in (requests decoded in the
    same passes end as their acceptance has it): an answer waits until every request before it is answered or
    skipped. On leaving ``with`` (the run ended, was stopped or failed), the answers still waiting are written too,
    in line order, so none that was made is lost; a resumed run finds them by id.

    ``expect(number)`` as requests are handed out (in line order), ``settle(number, answer)`` as each ends
    (``None``: skipped without a line; a Batch API file answers a skipped request with an error line). Worked example:
    1, 2, 3 expected; 3 settles (waits), 1 settles (1 written), 2 is skipped
    (3 written)."""

    def __init__(self, output: AnswerFile, tally: "Tally") -> None:
        self.output, self.tally = output, tally
        self.expected: deque[int] = deque()  # line numbers handed out and not yet written, in order
        self.settled: dict[int, dict | None] = {}  # line number -> its answer (None: skipped), waiting for its turn

    def expect(self, number: int) -> None:
        self.expected.append(number)

    def settle(self, number: int, answer: dict | None) -> None:
        self.settled[number] = answer
        while self.expected and self.expected[0] in self.settled:
            self._write(self.settled.pop(self.expected.popleft()))

    def _write(self, answer: dict | None) -> None:
        if answer is not None:
            self.output.write(answer)
            if (stats := answer_stats(answer)) is not None:  # (not a Batch API error line)
                self.tally.add(stats)

    def __enter__(self) -> "InputOrder":
        return self

    def __exit__(self, *exc) -> None:
        for number in sorted(self.settled):
            self._write(self.settled.pop(number))


@dataclass
class Tally:
    """What a run did, for its closing line: answers written, the tokens they have and the passes each was in,
    answers found from an earlier run, requests skipped."""

    answered: int = 0
    new_tokens: int = 0
    passes: int = 0  # over every answer: the passes it was in (its prefill too)
    answered_before: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, stats: dict) -> None:
        """Count an answer of these stats (``new_tokens``, ``passes``)."""
        self.answered, self.new_tokens = self.answered + 1, self.new_tokens + stats["new_tokens"]
        self.passes += stats["passes"]

    def summary(self, **more) -> dict:
        """What the run did, as ``--json`` writes it (``more``: how it ran)."""
        seconds = time.perf_counter() - self.started
        return {
            "requests": self.answered,
            "new_tokens": self.new_tokens,
            "seconds": round(seconds, 3),
            "tokens_per_second": round(self.new_tokens / max(seconds, 1e-9), 2),
            # plain decoding makes one token a request a pass: what drafts gave is what this is above 1
            "tokens_per_pass_per_request": round(self.new_tokens / self.passes, 3) if self.passes else None,
            "answered_before": self.answered_before,
            "skipped": self.skipped,
            **more,
        }

    def skip(self, where: str) -> None:
        """Report a skipped request (``where``: ``path:line: reason``) and count it."""
        report_skipped(where)
        self.skipped += 1

    def report(self, details: str, output: Path, interrupted: bool, json_path: Path | None = None, **more) -> None:
        """Print the summary (``details``: how it ran; with ``json_path``, also write :meth:`summary` with ``more``
        there); after Ctrl-C, say how to go on and exit with status 130. A run that answered nothing because every
        request was skipped is an error (status 1)."""
        if self.skipped and not (self.answered or self.answered_before or interrupted):
            raise SystemExit(
                f"error: every request was skipped ({self.skipped}, reasons above); nothing was answered into {output}"
            )
        summary = self.summary(**more)
        if json_path is not None:
            json_path.write_text(json.dumps(summary, indent=1) + "\n")
        per_pass = summary["tokens_per_pass_per_request"]
        print(
            f"{self.answered} requests, {self.new_tokens} new tokens in {summary['seconds']:.1f}s "
            f"({summary['tokens_per_second']:.1f} tok/s)"
            + (f", {per_pass:.2f} tokens per pass per request (plain decoding: 1)" if per_pass else "")
            + f", {details}"
            + (f"; {self.answered_before} answered before (--resume)" if self.answered_before else "")
            + (f"; {self.skipped} skipped (reasons above)" if self.skipped else "")
            + f" -> {output}",
            file=sys.stderr,
        )
        if interrupted:
            print(f"interrupted: rerun with --resume to answer the rest into {output}", file=sys.stderr)
            raise SystemExit(130)


class StopOnInterrupt:
    """Within ``with``, Ctrl-C (SIGINT) asks the job to stop (``requested``) instead of raising in the middle of
    whatever runs: the answer being written is finished, the run ends with its summary. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping: finishing the answer being written (Ctrl-C again to abort)", file=sys.stderr)

    def __enter__(self) -> "StopOnInterrupt":
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)
