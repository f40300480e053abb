"""``specula generate --ray``: a JSONL file of requests decoded by a pool of Ray workers, the way Ray's batch
inference guide does it (Ray Data ``map_batches`` with a callable class on a fixed-size actor pool): each worker loads
the model once and decodes its batches with specula's batched loop, exactly as a local run would; the answers come
back to this process and are written as they arrive, with the local run's fields.

Python::

    from specula.jobs.decode import Settings
    from specula.jobs.answer_file import AnswerFile
    from specula.jobs.ray import generate_with_ray

    with AnswerFile("answers.jsonl", resume=True) as output:
        generate_with_ray("requests.jsonl", output, model="/models/qwen", workers=4, gpus_per_worker=1,
                          settings=Settings(max_new_tokens=512))

``ray.init()`` joins the cluster ``RAY_ADDRESS`` names (``ray start --head`` on one node, ``ray start --address ...``
on the others), else starts a local Ray instance. Every worker's node needs specula (with its extra) and the model at
the same path; this process reads the requests and writes the answers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

try:
    import ray
    import ray.data
except ImportError as error:  # (the optional extra)
    raise ImportError("specula.jobs.ray needs Ray: pip install 'specula[ray]'") from error

from ..hf.loading import load_model, resolve_model
from ..hf.registry import proposer_factory
from .answer_file import AnswerFile, InputOrder, StopOnInterrupt, Tally
from .decode import Answerer, Settings
from .line_formats import error_line
from .requests import (
    BadRequest,
    Request,
    Shape,
    answer_key,
    file_shape,
    model_name,
    parse_request,
    unique_requests,
)

RAY_BATCH = 64  # requests a worker takes at once, decoded up to settings.batch_size at a time (continuous batching)


class RayWorker:
    """One actor of the pool: the model and proposer, loaded once; each call answers a batch of requests."""

    def __init__(
        self,
        model: str | None,
        proposer: str,
        settings: Settings,
        dtype,
        device: str,
        threads: int,
        adapter: dict[str, str] | None = None,
    ) -> None:
        torch.set_num_threads(threads)  # the cores Ray gave this worker (its OMP_NUM_THREADS may come too late)
        self.model, tokenizer = load_model(model, dtype=dtype, device=device, adapter=adapter)
        factory = proposer_factory(proposer, tokenizer, self.model.dtype, device)
        self.skipped: list[tuple[int, str]] = []  # (line number, reason)
        self.answerer = Answerer(
            self.model,
            tokenizer,
            factory(),
            settings,
            lambda request, reason: self.skipped.append((request.line, reason)),
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, list]]:
        """``batch``: columns ``number`` (line numbers) and ``request`` (the line's JSON, checked by the driver).
        Yields a row as each request ends: its ``number`` and ``answer`` (its JSON line), or ``skipped`` (the
        reason) for one that could not be decoded."""
        self.skipped = []
        requests = [
            parse_request(json.loads(line), number) for number, line in zip(batch["number"].tolist(), batch["request"])
        ]
        for request, answer in self.answerer(requests, largest=min(RAY_BATCH, 32)):
            yield from self._skipped()
            yield {"number": [request.line], "answer": [json.dumps(answer, ensure_ascii=False)], "skipped": [""]}
        yield from self._skipped()

    def _skipped(self) -> Iterator[dict[str, list]]:
        while self.skipped:
            number, reason = self.skipped.pop(0)
            yield {"number": [number], "answer": [""], "skipped": [reason]}


def generate_with_ray(
    input_path: str | Path,
    output: AnswerFile,
    model: str | None = None,
    proposer: str = "prompt-lookup",
    settings: Settings | None = None,
    *,
    dtype="auto",
    adapter: dict[str, str] | None = None,
    workers: int = 1,
    gpus_per_worker: float = 0,
    cpus_per_worker: int | None = None,
    strict: bool = False,
    json_path: Path | None = None,
) -> Tally:
    """Answer every request of ``input_path`` not yet in ``output`` with ``workers`` Ray workers; returns what it
    did. Bad lines are reported (``strict``: ``ValueError`` at the first, before any worker starts);
    Ctrl-C stops after the answer being written (``SystemExit(130)``), and a rerun with a resumed ``output`` goes on;
    ``json_path``: also write the run's summary there (:meth:`Tally.summary`).
    ``model``, ``dtype`` and ``adapter`` are what :func:`specula.load_model` takes, ``proposer`` a ``--proposer``
    name."""
    tally = Tally()
    settings = settings or Settings()
    if settings.model_name is None:
        settings = dataclasses.replace(settings, model_name=model_name(model))
    requests = _pending(input_path, output, strict, tally, settings.model_name)
    if not os.environ.get("RAY_ADDRESS"):  # workers on this machine: the model must be here (on a cluster: each node)
        resolve_model(model)
    stop = StopOnInterrupt()
    if requests:
        worker = {"model": model, "proposer": proposer, "settings": settings, "dtype": dtype, "adapter": adapter}
        good = [
            {"number": number, "request": json.dumps(request.data)}
            for number, request in requests
            if isinstance(request, Request)
        ]
        answers = _answers(good, worker, workers, gpus_per_worker, cpus_per_worker) if good else None
        with stop:
            _write_answers(answers, requests, output, tally, input_path, stop)
    tally.report(f"{workers} Ray worker{'s' * (workers > 1)}", output.path, stop.requested, json_path, workers=workers)
    return tally


def _pending(
    input_path: str | Path, output: AnswerFile, strict: bool, tally: Tally, model: str
) -> list[tuple[int, Request | BadRequest]]:
    """(line number, request) for the requests of ``input_path`` still to answer and its bad lines (with ``strict``,
    the first is a ``ValueError``); those answered before counted in ``tally``. ``model``: the name requests may
    give the model."""
    requests = []
    for number, request in unique_requests(input_path, model):
        if request.id is not None and answer_key(request.id) in output.done:
            tally.answered_before += 1
        elif isinstance(request, BadRequest) and strict:
            raise ValueError(f"{request} (--strict)")
        else:
            requests.append((number, request))
    return requests


def _answers(
    requests: list[dict], worker: dict, workers: int, gpus_per_worker: float, cpus_per_worker: int | None
) -> "ray.data.Dataset":
    """The answers of ``requests`` by a pool of ``workers`` :class:`RayWorker` (made with ``worker``, the
    arguments they share), each answer a row of its own, sent back as soon as it is made."""
    ray.init(ignore_reinit_error=True, logging_level=logging.WARNING)  # RAY_ADDRESS: that cluster; else local
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # specula reports what it did
    context.target_max_block_size = 1  # every answer a block of its own, sent back as soon as it is made
    if cpus_per_worker is None:
        cpus_per_worker = 1 if gpus_per_worker else max(1, int(ray.cluster_resources().get("CPU", 1)) // workers)
    return ray.data.from_items(requests).map_batches(
        RayWorker,
        batch_size=RAY_BATCH,
        compute=ray.data.ActorPoolStrategy(size=workers),
        fn_constructor_kwargs={**worker, "device": "cuda" if gpus_per_worker else "cpu", "threads": cpus_per_worker},
        num_cpus=cpus_per_worker,
        num_gpus=gpus_per_worker,
    )


def _write_answers(
    answers: "ray.data.Dataset | None",
    requests: list[tuple[int, Request | BadRequest]],
    output: AnswerFile,
    tally: Tally,
    input_path: str | Path,
    stop: StopOnInterrupt,
) -> None:
    """Write the answers in input order as they arrive (:class:`InputOrder`) and report the bad lines and the
    requests the workers skipped (a Batch API line's: an error line in its place), until all are in or ``stop`` is
    requested; a worker's error is a ``ValueError`` with its own last line."""
    order, batch_api = InputOrder(output, tally), file_shape(input_path) is Shape.BATCH_API
    lines = dict(requests)  # line number -> its request
    for number in lines:
        order.expect(number)

    def skip(number: int, where: str, reason: str) -> None:
        tally.skip(f"{where}{reason}")
        order.settle(number, error_line(lines[number].id, reason) if batch_api else None)

    try:
        with order:
            for number, request in lines.items():
                if isinstance(request, BadRequest):
                    skip(number, "", str(request))
            for row in [] if answers is None else answers.iter_rows():
                if row["answer"]:
                    order.settle(row["number"], json.loads(row["answer"]))
                else:
                    skip(row["number"], f"{input_path}:{row['number']}: ", row["skipped"])
                if stop.requested:
                    break
    except ray.exceptions.RayError as error:  # the worker's own error, without Ray's machinery around it
        reason = str(error).strip().splitlines()[-1]
        raise ValueError(f"a Ray worker failed ({tally.answered} answers written): {reason}") from None
