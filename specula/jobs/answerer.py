"""Requests decoded into answer records, as ``specula generate`` does it, on this machine or in Ray workers: up to a
batch of them at a time in the same passes (continuous batching), each as ``specula.generate`` would alone."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..core.loop import Decoder, Job
from ..hf.generate import prepare_jobs
from ..policy.batch_size import fastest_batch_size
from .requests import encode

REMEASURE = 256  # requests between measurements of the batch size, where it is measured (not given)


@dataclass
class Settings:
    """How every request of a file is decoded (the same for all, wherever they run)."""

    max_new_tokens: int = 256
    sampling: dict = field(default_factory=dict)  # temperature / top_k / top_p, as generate() takes them
    seed: int | None = None  # request on line n draws from its own generator seeded ``seed + n``
    exact: bool | None = None
    batch_size: int | None = None  # None: the size measured fastest on this machine
    predictions: bool = False  # whether requests may bring predictions ("prediction")


def _stats(stats, predicted: bool) -> dict:
    """An answer line's stats; with a prediction, its tokens verified and kept or rejected (OpenAI's names)."""
    return {
        "new_tokens": stats.new_tokens, "steps": stats.steps, "accepted": stats.accepted,
        "drafted": stats.drafted, "seconds": round(stats.wall_time_s, 4),
        "exact": None if stats.exactness is None else stats.exactness.exact,
    } | ({"accepted_prediction_tokens": stats.accepted_prediction_tokens,
          "rejected_prediction_tokens": stats.rejected_prediction_tokens} if predicted else {})


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
        self.exactness = None  # how the last call verified

    def _job(self, number: int, request: dict) -> tuple[Job, object] | None:
        seed = self.settings.seed
        # each request its own random stream, so its answer does not depend on its batch-mates
        generator = None if seed is None else [torch.Generator(self.device).manual_seed(seed + number)]
        try:
            (job,), sampling = prepare_jobs(self.model, encode(self.tokenizer, request).to(self.device),
                                            generator=generator, max_new_tokens=self.settings.max_new_tokens,
                                            prediction=request.get("prediction"), tokenizer=self.tokenizer,
                                            **self.settings.sampling)
        except ValueError as error:
            self.on_skip(number, str(error))
            return None
        job.key = number, request.get("id", number)
        return job, sampling

    def __call__(self, requests: Iterable[tuple[int, dict]], largest: int = 32, eager: bool = False
                 ) -> Iterator[tuple[int, dict]]:
        """(line number, answer record) as requests finish (not in input order: see
        :class:`specula.jobs.answers.InputOrder`). ``largest`` bounds the measured batch size;
        ``eager`` prepares every request before decoding any. A measured batch size is measured again every
        :data:`REMEASURE` requests (a busy moment at start must not fix it for the whole run); where it changed, the
        requests in flight finish and the rest go on in batches of the new size."""
        prepared = filter(None, itertools.starmap(self._job, requests))
        if eager:
            prepared = iter(list(prepared))
        measured = self.settings.batch_size is None
        while (first := next(prepared, None)) is not None:
            if self.slots is None:
                self.slots = fastest_batch_size(self.model, largest=largest)
            decoder = Decoder(self.model, self.proposer, first[1], self.slots, exact=self.settings.exact,
                              predictions=self.settings.predictions)
            self.exactness = decoder.exactness
            jobs = itertools.chain([first], prepared)
            try:
                for row, _ in decoder.run(self._jobs(jobs, largest) if measured else (job for job, _ in jobs)):
                    if row.finished:
                        text = self.tokenizer.decode(row.sequence.ids[len(row.job.prompt) :],
                                                     skip_special_tokens=True)
                        number, key = row.job.key
                        yield number, {"id": key, "text": text,
                                       "stats": _stats(row.stats, row.job.prediction is not None)}
            finally:
                self.passes += decoder.passes
                self.plain_speedups.append(decoder.plain_speedup())

    def _jobs(self, prepared: Iterator[tuple[Job, object]], largest: int) -> Iterator[Job]:
        """The jobs of ``prepared`` until, measured again after every :data:`REMEASURE` of them, the fastest batch
        size is another than the decoder's: then it becomes ``slots``, and the rest stay in ``prepared``."""
        for count, (job, _) in enumerate(prepared, start=1):
            yield job
            if count % REMEASURE == 0:
                size = fastest_batch_size(self.model, largest=largest, again=True)
                if size != self.slots:
                    self.slots = size
                    return
