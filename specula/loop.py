"""The speculation loop: propose, verify in one pass, accept, roll back, repeat."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from transformers import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .acceptance import accept_draft
from .cached_model import CachedModel
from .draft_length import DraftLength, shared_step_seconds
from .inputs import Request, vocab_size
from .proposer import Draft, Proposer
from .row_exact import is_half_precision, wanted
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


def _propose(
    proposer: Proposer | None, context: np.ndarray, budget: int, vocab: int, stats: SpecStats,
    lengths: DraftLength | None, row: int | None = None,
) -> Draft:
    """Ask the proposer for at most ``budget`` tokens and check what it returns (``row``: which row of a batch)."""
    if proposer is None or budget <= 0:
        return Draft.empty()
    started = time.perf_counter()
    try:
        draft = proposer.propose(context, budget)
    except Exception as error:
        if row is None:
            raise
        raise RuntimeError(f"{proposer!r}.propose() failed for row {row} of the batch: {error}") from error
    seconds = time.perf_counter() - started
    stats.draft_time_s += seconds
    if lengths is not None:
        lengths.record_draft_time(seconds)
    where = "" if row is None else f" (row {row} of the batch)"
    if not isinstance(draft, Draft):
        raise TypeError(f"{proposer!r}.propose(){where} must return a specula.Draft, got {type(draft).__name__}.")
    draft = draft.head(budget)
    if len(draft) and (int(draft.tokens.min()) < 0 or int(draft.tokens.max()) >= vocab):
        bad = int(draft.tokens.min()) if int(draft.tokens.min()) < 0 else int(draft.tokens.max())
        raise ValueError(
            f"{proposer!r} proposed token id {bad}{where}, outside the target's vocabulary of {vocab} tokens; "
            "the proposer must use the target's tokenizer."
        )
    if draft.probs is not None and draft.probs.shape[1] != vocab:
        raise ValueError(
            f"{proposer!r} returned draft probabilities{where} over {draft.probs.shape[1]} tokens but the target's "
            f"vocabulary has {vocab}; give q over the target's token ids."
        )
    return draft


class _Row:
    """One request of a batch: its sequence, proposer, draft-length policy, counters, and the draft it sends next."""

    def __init__(
        self, index: int | None, sequence: _Sequence, proposer: Proposer | None, lengths: DraftLength | None,
        sampling: Sampling,
    ) -> None:
        self.index = index  # the row of the batch (None when there is one)
        self.sequence, self.proposer, self.lengths, self.sampling = sequence, proposer, lengths, sampling
        self.stats = SpecStats(prompt_tokens=sequence.length)
        self.draft = self.sent = Draft.empty()

    def choose(self) -> Draft:
        """The part of the proposed draft this step verifies."""
        lengths = self.lengths
        self.sent = self.draft if lengths is None else self.draft.head(lengths.best_length(len(self.draft), self.draft.source))
        return self.sent

    def take(self, new_tokens: list[int], verified: int, seconds: float, streamer: BaseStreamer | None) -> bool:
        """Record a step that verified ``verified`` tokens and produced ``new_tokens``; return whether the request
        is finished."""
        if self.lengths is not None:
            if self.stats.steps:  # (the prefill is not a verification step)
                self.lengths.record_step(verified, seconds)
            self.lengths.record_outcome(self.draft.tokens.tolist(), new_tokens, self.draft.source)
        self.stats.record_step(drafted=len(self.sent), accepted=len(new_tokens) - 1)
        kept, finished = self.sequence.append(new_tokens)
        if streamer is not None:
            streamer.put(torch.tensor(kept))
        if self.proposer is not None:
            self.proposer.observe(kept, min(len(new_tokens) - 1, len(kept)))
        return finished


@torch.inference_mode()
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
    """The speculation loop on a validated request of one or more rows (see :func:`specula.generate`);
    ``row_generators`` gives each row its own random stream."""
    started = time.perf_counter()
    batch, width = request.input_ids.shape
    new_tokens = request.max_length - width
    # Draft lengths follow measured timings only where the output cannot depend on them: greedy, one row, with
    # passes that round as one-token steps do (or in fp32, far below the gaps between logits). Elsewhere they follow
    # acceptance alone, so that a request decodes the same on every run.
    row_exact = proposer is not None and batch == 1 and wanted(model, row_exact)
    timed = sampling.greedy and batch == 1 and (row_exact or not is_half_precision(model))
    costs = shared_step_seconds(model, (request.device, getattr(model, "dtype", None)), MAX_DRAFT) if timed else None
    if proposer is not None and new_tokens > 0:
        proposer.check_target(model)
    rows = []
    for b in range(batch):
        row_proposer = None if proposer is None else proposer if b == 0 else proposer.fork()
        lengths = DraftLength(MAX_DRAFT, timed=timed, step_seconds=costs) if proposer and adaptive_draft else None
        sequence = _Sequence(request.prompt(b), new_tokens, request.eos_token_ids, stopping_criteria)
        row_sampling = sampling if row_generators is None else dataclasses.replace(sampling, generator=row_generators[b])
        rows.append(_Row(b if batch > 1 else None, sequence, row_proposer, lengths, row_sampling))
    passes = 0
    if new_tokens > 0:
        target = CachedModel(
            model, request.positions, request.attention_mask, rollback=proposer is not None,
            capacity=request.max_length + (MAX_DRAFT + 1 if batch > 1 else 0), row_exact=row_exact,
        )
        vocab = vocab_size(model)
        for row in rows:
            if row.proposer is not None:
                row.proposer.begin(row.sequence.ids, row.sampling)
        # The first pass is the prefill of the prompts alone, as model.generate's: some models compute a prompt
        # differently when more tokens share its pass (Doge's dynamic masks; rounding in bf16).
        active = rows  # in the target's row order
        blocks = [torch.from_numpy(request.input_ids[b]) for b in range(batch)]
        while active:
            step_started = time.perf_counter()
            blocks = [torch.cat([block, row.choose().tokens]).to(request.device) for block, row in zip(blocks, active)]
            logits = target.forward_rows(blocks, [len(row.sent) + 1 for row in active])
            seconds, kept, finished = time.perf_counter() - step_started, [], []
            for row, block, row_logits in zip(active, blocks, logits):
                input_ids = row.sequence.with_draft(row.sent, request.device) if sampling.reads_tokens else None
                tokens = accept_draft(row_logits, row.sent, row.sampling, input_ids)
                kept.append(len(block) - len(row.sent) + len(tokens) - 1)  # the block but its rejected drafts
                finished.append(row.take(tokens, len(block), seconds, streamer))
            target.keep_rows(kept)
            passes += 1
            now = time.perf_counter() - started
            if passes == 1:
                prefill_time = now
            for row in active:  # (a finished row keeps the time it ended)
                row.stats.prefill_time_s, row.stats.wall_time_s = prefill_time, now
            target.select_rows([i for i, done in enumerate(finished) if not done])
            active = [row for row, done in zip(active, finished) if not done]
            for row in active:
                remaining = row.sequence.room - 1
                budget = remaining if row.lengths is None else row.lengths.budget(remaining)
                row.draft = _propose(row.proposer, row.sequence.ids, budget, vocab, row.stats, row.lengths, row.index)
            blocks = [torch.from_numpy(row.sequence.ids[-1:]) for row in active]
    if streamer is not None:
        streamer.end()
    for row in rows:
        row.stats.new_tokens = row.sequence.length - row.stats.prompt_tokens
    stats = SpecStats.total([row.stats for row in rows], steps=passes, wall_time_s=time.perf_counter() - started,
                            prefill_time_s=prefill_time if passes else 0.0)
    return GenerateOutput(sequences=_padded(request, rows).to(request.device), stats=stats)


def _padded(request: Request, rows: list[_Row]) -> torch.Tensor:
    """``[B, L + new]``: each row's (padded) prompt and new tokens, rows that ended early padded after their end
    with ``request.pad_token_id``, as ``model.generate`` pads them."""
    width = request.input_ids.shape[1]
    new = [row.sequence.ids[row.stats.prompt_tokens :] for row in rows]
    out = np.full((len(rows), width + max(map(len, new))), request.pad_token_id, dtype=np.int64)
    out[:, :width] = request.input_ids
    for b, tokens in enumerate(new):
        out[b, width : width + len(tokens)] = tokens
    return torch.from_numpy(out)
