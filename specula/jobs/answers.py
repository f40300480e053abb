"""A JSONL file of requests answered into a JSONL file of answers, as ``specula generate`` does it, on this machine or
in Ray workers: the decoding (:class:`Answerer`), the answers file that survives a stopped run (:class:`AnswerFile`)
and a clean stop on Ctrl-C (:class:`StopOnInterrupt`)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..policy.batch_size import fastest_batch_size
from ..hf.generate import prepare_jobs
from ..core.loop import Decoder, Job
from .requests import BadRequest, encode, read_requests


@dataclass
class Settings:
    """How every request of a file is decoded (the same for all, wherever they run)."""

    max_new_tokens: int = 256
    sampling: dict = field(default_factory=dict)  # temperature / top_k / top_p, as generate() takes them
    seed: int | None = None  # request on line n draws from its own generator seeded ``seed + n``
    row_exact: bool | None = None
    batch_size: int | None = None  # None: the size measured fastest on this machine


def answer_key(request_id: object) -> str:
    """The id of a request or answer as a comparable string (``1`` and ``"1"`` differ, as in the files)."""
    return json.dumps(request_id, sort_keys=True)


def unique_requests(path: Path) -> Iterator[tuple[int, dict | BadRequest]]:
    """:func:`specula.workloads.read_requests`, where a request whose id is an earlier line's comes as a
    :class:`BadRequest` (answers are matched to requests by id: in the output, and by ``--resume``)."""
    first: dict[str, int] = {}  # id -> the line that has it
    for number, request in read_requests(path):
        if not isinstance(request, BadRequest):
            key = answer_key(request.get("id", number))
            if key in first:
                request = BadRequest(f"{path}:{number}: its id {key} is line {first[key]}'s too; give each request "
                                     "its own \"id\" (a line without one is known by its line number)")
            first.setdefault(key, number)
        yield number, request


def report_skipped(where: str) -> None:
    """Say on stderr that a request is skipped (``where``: ``path:line: reason``), on a line of its own: through
    tqdm, which lifts a progress bar drawn on that stream out of the way and draws it again below."""
    tqdm.write(f"skipped {where}", file=sys.stderr)


def _stats(stats) -> dict:
    return {
        "new_tokens": stats.new_tokens, "steps": stats.steps, "accepted": stats.accepted,
        "drafted": stats.drafted, "seconds": round(stats.wall_time_s, 4),
    }


class Answerer:
    """Decodes numbered requests (line number, request) into answer records ``{"id", "text", "stats"}``, up to
    ``settings.batch_size`` at a time in the same passes, each as ``specula.generate`` would alone; a request that
    cannot be decoded (e.g. a prompt longer than the model's context) is passed to ``on_skip`` with its reason.
    Kept across calls, it keeps its proposer (an n-gram predictor keeps learning) and its batch size."""

    def __init__(self, model, tokenizer, proposer, settings: Settings, on_skip: Callable[[int, str], None]) -> None:
        self.model, self.tokenizer, self.proposer = model, tokenizer, proposer
        self.settings, self.on_skip = settings, on_skip
        self.device = model.get_input_embeddings().weight.device
        self.slots = settings.batch_size
        self.passes, self.plain_speedups = 0, []  # over every call, for the summary

    def _job(self, number: int, request: dict) -> tuple[Job, object] | None:
        seed = self.settings.seed
        # each request its own random stream, so its answer does not depend on its batch-mates
        generator = None if seed is None else [torch.Generator(self.device).manual_seed(seed + number)]
        try:
            (job,), sampling = prepare_jobs(self.model, encode(self.tokenizer, request).to(self.device),
                                            generator=generator, max_new_tokens=self.settings.max_new_tokens,
                                            **self.settings.sampling)
        except ValueError as error:
            self.on_skip(number, str(error))
            return None
        job.key = request.get("id", number)
        return job, sampling

    def __call__(self, requests: Iterable[tuple[int, dict]], largest: int = 32, eager: bool = False) -> Iterator[dict]:
        """Answer records as requests finish (not in input order). ``largest`` bounds the measured batch size;
        ``eager`` prepares every request before decoding any."""
        prepared = filter(None, itertools.starmap(self._job, requests))
        if eager:
            prepared = iter(list(prepared))
        first = next(prepared, None)
        if first is None:
            return
        if self.slots is None:
            self.slots = fastest_batch_size(self.model, largest=largest)
        decoder = Decoder(self.model, self.proposer, first[1], self.slots, row_exact=self.settings.row_exact)
        try:
            for row, _ in decoder.run(itertools.chain([first[0]], (job for job, _ in prepared))):
                if row.finished:
                    text = self.tokenizer.decode(row.sequence.ids[len(row.job.prompt) :], skip_special_tokens=True)
                    yield {"id": row.job.key, "text": text, "stats": _stats(row.stats)}
        finally:
            self.passes += decoder.passes
            self.plain_speedups.append(decoder.plain_speedup())


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
                answer = json.loads(line)
                if not isinstance(answer, dict) or "id" not in answer:
                    raise ValueError('not a JSON object with an "id"')
            except ValueError as error:
                if number == len(lines):  # only the last line can have been cut short by a stopped run
                    self.torn = True
                    break
                raise ValueError(
                    f"--resume: {self.path}:{number} is not an answer ({error}); this file was not written by "
                    "specula generate. Choose another --output, or --overwrite to start again."
                ) from None
            self.done.add(answer_key(answer["id"]))
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


@dataclass
class Tally:
    """What a run did, for its closing line: answers written, tokens made, answers found from an earlier run."""

    answered: int = 0
    new_tokens: int = 0
    answered_before: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, answer: dict) -> None:
        self.answered, self.new_tokens = self.answered + 1, self.new_tokens + answer["stats"]["new_tokens"]

    def report(self, details: str, output: Path, interrupted: bool) -> None:
        """Print the summary (``details``: how it ran); after Ctrl-C, say how to go on and exit with status 130."""
        seconds = time.perf_counter() - self.started
        print(f"{self.answered} requests, {self.new_tokens} new tokens in {seconds:.1f}s "
              f"({self.new_tokens / max(seconds, 1e-9):.1f} tok/s), {details}"
              + (f"; {self.answered_before} answered before (--resume)" if self.answered_before else "")
              + f" -> {output}", file=sys.stderr)
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
