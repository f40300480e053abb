"""The speculation loop: propose, verify in one pass, accept, roll back, repeat."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np
import torch
from transformers import StoppingCriteriaList

from ..core.acceptance import accept_draft, accept_drafts
from ..core.draft import Draft
from ..core.logprobs import MAX_TOP, TokenLogprob, token_logprobs
from ..core.sampling import Sampling
from ..core.sequence import Sequence
from ..core.stats import SpecStats
from ..machine import store
from ..machine.load import LoadMeter
from ..policy.adaptive import AdaptiveDrafts, FixedDrafts, finishing_worth
from ..policy.costs import PassCosts, keep_pass_costs, shared_pass_costs
from ..policy.guard import DraftGuard
from ..policy.kept_costs import kept_pass_costs
from ..policy.protocol import DraftPolicy, Pass
from ..proposers.base import Proposer, RequestFailed, RequestProposer, for_requests
from ..proposers.guide import Guide, guided
from ..proposers.prediction import Prediction, with_prediction
from ..verifier.exactness import Exactness, choose
from ..verifier.invariant import any_threads
from ..verifier.invariant import holds as invariant_holds
from ..verifier.packed import packed_for
from ..verifier.row_exact import is_half_precision, row_exact_for
from ..verifier.runner import CachedModel, cached_model
from ..verifier.static import compiles
from ..verifier.support import (
    UnsupportedModelError,
    describe,
    model_device,
    tokens_meet,
    vocab_size,
    without_grad,
)
from .budget import CacheBudget
from .estimate import PlainEstimate

# The longest draft the loop sends, whatever the proposer's own limit: the cost model sends what pays up to it. Long
# enough for a prediction's runs where a wide pass costs about a plain one (accelerators; BENCHMARKS.md).
MAX_DRAFT = 64
# New tokens a request's cache first makes room for; it doubles where an answer runs longer (a server's request may
# allow the whole context, which the cache of every slot need not hold from the start).
FIRST_ROOM = 1024
_REQUEST_IDS = itertools.count()  # what proposers know requests by (unique across decoders sharing a proposer)


def _proposed(
    proposer: RequestProposer, rows: list["Row"], budgets: list[int], vocab: int, batched: bool
) -> tuple[list[Draft], float]:
    """Ask ``proposer`` for the drafts of the rows with a budget (at most ``budgets[r]`` tokens, 0: none) and check
    what it returns; in a batch an error names the request (its key). Also the time of one request's proposal."""
    asked = [r for r, budget in enumerate(budgets) if budget > 0]
    drafts = [Draft.empty()] * len(rows)
    if not asked:
        return drafts, 0.0
    started = time.perf_counter()
    try:
        got = proposer.propose_requests(
            [rows[r].request_id for r in asked], [rows[r].sequence.ids for r in asked], [budgets[r] for r in asked]
        )
    except RequestFailed as error:
        key = next((row.job.key for row in rows if row.request_id == error.request), error.request)
        raise RuntimeError(f"{proposer!r}.propose() failed for request {key!r} of the batch: {error}") from error
    seconds = (time.perf_counter() - started) / len(asked)
    if not isinstance(got, list) or len(got) != len(asked):
        raise TypeError(
            f"{proposer!r}.propose_requests() must return a list of one specula.Draft per request "
            f"({len(asked)}), got {type(got).__name__}{f' of {len(got)}' if isinstance(got, list) else ''}."
        )
    for r, draft in zip(asked, got):
        where = f" (request {rows[r].job.key!r} of the batch)" if batched else ""
        drafts[r] = _checked(proposer, draft, budgets[r], vocab, where)
    return drafts, seconds


def _checked(proposer: Proposer, draft: object, budget: int, vocab: int, where: str) -> Draft:
    """``draft`` cut to ``budget`` tokens, after checking it is a :class:`Draft` of the target's token ids."""
    if not isinstance(draft, Draft):
        raise TypeError(f"{proposer!r}.propose(){where} must return a specula.Draft, got {type(draft).__name__}.")
    draft = draft.to_depth(budget)
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
    return draft


def propose(
    policy: DraftPolicy,
    proposer: RequestProposer | None,
    rows: list["Row"],
    vocab: int,
    batched: bool,
    takes_trees: bool,
    asks: bool = True,
) -> tuple[list[Draft], list[Draft]]:
    """A pass's first half: each row's proposed draft (its proposer's and its prediction's, sized by ``policy``; none
    where not ``asks``), and what of it the pass verifies (trees cut to their first branch where the target
    takes none)."""
    if not asks:  # (a plain pass: nothing to size)
        nothing = [Draft.empty()] * len(rows)
        return nothing, nothing
    budgets = policy.budgets([row.policy_state for row in rows], [row.sequence.room - 1 for row in rows])
    proposed, one_call = (
        _proposed(proposer, rows, budgets, vocab, batched)
        if proposer is not None
        else ([Draft.empty()] * len(rows), 0.0)
    )
    proposed = [
        with_prediction(row.prediction.propose(row.output, budget), draft)
        if row.prediction is not None and budget > 0
        else draft
        for row, draft, budget in zip(rows, proposed, budgets)
    ]
    proposed = [  # (a grammar's: what it takes of the draft, then what it forces, as far as the policy's trim sends)
        guided(row.guide, row.output, draft, min(MAX_DRAFT, row.sequence.room - 1))
        if row.guide is not None and budget > 0
        else draft
        for row, draft, budget in zip(rows, proposed, budgets)
    ]
    seconds = [one_call if budget > 0 else None for budget in budgets]
    for row, asked in zip(rows, seconds):
        row.stats.draft_time_s += asked or 0.0
    if not takes_trees:  # (trees need their own masks, and no recurrent state)
        proposed = [draft.chain() for draft in proposed]
    picks = policy.trim([row.policy_state for row in rows], proposed, seconds)
    return proposed, [draft.select(tokens) for draft, tokens in zip(proposed, picks)]


def advance(
    row: "Row",
    proposer: RequestProposer | None,
    new_tokens: list[int],
    sent: Draft,
    seen: "Seen | None" = None,
) -> list[int]:
    """A pass's last part for one row: append the tokens it gave the row (``sent`` verified; ``seen``: what its job
    asks to see of their positions) and tell the proposer what the row's output kept; return those."""
    kept = row.advance(new_tokens, sent, seen)
    if proposer is not None:
        proposer.observe_request(row.request_id, kept, min(len(new_tokens) - 1, len(kept)))
    return kept


@dataclasses.dataclass
class Job:
    """One request for :class:`Decoder`: a prompt, how its tokens are chosen and what ends its output."""

    prompt: np.ndarray  # [n] prompt tokens, no padding
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stopping_criteria: StoppingCriteriaList | None = None
    # how its tokens are chosen: its own logits processors (built from its own prompt) and random stream
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    key: object = None  # the caller's name for it (a row of a batch, a line of a file)
    # a left-padded prompt decoded alone, fed as model.generate feeds it: (tokens [L], positions [1, max_length],
    # attention mask [1, max_length])
    padded: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None
    prediction: np.ndarray | None = None  # [P] the tokens it expects back, drafted from (specula.proposers.prediction)
    adapter: str | None = None  # the PEFT adapter its passes take (None: the model's active one; verifier.adapters)
    cancelled: bool = False  # set (from any thread) to end its row after the pass under way: its caller went away
    logprobs: int | None = None  # each new token's log probability and its k likeliest alternatives (None: not asked)
    prompt_logprobs: int | None = None  # ... each prompt token's after its first (vLLM's name)
    keep_logits: bool = False  # each new token's position's logits, as the pass computed them (output_logits)
    keep_scores: bool = False  # ... its scores after the job's logits processors (output_scores)
    open_ended: bool = False  # its max_new_tokens is the context's end, not a bound of its own (a draining batch's)

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP:
                raise ValueError(
                    f"{name} must be None or 0-{MAX_TOP} (alternatives listed a token), got {getattr(self, name)}"
                )


class Row:
    """One request being decoded: its sequence, its id for the proposer, what the draft policy keeps for it, its
    counters."""

    def __init__(self, job: Job, policy_state: object) -> None:
        self.job, self.policy_state, self.sampling = job, policy_state, job.sampling
        self.request_id = next(_REQUEST_IDS)
        self.sequence = Sequence(job.prompt, job.max_new_tokens, job.eos_token_ids, job.stopping_criteria)
        self.stats = SpecStats(prompt_tokens=len(job.prompt))
        self.prediction = None if job.prediction is None else Prediction(job.prediction)
        self.guide = next((p for p in job.sampling.processors or () if isinstance(p, Guide)), None)  # (a grammar)
        self.finished = False
        self.started = time.perf_counter()
        self.logprobs: list[TokenLogprob] = []  # [len(output)] where its job asks for them
        self.logits: list[torch.Tensor] = []  # [len(output)] of [vocab], where its job keeps them
        self.scores: list[torch.Tensor] = []  # [len(output)] of [vocab], where its job keeps them
        self.prompt_logprobs: list[TokenLogprob] = []  # [len(prompt)] where its job asks for them (the first: None)
        self.first_logits: torch.Tensor | None = None  # [1, vocab] its prompt's last, in a batch (a twin's: Decoder)

    @property
    def output(self) -> np.ndarray:
        """The tokens it generated so far (a view)."""
        return self.sequence.ids[len(self.job.prompt) :]

    def advance(self, new_tokens: list[int], sent: Draft, seen: "Seen | None" = None) -> list[int]:
        """Record a pass that verified ``sent`` and produced ``new_tokens`` (``seen``: what the job asks to see of
        their positions) for this row; return the tokens its output kept."""
        accepted = len(new_tokens) - 1
        alone = len(sent.chain().path(new_tokens[:-1])) if sent.is_tree else None  # its first branch's
        self.stats.record_pass(len(sent), accepted, None if alone is None else accepted - alone)
        if self.prediction is not None:
            self.prediction.advance(sent, new_tokens)
            self.stats.accepted_prediction_tokens = self.prediction.accepted
            self.stats.rejected_prediction_tokens = self.prediction.rejected
        kept, self.finished = self.sequence.append(new_tokens)
        if seen is not None:
            self.logprobs += seen.logprobs[: len(kept)]
            self.logits += seen.logits[: len(kept)]
            self.scores += seen.scores[: len(kept)]
        self.finished = self.finished or self.job.cancelled
        now = time.perf_counter() - self.started
        if self.stats.passes == 1:
            self.stats.prefill_time_s = now
        self.stats.wall_time_s = now
        self.stats.new_tokens = self.sequence.length - self.stats.prompt_tokens
        return kept


class Decoder:
    """The speculation loop over a stream of requests, up to ``slots`` at a time in each verification pass
    (see :func:`specula.generate` for the arguments).

    :meth:`run` is a generator: for every pass it yields, per request, ``(row, kept_tokens)``; ``row.finished``
    says when a request is done (or cancelled: ``job.cancelled``), and a new one takes its place in the same pass as
    the next pass. ``jobs`` may be a live stream: ``None`` from it means none is waiting now (the run goes on with
    the rows it has, and asks again before the next pass). With ``makespan`` (a file's or a batch's requests: what
    counts is when the last ends), once no request waits for a slot the rows furthest from their end send the drafts
    (:func:`specula.policy.adaptive.finishing_worth`); without (a server: each request's own time counts), every
    row's tokens count alike. Each request is
    decoded with its own settings (``job.sampling``, its stopping criteria and length), whatever its batch-mates'.
    Its prompt is computed alone, as ``model.generate`` computes it; its tokens do not depend on the others in its
    batch (bit for bit where verification is row-exact, else up to rounding).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        proposer: Proposer | None,
        slots: int = 1,
        adaptive_draft: bool = True,
        exact: bool | Literal["invariant"] | None = None,
        predictions: bool = False,
        compile: bool | None = None,
        budget: CacheBudget | None = None,
        makespan: bool = True,
    ) -> None:
        if slots > 1 and (why := tokens_meet(model)):
            warnings.warn(
                f"{describe(model)} computes each row of a pass with the other rows' tokens in view ({why}), so a "
                "batch's rows would decode otherwise than alone: its requests are decoded one at a time, each as "
                "model.generate decodes it alone.",
                stacklevel=2,
            )
            slots = 1
        self.model, self.slots, self.compile, self.budget, self.makespan = model, slots, compile, budget, makespan
        self._waiting: Job | None = None  # (taken from the stream, first in line for a slot or the budget's room)
        self.proposer = None if proposer is None else for_requests(proposer)
        self.may_draft = proposer is not None or predictions  # (predictions: jobs may bring them)
        self.wide_passes = self.may_draft or slots > 1  # passes over several tokens or rows (else every one plain)
        self.adaptive_draft, self.exact = adaptive_draft, exact
        self._draws = getattr(proposer, "samples_drafts", False)  # (under sampling: drafts drawn at random)
        self.vocab = vocab_size(model)
        self.passes = 0  # target forward passes, prefills included
        self.prefill_seconds = self.pass_seconds = 0.0  # time in prefills, and in the other passes (proposing included)
        self.estimate = PlainEstimate(slots)  # the summary's: the run's plain passes, what its requests needed
        self.disturbed = False  # whether other programs took the CPUs during a run (its passes timed the load)
        self._guard: DraftGuard | None = None  # (where timings may decide: prepare())
        if proposer is not None:
            proposer.check_target(model)
        self._target: CachedModel | None = None
        self._trees = getattr(proposer, "proposes_trees", False)  # hold a single request as a batch row
        self.exactness: Exactness | None = None  # (chosen by prepare())
        self.policy: DraftPolicy | None = None
        self._save_costs = None  # (what stores the run's measured pass costs, where they decide: prepare())
        self.row_exact = False  # (row-exact verification: prepare())
        self.any_threads = False  # (invariant passes that round alike on any thread count: prepare())
        self.compiles: str | None = None  # (passes compiled: prepare())

    def prepare(self) -> Decoder:
        """Measure what the loop decides by, where this machine has not yet (:meth:`run` calls it before its first
        pass; a caller may earlier): whether verification is exact (:func:`~specula.verifier.exactness.choose`), the
        kernels its passes take (row-exact linear layers, or packed weights), and the kept pass costs that size drafts
        in ordinary bf16/fp16. (Attention kernels are chosen per head geometry on a pass's first use, and such a pass
        is not taken for what passes cost.)"""
        if self.policy is not None:
            return self
        model, slots, wide = self.model, self.slots, self.wide_passes
        asked = self.exact == "invariant"
        self.exactness = (
            Exactness(False, reason="compiled passes verify the ordinary way")
            if self.compile and self.exact is None and wide
            else choose(model, False if asked else self.exact, wide)
        )
        self.row_exact = wide and self.exactness.exact
        self.compiles = compiles(model, self.compile, self.row_exact)
        # ordinary bf16/fp16 passes that round every row as its one-token steps do, whatever the pass, where that
        # holds for the model here (specula.verifier.invariant): output then follows neither drafts, batches nor the
        # clock. Asked for, or by default where verification is not exact on a CPU (the kernels traced: the module's
        # docstring; a GPU's attention kernels split their keys by the shapes at hand, which the check may miss)
        if (
            (asked or (self.exact is None and model_device(model).type == "cpu"))
            and wide
            and not self.row_exact
            and is_half_precision(model)
            and not self.compiles
        ):
            if invariant_holds(model):
                self.exactness = dataclasses.replace(self.exactness, invariant=True)
                self.any_threads = any_threads(model)
            elif asked:
                warnings.warn(
                    "exact='invariant': this model's ordinary passes do not round alike whatever the pass on this "
                    "machine (checked: specula.verifier.invariant), so they verify the ordinary way; exact=True "
                    "answers alike everywhere.",
                    stacklevel=3,
                )
        if self.row_exact:  # (built here, kept with the model: no pass of the run measures them)
            row_exact_for(model)
        else:
            packed_for(model, timed=not self.exactness.invariant)
        # Draft lengths follow measured timings only where the output cannot depend on them: greedy decoding, and
        # sampling with drafts not drawn at random (each token is drawn as model.generate draws it), with passes
        # that round as one-token steps do (row-exact or invariant; or in fp32, far below the gaps between logits).
        # With other ordinary passes in bf16/fp16 they follow pass costs measured once per machine and kept (by rows
        # and tokens; corrected where a run's passes cost far more: specula.policy.kept_costs), so that a request
        # decodes the same on every run; a pass with a row whose drafts are drawn at random (sampled, from a sampling
        # drafter), acceptance alone.
        timed = self.row_exact or not is_half_precision(model) or self.exactness.invariant
        setting = (model_device(model), getattr(model, "dtype", None))
        stored_costs = functools.cache(functools.partial(kept_pass_costs, model, MAX_DRAFT, compiled=self.compiles))
        if self.adaptive_draft and not timed and wide:
            for rows in range(1, slots + 1):  # (measured now, where they were not kept: not in a pass)
                stored_costs(rows)

        def costs(rows: int) -> PassCosts | None:  # measured while decoding, or kept, or none
            return (
                shared_pass_costs(model, setting, MAX_DRAFT, rows)
                if timed
                else stored_costs(rows)
                if self.adaptive_draft and wide
                else None
            )

        self.policy = AdaptiveDrafts(MAX_DRAFT, timed, costs) if self.adaptive_draft else FixedDrafts(MAX_DRAFT)
        self._guard = DraftGuard() if timed and self.adaptive_draft else None
        # (measured costs are kept for the next process)
        self._save_costs = (
            functools.partial(keep_pass_costs, model, setting, MAX_DRAFT)
            if timed and self.adaptive_draft and wide
            else None
        )
        store.shared().tell()
        return self

    def _cached_model(self, job: Job, capacity: int) -> CachedModel:
        # position ids as model.generate passes them (some models number tokens wrongly by themselves: Bamba)
        positions = torch.arange(len(job.prompt) + job.max_new_tokens, device=model_device(self.model))[None]
        mask = None
        if job.padded is not None:
            positions, mask = job.padded[1:]
        make = functools.partial(
            cached_model,
            self.model,
            positions=positions,
            attention_mask=mask,
            rollback=self.may_draft,
            capacity=capacity,
            row_exact=self.row_exact,
            slots=self.slots,
            cheap_steps=not self.exactness.exact,
            invariant=self.exactness.invariant,
            any_threads=self.any_threads,
        )
        if self.compiles and job.padded is None:  # (a left-padded prompt alone: model.generate's positions, eager)
            return make(compiled=self.compiles, max_width=MAX_DRAFT + 1)
        # (a prediction and a proposer draft a tree of both: neither is worse than alone)
        trees = self._trees or (job.prediction is not None and self.proposer is not None)
        if self.slots == 1 and trees and job.padded is None:
            try:
                return make(trees=True)
            except UnsupportedModelError as error:
                if self._trees:
                    warnings.warn(f"{error} So {self.proposer!r}'s trees are cut to their first branch.", stacklevel=5)
                self._trees = False
        return make()

    def _start(self, index: int, job: Job, rows: list[Row | None] = ()) -> tuple[Row, list[int]]:
        """Make ``job`` row ``index`` of the batch (beside ``rows``): its prompt in the cache, its first token."""
        row = Row(job, self.policy.start(drawn=self._draws and not job.sampling.greedy))
        row.stats.exactness = self.exactness
        if self.proposer is not None:
            self.proposer.start_request(row.request_id, row.sequence.ids, row.sampling)
        capacity = room(job) - job.max_new_tokens + min(job.max_new_tokens, FIRST_ROOM)
        if self._target is None or (self.slots == 1 and (self._target.compiled is None or job.padded is not None)):
            self._target = self._cached_model(job, capacity)  # (compiled passes keep their cache and its shapes)
        row.stats.compiled = self._target.compiled is not None
        started = time.perf_counter()
        logits = self._prefill(index, row, rows)
        nothing = Draft.empty()
        first = accept_draft(logits, nothing, row.sampling, self._tokens(row, nothing))
        kept = advance(row, self.proposer, first, nothing, _seen(row, logits, first, nothing))
        self.prefill_seconds += time.perf_counter() - started
        return row, kept

    def _prefill(self, index: int, row: Row, rows: list[Row | None]) -> torch.Tensor:
        """Row ``index`` holds ``row``'s prompt; the logits its first token is chosen from (``[1, vocab]``). A live
        row of the same prompt (OpenAI's ``n``, a file's repeated prompt) gives its states and logits, the very ones
        a prefill would compute; else the prompt is computed alone (its every position's logits where its job asks
        for the prompt's log probabilities)."""
        job = row.job
        if job.prompt_logprobs is None and (twin := self._twin(job, rows)) is not None:
            self._target.copy_prefix(rows.index(twin), index, len(job.prompt))
            row.first_logits = twin.first_logits
            return twin.first_logits
        feed = job.prompt if job.padded is None else job.padded[0]  # (padded: alone, as model.generate feeds it)
        positions = 1 if job.prompt_logprobs is None else len(job.prompt)  # (whose logits are kept)
        logits = self._target.start_row(index, torch.from_numpy(feed).to(self._target.device), job.adapter, positions)
        self.passes += 1
        if job.prompt_logprobs is not None:  # (position i chose prompt token i + 1)
            first = TokenLogprob(int(job.prompt[0]), None)
            row.prompt_logprobs = [first, *token_logprobs(logits[:-1], job.prompt[1:].tolist(), job.prompt_logprobs)]
            logits = logits[-1:].clone()  # (not a view keeping every position's logits alive)
        if self.slots > 1:
            row.first_logits = logits
        return logits

    def _twin(self, job: Job, rows: list[Row | None]) -> Row | None:
        """A live row of the batch whose prompt and adapter are ``job``'s, where a row's states can be copied (every
        layer full attention: a sliding window's may have given its first tokens back)."""
        target = self._target  # (a batch's: RaggedRows)
        if self.slots == 1 or job.padded is not None or target.window is not None or target.rows_state is not None:
            return None
        return next(
            (
                other
                for other in rows
                if other is not None
                and other.first_logits is not None
                and other.job.adapter == job.adapter
                and np.array_equal(other.job.prompt, job.prompt)
            ),
            None,
        )

    def plain_comparison(self) -> tuple[float, float] | None:
        """What the run would have cost as plain decoding of the same requests in batches of as many rows, and what it
        cost, in seconds (prefills and proposing included): :meth:`PlainEstimate.comparison`; ``None`` where other
        programs took the CPUs during a run (:attr:`disturbed`: its plain passes priced the load of their moments, on
        the thread counts tried then: docs/cost-model.md)."""
        if self.disturbed:
            return None
        return self.estimate.comparison(self.prefill_seconds, self.pass_seconds)

    def plain_speedup(self) -> float | None:
        """Estimated speedup of the run so far against plain decoding of the same requests
        (:meth:`plain_comparison`)."""
        comparison = self.plain_comparison()
        return None if comparison is None else comparison[0] / comparison[1]

    def _tokens(self, row: Row, sent: Draft) -> torch.Tensor | None:
        """What logits processors read: the row's sequence followed by the draft it sends."""
        return row.sequence.with_draft(sent, self._target.device) if row.sampling.reads_tokens else None

    def run(self, jobs: Iterable[Job | None]) -> Iterator[tuple[Row, list[int]]]:
        return without_grad(self.model)(self._run)(jobs)

    def _run(self, jobs: Iterable[Job | None]) -> Iterator[tuple[Row, list[int]]]:
        self.prepare()
        load = LoadMeter()  # (what other programs take of the CPUs meanwhile: a shared run's costs are not kept)
        jobs, rows = iter(jobs), []  # rows[i]: row i of the target's batch (None: its request finished)
        try:
            while True:
                yield from self._fill(rows, jobs)
                rows = self._shrink(rows)
                if not rows:
                    return
                started = time.perf_counter()
                proposed, sent = self._propose(rows, jobs)
                outcomes, seen = self._verify(rows, proposed, sent)
                self.pass_seconds += time.perf_counter() - started
                yield from self._advance(rows, outcomes, sent, seen)
        finally:  # (a run given up keeps no request in the proposer)
            for row in rows:
                if row is not None and not row.finished:
                    self._finish(row)
            self.disturbed = self.disturbed or load.disturbed()
            for count in range(1, self.slots + 1) if self._save_costs else ():
                self._save_costs(count, load)

    def _fill(self, rows: list[Row | None], jobs: Iterator[Job]) -> Iterator[tuple[Row, list[int]]]:
        """Start requests in the free slots; one may end with its first token (the next one then takes the slot)."""
        for index in range(self.slots):
            while (index >= len(rows) or rows[index] is None) and (job := self._admitted(rows, index, jobs)):
                row, kept = self._start(index, job, rows)
                rows[index : index + 1] = [None if row.finished else row]
                self._hold(rows)
                yield row, kept
                if row.finished:
                    self._finish(row)
            if index >= len(rows):
                return

    def release(self) -> None:
        """No request is in flight (a server waits for the next): the cache gives its memory back, down to one row of
        the room it was first asked for. Called from within :meth:`run`'s wait for a job, by the job stream."""
        if self._target is not None:
            self._target.select_rows([])

    def _admitted(self, rows: list[Row | None], index: int, jobs: Iterator[Job]) -> Job | None:
        """The next job, for slot ``index``, where the budget holds the batch's cache with it (:mod:`.budget`; else it
        waits, first in line, for rows to leave)."""
        job, self._waiting = self._waiting or next(jobs, None), None
        if job is None or self.budget is None:
            return job
        rooms = [room(row.job) for row in rows if row is not None]
        if not rooms and (why := self.budget.refusal(room(job))):
            raise ValueError(why)
        if rooms and not self.budget.fits(rooms + [room(job)], max(len(rows), index + 1)):
            self._waiting = job
            return None
        return job

    def _none_waits(self, rows: list[Row], jobs: Iterator[Job | None]) -> bool:
        """Whether no request waits for a slot: where every slot is taken, the stream is asked for its next job, which
        then waits first in line (``None``: none now)."""
        if self._waiting is None and len(rows) == self.slots:
            self._waiting = next(jobs, None)
        return self._waiting is None

    def _hold(self, rows: list[Row | None]) -> None:
        """Hold the cache's buffers to what the budget admitted for these rows (``None``: a slot left since)."""
        if self.budget is not None and any(rows):
            self._target.hold(len(rows), max(room(row.job) for row in rows if row is not None))

    def _shrink(self, rows: list[Row | None]) -> list[Row]:
        """No request is left to take the free slots: the batch loses those rows, each free slot among the rows that
        stay taken by one of the last rows (whose cache alone moves, not every row after the slot)."""
        if None in rows:
            staying = len(rows) - rows.count(None)
            movers = iter(i for i in range(staying, len(rows)) if rows[i] is not None)
            order = [i if rows[i] is not None else next(movers) for i in range(staying)]
            self._target.select_rows(order)
            rows = [rows[i] for i in order]
        self._hold(rows)
        return rows

    def _propose(self, rows: list[Row], jobs: Iterator[Job | None]) -> tuple[list[Draft], list[Draft]]:
        """Each row's proposed draft, and what of it this pass verifies (:func:`propose`); none in a plain pass the
        summary's estimate is due (:meth:`PlainEstimate.due`: counted in passes, so decided alike on every run), nor
        where timings may decide and drafts lost against plain passes here (:mod:`specula.policy.guard`). The policy
        is told whether the pass is flat and whether the run drains (``makespan`` and no job waiting)."""
        due = self.adaptive_draft and self.estimate.due(len(rows))
        resting = self._guard is not None and not self._guard.allows(len(rows))  # (drafts lost here: guard.py)
        self.policy.flat = self._target.flat_rows()
        draining = self.makespan and len(rows) > 1 and self._none_waits(rows, jobs)
        self.policy.draining = _left(rows) if draining else None
        return propose(
            self.policy,
            self.proposer,
            rows,
            self.vocab,
            self.slots > 1,
            self._target.takes_trees,
            asks=self.may_draft and not due and not resting,
        )

    def _verify(
        self, rows: list[Row], proposed: list[Draft], sent: list[Draft]
    ) -> tuple[list[list[int]], list["Seen | None"]]:
        """One pass over each row's last token and sent draft: the tokens each row keeps (the accepted drafts and the
        target's own) and what its job asks to see of their positions; the KV cache rolled back past the rest, the
        policy told."""
        started = time.perf_counter()
        device = self._target.device
        lengths = [len(draft) + 1 for draft in sent]
        tokens = np.empty((len(rows), max(lengths)), dtype=np.int64)  # [B, n]: each row's block, its last repeated
        for b, (row, draft) in enumerate(zip(rows, sent)):
            tokens[b, 0], tokens[b, 1 : lengths[b]] = row.sequence.ids[-1], draft.tokens.numpy()
            tokens[b, lengths[b] :] = tokens[b, lengths[b] - 1]
        on_device = torch.from_numpy(tokens).to(device)  # (one copy)
        blocks = [on_device[b, :length] for b, length in enumerate(lengths)]
        argmax_only = all(  # (logits unused but for their argmax)
            row.sampling.greedy and not row.sampling.processors and not _sees(row.job) for row in rows
        )
        keys = self._target.cached_tokens
        trees = [_tree(d) for d in sent]
        computed = sum(lengths) if self._target.flat(blocks, trees) else len(rows) * max(lengths)  # (tokens in all)
        logits = self._target.forward_rows(blocks, lengths, trees, argmax_only)
        outcomes = accept_drafts(logits, sent, [row.sampling for row in rows], lambda r: self._tokens(rows[r], sent[r]))
        seen = [_seen(row, *made) for row, made in zip(rows, zip(logits, outcomes, sent))]
        self.passes += 1
        verified = time.perf_counter()
        self._target.keep_rows(
            [len(new) for new in outcomes], [_path(draft, new) for draft, new in zip(sent, outcomes)]
        )
        # (recurrent state fed again after a rejected draft: a second pass, part of what the pass cost)
        seconds = (time.perf_counter() if self._target.feeds_again else verified) - started
        if not self._target.timed:  # (it calibrated or compiled kernels)
            seconds = None
        self.policy.learn(Pass([row.policy_state for row in rows], proposed, sent, outcomes, computed, seconds, keys))
        width = max(lengths)
        self.estimate.record(len(rows), width, seconds, keys)
        if seconds is not None and self._guard is not None:  # (each row's tokens worth what the policy weighed)
            left = self.policy.draining
            worth = np.ones(len(rows)) if left is None else finishing_worth(left)
            self._guard.record(
                len(rows),
                seconds,
                float(np.dot(worth, [len(new) for new in outcomes])) if width > 1 else None,
                self.estimate.plain.get(len(rows), []),
                float(worth.sum()),
            )
        return outcomes, seen

    def _advance(self, rows: list[Row | None], outcomes: list[list[int]], sent: list[Draft], seen: list):
        """Append each row's new tokens (and what its job sees of them) and yield what its output kept; a finished
        row frees its slot."""
        for index, (row, tokens, draft, own) in enumerate(zip(rows, outcomes, sent, seen)):
            yield row, advance(row, self.proposer, tokens, draft, own)
            if row.finished:
                rows[index] = None
                self._finish(row)

    def _finish(self, row: Row) -> None:
        self.estimate.finished(row.request_id, len(row.output) - 1, len(row.job.prompt))
        if self.proposer is not None:
            self.proposer.stop_request(row.request_id)


def _left(rows: list[Row]) -> list[int]:
    """Each row's tokens left before its end as far as the run knows it: its room, but for a job whose bound is the
    context's end (``open_ended``), which says nothing of when its answer ends: the most of the batch's."""
    left = [row.sequence.room - 1 for row in rows]
    most = max(left)
    return [most if row.job.open_ended else tokens for row, tokens in zip(rows, left)]


def room(job: Job) -> int:
    """The tokens a job's row of the cache may come to hold: its prompt, its new tokens and a pass's draft."""
    return len(job.prompt) + job.max_new_tokens + 2 * (MAX_DRAFT + 1)


def _tree(draft: Draft) -> list[int] | None:
    """A tree draft's block layout for the target (block index of each token's parent: the last token, then the
    draft); ``None`` for a chain."""
    return None if draft.parents is None else [-1] + [parent + 1 for parent in draft.parents]


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a job asks to see of the positions that chose a row's new tokens, one entry per token (empty: not
    asked): their log probabilities, their logits, their scores after the job's logits processors."""

    logprobs: list[TokenLogprob]
    logits: list[torch.Tensor]  # [vocab] each
    scores: list[torch.Tensor]  # [vocab] each


def _sees(job: Job) -> bool:
    """Whether ``job`` asks to see anything of its tokens' positions."""
    return job.logprobs is not None or job.keep_logits or job.keep_scores


def _seen(row: Row, logits: torch.Tensor, new_tokens: list[int], sent: Draft) -> Seen | None:
    """What ``row``'s job asks to see of the positions that chose its ``new_tokens``, read from the pass's ``logits``
    (``[len(sent) + 1, vocab]``) at the block position that chose each (a tree's: along its accepted path); scores
    as the acceptance computes them there (:meth:`~specula.core.sampling.Sampling.scores`, each position after the
    tokens before it)."""
    job = row.job
    if not _sees(job):
        return None
    positions = _path(sent, new_tokens) or list(range(len(new_tokens)))  # (a tree's: the last token, then its path)
    picked = logits[positions[: len(new_tokens)]]  # [len(new_tokens), vocab]
    before = row.sequence.with_draft(Draft(new_tokens[:-1]), picked.device)  # (the tokens each position follows)
    return Seen(
        [] if job.logprobs is None else token_logprobs(picked, new_tokens, job.logprobs),
        list(picked.float()) if job.keep_logits else [],
        list(row.sampling.scores(picked, before)) if job.keep_scores else [],
    )


def _path(draft: Draft, new_tokens: list[int]) -> list[int] | None:
    """The block indices a pass over a tree draft keeps (the last token and the accepted path); ``None``: a chain's
    first ones."""
    return None if draft.parents is None else [0] + [node + 1 for node in draft.path(new_tokens[:-1])]
