"""The speculation loop: propose, verify in one pass, accept, roll back, repeat."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from transformers import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..target import calibration
from .acceptance import accept_draft
from ..target.runner import CachedModel, UnsupportedModelError
from ..policy.draft_length import DraftLength, DraftPolicy, FixedDrafts, shared_step_seconds
from ..hf.inputs import Request
from ..target.support import vocab_size
from .draft import Draft
from ..proposers.base import Proposer, RowProposalError
from ..target.row_exact import is_half_precision, wanted
from .sampling import Sampling
from .stats import GenerateOutput, SpecStats

MAX_DRAFT = 32  # the longest draft the loop sends, whatever the proposer's own limit


class _Sequence:
    """Prompt + output of one request on the host, in a buffer sized once; stops exactly at EOS, a stopping
    criterion, or the length limit."""

    def __init__(
        self, prompt: np.ndarray, max_new_tokens: int, eos_token_ids: frozenset[int],
        stopping_criteria: StoppingCriteriaList | None = None,
    ) -> None:
        self.tokens = np.empty(len(prompt) + max_new_tokens, dtype=np.int64)
        self.length = len(prompt)
        self.tokens[: self.length] = prompt
        self.eos_token_ids = eos_token_ids
        self.stopping_criteria = stopping_criteria

    @property
    def ids(self) -> np.ndarray:
        return self.tokens[: self.length]

    @property
    def room(self) -> int:
        """How many more tokens fit."""
        return len(self.tokens) - self.length

    def with_draft(self, draft: Draft, device: torch.device) -> torch.Tensor:
        """``[1, length + len(draft)]``: the sequence followed by the draft, what logits processors read."""
        return torch.cat([torch.from_numpy(self.ids), draft.tokens])[None].to(device)

    def append(self, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Append what fits, up to and including the first token that ends generation; return the appended tokens
        and whether to stop."""
        start = self.length
        kept = new_tokens[: len(self.tokens) - start]
        self.tokens[start : start + len(kept)] = kept
        for index, token in enumerate(kept):
            if token in self.eos_token_ids or self._criteria_met(start + index + 1):
                self.length = start + index + 1
                return kept[: index + 1], True
        self.length = start + len(kept)
        return kept, self.length == len(self.tokens)

    def _criteria_met(self, length: int) -> bool:
        """HF stopping criteria (stop strings, max time ...) on the first ``length`` tokens, as ``model.generate``
        checks them after every token (``scores`` is ``None``)."""
        if not self.stopping_criteria:
            return False
        return bool(self.stopping_criteria(torch.from_numpy(self.tokens[None, :length]), None).any())


def _proposed(
    proposer: Proposer, rows: list["Row"], budgets: list[int], vocab: int, batched: bool
) -> list[Draft]:
    """Ask ``proposer`` for every row's draft (at most ``budgets[r]`` tokens, 0: none) and check what it returns;
    in a batch an error names the request (its key)."""
    started = time.perf_counter()
    try:
        drafts = proposer.propose_rows([row.proposer for row in rows], [row.sequence.ids for row in rows], budgets)
    except Exception as error:
        if isinstance(error, RowProposalError) and not batched:
            raise error.error
        if not batched:
            raise
        which = f"request {rows[error.row].job.key!r}" if isinstance(error, RowProposalError) else "the rows"
        raise RuntimeError(f"{proposer!r}.propose() failed for {which} of the batch: {error}") from error
    seconds = (time.perf_counter() - started) / max(sum(budget > 0 for budget in budgets), 1)
    checked = []
    for row, draft, budget in zip(rows, drafts, budgets):
        where = f" (request {row.job.key!r} of the batch)" if batched else ""
        if budget > 0:
            row.stats.draft_time_s += seconds
            if row.lengths is not None:
                row.lengths.record_draft_time(seconds)
        if not isinstance(draft, Draft):
            raise TypeError(f"{proposer!r}.propose(){where} must return a specula.Draft, got {type(draft).__name__}.")
        draft = draft.cut(budget)
        if len(draft) and (int(draft.tokens.min()) < 0 or int(draft.tokens.max()) >= vocab):
            bad = int(draft.tokens.min()) if int(draft.tokens.min()) < 0 else int(draft.tokens.max())
            raise ValueError(
                f"{proposer!r} proposed token id {bad}{where}, outside the target's vocabulary of {vocab} tokens; "
                "the proposer must use the target's tokenizer."
            )
        if draft.probs is not None and draft.probs.shape[1] != vocab:
            raise ValueError(
                f"{proposer!r} returned draft probabilities{where} over {draft.probs.shape[1]} tokens but the "
                f"target's vocabulary has {vocab}; give q over the target's token ids."
            )
        checked.append(draft)
    return checked


@dataclasses.dataclass
class Job:
    """One request for :class:`Decoder`: a prompt and what ends its output."""

    prompt: np.ndarray  # [n] prompt tokens, no padding
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stopping_criteria: StoppingCriteriaList | None = None
    generator: torch.Generator | None = None  # its own random stream when sampling (None: the decoder's)
    key: object = None  # the caller's name for it (a row of a batch, a line of a file)
    # a left-padded prompt decoded alone, fed as model.generate feeds it: (tokens [L], positions [1, max_length],
    # attention mask [1, max_length])
    padded: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None


class Row:
    """The state of one request being decoded: its sequence, proposer, draft-length state, counters, and the draft
    it sends next."""

    def __init__(self, job: Job, proposer: Proposer | None, lengths: DraftLength | None, sampling: Sampling) -> None:
        self.job, self.proposer, self.lengths = job, proposer, lengths
        self.sequence = _Sequence(job.prompt, job.max_new_tokens, job.eos_token_ids, job.stopping_criteria)
        self.sampling = sampling if job.generator is None else dataclasses.replace(sampling, generator=job.generator)
        self.stats = SpecStats(prompt_tokens=len(job.prompt))
        self.draft = self.sent = Draft.empty()
        self.finished = False
        self.started = time.perf_counter()
        if proposer is not None:
            proposer.begin(self.sequence.ids, self.sampling)

    def advance(self, new_tokens: list[int]) -> list[int]:
        """Record a pass that produced ``new_tokens`` for this row; return the tokens its output kept."""
        accepted = len(new_tokens) - 1
        alone = len(self.sent.chain().path(new_tokens[:-1])) if self.sent.is_tree else None  # its first branch's
        self.stats.record_step(len(self.sent), accepted, None if alone is None else accepted - alone)
        kept, self.finished = self.sequence.append(new_tokens)
        if self.proposer is not None:
            self.proposer.observe(kept, min(len(new_tokens) - 1, len(kept)))
        now = time.perf_counter() - self.started
        if self.stats.steps == 1:
            self.stats.prefill_time_s = now
        self.stats.wall_time_s = now
        self.stats.new_tokens = self.sequence.length - self.stats.prompt_tokens
        self.draft = self.sent = Draft.empty()
        return kept


class Decoder:
    """The speculation loop over a stream of requests, up to ``slots`` at a time in one verification pass per step
    (see :func:`specula.generate` for the arguments).

    :meth:`run` is a generator: for every pass it yields, per request, ``(row, kept_tokens)``; ``row.finished``
    says when a request is done, and a new one takes its place in the same pass as the next step. Each request's
    prompt is computed alone, as ``model.generate`` computes it; its tokens do not depend on the others in its
    batch (bit for bit where verification is row-exact, else up to rounding).
    """

    def __init__(
        self, model: torch.nn.Module, proposer: Proposer | None, sampling: Sampling, slots: int = 1,
        adaptive_draft: bool = True, row_exact: bool | None = None,
    ) -> None:
        self.model, self.proposer, self.sampling, self.slots = model, proposer, sampling, slots
        # Draft lengths follow measured timings only where the output cannot depend on them: greedy decoding, and
        # sampling with drafts not drawn at random (each token is drawn as model.generate draws it), with passes
        # that round as one-token steps do (or in fp32, far below the gaps between logits). Elsewhere they follow
        # acceptance alone, so that a request decodes the same on every run.
        self.row_exact = (proposer is not None or slots > 1) and wanted(model, row_exact)
        drawn = not sampling.greedy and getattr(proposer, "samples_drafts", False)
        timed = not drawn and (self.row_exact or not is_half_precision(model))
        setting = (model.get_input_embeddings().weight.device, getattr(model, "dtype", None))
        def tables(rows: int, tree: bool = False):  # pass costs (passes with trees apart)
            return shared_step_seconds(model, (*setting, "tree") if tree else setting, MAX_DRAFT, rows)

        self.policy = DraftPolicy(MAX_DRAFT, timed, tables) if adaptive_draft else FixedDrafts(MAX_DRAFT)
        self.vocab = vocab_size(model)
        self.passes = 0  # target forward passes, prefills included
        self.prefill_seconds = self.step_seconds = 0.0  # time in prefills, and in steps (proposing included)
        self._tables = tables if timed else None
        self._made: dict[int, int] = {}  # tokens the steps made, by the rows they had
        if proposer is not None:
            proposer.check_target(model)
        self._spare = [] if proposer is None else [proposer]  # proposer objects free for the next request
        self._target: CachedModel | None = None
        self._trees = getattr(proposer, "proposes_trees", False)  # hold a single request as a batch row
        self._argmax_only = sampling.greedy and not sampling.processors  # a step takes the logits' argmax only

    def _cached_model(self, job: Job, capacity: int) -> CachedModel:
        # position ids as model.generate passes them (some models number tokens wrongly by themselves: Bamba)
        positions, mask = (torch.arange(len(job.prompt) + job.max_new_tokens, device=self.model.device)[None], None)
        if job.padded is not None:
            positions, mask = job.padded[1:]
        make = functools.partial(CachedModel, self.model, positions, mask, rollback=self.proposer is not None,
                                 capacity=capacity, row_exact=self.row_exact, slots=self.slots)
        if self.slots == 1 and self._trees and job.padded is None:
            try:
                return make(ragged=True)
            except UnsupportedModelError as error:
                warnings.warn(f"{error} So {self.proposer!r}'s trees are cut to their first branch.", stacklevel=4)
                self._trees = False
        return make()

    def _start(self, index: int, job: Job) -> tuple[Row, list[int]]:
        """Make ``job`` row ``index`` of the batch: prefill its prompt alone, take its first token."""
        proposer = None if self.proposer is None else self._spare.pop() if self._spare else self.proposer.fork()
        row = Row(job, proposer, self.policy.new_row(), self.sampling)
        capacity = len(job.prompt) + job.max_new_tokens + 2 * (MAX_DRAFT + 1)
        if self.slots == 1 or self._target is None:
            self._target = self._cached_model(job, capacity)
        started = time.perf_counter()
        if not self._target.ragged:
            feed = job.prompt if job.padded is None else job.padded[0]
            logits = self._target.forward(torch.from_numpy(feed).to(self._target.model.device), 1)
        else:
            logits = self._target.start_row(index, torch.from_numpy(job.prompt).to(self._target.device))
        self.passes += 1
        kept = row.advance(accept_draft(logits, Draft.empty(), row.sampling, self._tokens(row)))
        self.prefill_seconds += time.perf_counter() - started
        return row, kept

    def plain_speedup(self) -> float | None:
        """Estimated speedup of the run so far against plain decoding (one token a row a pass) in the same batches:
        the tokens each step made, at the measured cost of a plain pass over as many rows, against the time the
        steps took (proposing included; prefills count on both sides). ``None`` where passes are not timed
        (sampling, ``adaptive_draft=False``) or no plain pass was."""
        if self._tables is None or not self.step_seconds:
            return None
        plain = self.prefill_seconds
        for rows, made in self._made.items():
            cost = self._tables(rows)[rows]
            if np.isnan(cost):
                return None
            plain += made / rows * cost
        return plain / (self.prefill_seconds + self.step_seconds)

    def _tokens(self, row: Row) -> torch.Tensor | None:
        """What logits processors read: the row's sequence followed by the draft it sends."""
        return row.sequence.with_draft(row.sent, self.model.device) if self.sampling.reads_tokens else None

    def _finish(self, row: Row) -> None:
        if row.proposer is not None:
            self._spare.append(row.proposer)

    @torch.inference_mode()
    def run(self, jobs: Iterable[Job]) -> Iterator[tuple[Row, list[int]]]:
        jobs, rows = iter(jobs), []  # rows[i]: row i of the target's batch
        while True:
            # Fill the free slots; a request may end with its first token (then the next one takes the slot).
            for index in range(self.slots):
                while (index >= len(rows) or rows[index] is None) and (job := next(jobs, None)) is not None:
                    row, kept = self._start(index, job)
                    rows[index : index + 1] = [None if row.finished else row]
                    yield row, kept
                    if row.finished:
                        self._finish(row)
                if index >= len(rows):
                    break
            if None in rows:  # no request left to take these slots: the batch shrinks
                self._target.select_rows([i for i, row in enumerate(rows) if row is not None])
                rows = [row for row in rows if row is not None]
            if not rows:
                return
            step_started = time.perf_counter()
            lengths = [row.lengths for row in rows]
            if self.proposer is not None:
                budgets = self.policy.budgets(lengths, [row.sequence.room - 1 for row in rows])
                drafts = _proposed(self.proposer, rows, budgets, self.vocab, self.slots > 1)
                for row, draft in zip(rows, drafts):
                    row.draft = draft if self._target.ragged else draft.chain()  # (trees need own masks)
            for row, tokens in zip(rows, self.policy.trim(lengths, [row.draft for row in rows])):
                row.sent = row.draft.select(tokens)
            started, calibrations = time.perf_counter(), calibration.shared().made
            device = self.model.device
            blocks = [torch.cat([torch.from_numpy(row.sequence.ids[-1:]), row.sent.tokens]).to(device) for row in rows]
            trees = [_tree(row.sent) for row in rows]
            logits = self._target.forward_rows(blocks, [len(block) for block in blocks], trees, self._argmax_only)
            outcomes = [accept_draft(row_logits, row.sent, row.sampling, self._tokens(row))
                        for row, row_logits in zip(rows, logits)]
            seconds = time.perf_counter() - started
            if calibration.shared().made != calibrations:  # it calibrated row-exact kernels: no measure of its cost
                seconds = None
            self.passes += 1
            # the last token and the accepted drafts
            paths = [_path(row.sent, tokens) for row, tokens in zip(rows, outcomes)]
            self._target.keep_rows([len(tokens) for tokens in outcomes], paths)
            width = max(map(len, blocks))  # (every row is computed this wide)
            self.policy.learn(lengths, [row.draft for row in rows], [row.sent for row in rows], outcomes,
                              len(blocks) * width, seconds)
            self.step_seconds += time.perf_counter() - step_started
            self._made[len(rows)] = self._made.get(len(rows), 0) + sum(map(len, outcomes))
            for index, (row, tokens) in enumerate(zip(rows, outcomes)):
                yield row, row.advance(tokens)
                if row.finished:
                    rows[index] = None
                    self._finish(row)


def _tree(draft: Draft) -> list[int] | None:
    """A tree draft's block layout for the target (block index of each token's parent: the last token, then the
    draft); ``None`` for a chain."""
    return None if draft.parents is None else [-1] + [parent + 1 for parent in draft.parents]


def _path(draft: Draft, new_tokens: list[int]) -> list[int] | None:
    """The block indices a step over a tree draft keeps (the last token and the accepted path); ``None``: a chain's
    first ones."""
    return None if draft.parents is None else [0] + [node + 1 for node in draft.path(new_tokens[:-1])]


def jobs_of(
    request: Request, stopping_criteria: StoppingCriteriaList | None = None,
    row_generators: list[torch.Generator] | None = None,
) -> list[Job]:
    """One :class:`Job` per row of ``request`` (its key: the row, ``None`` alone)."""
    batch, width = request.input_ids.shape
    padded = batch == 1 and request.attention_mask is not None
    return [
        Job(request.prompt(b), request.max_length - width, request.eos_token_ids, stopping_criteria,
            None if row_generators is None else row_generators[b], key=b if batch > 1 else None,
            padded=(request.input_ids[0], request.positions, request.attention_mask) if padded else None)
        for b in range(batch)
    ]


def decode(
    model: torch.nn.Module,
    request: Request,
    proposer: Proposer | None,
    sampling: Sampling,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: BaseStreamer | None = None,
    adaptive_draft: bool = True,
    row_exact: bool | None = None,
    row_generators: list[torch.Generator] | None = None,
) -> GenerateOutput:
    """:class:`Decoder` on a validated request of one or more rows, all in one batch (see :func:`specula.generate`);
    ``row_generators`` gives each row its own random stream."""
    started = time.perf_counter()
    batch, width = request.input_ids.shape
    jobs = jobs_of(request, stopping_criteria, row_generators)
    decoder = Decoder(model, proposer, sampling, batch, adaptive_draft, row_exact)
    rows = {}
    if request.max_length > width:
        for row, kept in decoder.run(jobs):
            rows[row.job.key] = row
            if streamer is not None:
                streamer.put(torch.tensor(kept))
    if streamer is not None:
        streamer.end()
    new = [rows[job.key].sequence.ids[len(job.prompt) :] if job.key in rows else np.zeros(0, np.int64) for job in jobs]
    per_row = [rows[job.key].stats if job.key in rows else SpecStats(prompt_tokens=len(job.prompt)) for job in jobs]
    stats = SpecStats.total(per_row, steps=decoder.passes, wall_time_s=time.perf_counter() - started,
                            prefill_time_s=sum(row.prefill_time_s for row in per_row))
    return GenerateOutput(sequences=_padded(request, new).to(request.device), stats=stats)


def _padded(request: Request, new: list[np.ndarray]) -> torch.Tensor:
    """``[B, L + new]``: each row's (padded) prompt and its new tokens ``new[b]``, rows that ended early padded after
    their end with ``request.pad_token_id``, as ``model.generate`` pads them."""
    width = request.input_ids.shape[1]
    out = np.full((len(new), width + max(map(len, new))), request.pad_token_id, dtype=np.int64)
    out[:, :width] = request.input_ids
    for b, tokens in enumerate(new):
        out[b, width : width + len(tokens)] = tokens
    return torch.from_numpy(out)
