"""The speculation loop: propose, verify in one pass, accept, roll back, repeat."""

from __future__ import annotations

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
    """Prompt + output on the host, in a buffer sized once; stops exactly at EOS, a stopping criterion, or the
    length limit."""

    def __init__(self, request: Request, stopping_criteria: StoppingCriteriaList | None = None) -> None:
        self.tokens = np.empty(request.max_length, dtype=np.int64)
        self.length = len(request.prompt)
        self.tokens[: self.length] = request.prompt
        self.eos_token_ids = request.eos_token_ids
        self.stopping_criteria = stopping_criteria

    @property
    def ids(self) -> np.ndarray:
        return self.tokens[: self.length]

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
    lengths: DraftLength | None,
) -> Draft:
    """Ask the proposer for at most ``budget`` tokens and check what it returns."""
    if proposer is None or budget <= 0:
        return Draft.empty()
    started = time.perf_counter()
    draft = proposer.propose(context, budget)
    seconds = time.perf_counter() - started
    stats.draft_time_s += seconds
    if lengths is not None:
        lengths.record_draft_time(seconds)
    if not isinstance(draft, Draft):
        raise TypeError(f"{proposer!r}.propose() must return a specula.Draft, got {type(draft).__name__}.")
    draft = draft.head(budget)
    if len(draft) and (int(draft.tokens.min()) < 0 or int(draft.tokens.max()) >= vocab):
        bad = int(draft.tokens.min()) if int(draft.tokens.min()) < 0 else int(draft.tokens.max())
        raise ValueError(
            f"{proposer!r} proposed token id {bad}, outside the target's vocabulary of {vocab} tokens; "
            "the proposer must use the target's tokenizer."
        )
    if draft.probs is not None and draft.probs.shape[1] != vocab:
        raise ValueError(
            f"{proposer!r} returned draft probabilities over {draft.probs.shape[1]} tokens but the target's "
            f"vocabulary has {vocab}; give q over the target's token ids."
        )
    return draft


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
) -> GenerateOutput:
    """The speculation loop on a validated request (see :func:`specula.generate`)."""
    started = time.perf_counter()
    sequence = _Sequence(request, stopping_criteria)
    stats = SpecStats(prompt_tokens=sequence.length)
    if request.max_length > sequence.length:
        row_exact = proposer is not None and wanted(model, row_exact)
        target = CachedModel(
            model, request.positions, request.attention_mask, rollback=proposer is not None,
            capacity=request.max_length, row_exact=row_exact,
        )
        vocab = vocab_size(model)
        if proposer is not None:
            proposer.check_target(model)
            proposer.begin(sequence.ids, sampling)
        lengths = None
        if proposer is not None and adaptive_draft:
            setting = (request.device, getattr(model, "dtype", None))
            # Timings decide draft lengths only where the output cannot depend on them: greedy, with passes that
            # round as one-token steps do (or in fp32, far below the gaps between logits). Elsewhere lengths follow
            # acceptance alone, so that a request decodes the same on every run.
            timed = sampling.greedy and (row_exact or not is_half_precision(model))
            costs = shared_step_seconds(model, setting, MAX_DRAFT) if timed else None
            lengths = DraftLength(MAX_DRAFT, timed=timed, step_seconds=costs)

        def next_draft() -> Draft:
            remaining = request.max_length - sequence.length - 1
            budget = remaining if lengths is None else lengths.budget(remaining)
            return _propose(proposer, sequence.ids, budget, vocab, stats, lengths)

        # The first pass is the prefill of the prompt alone, as model.generate's: some models compute a prompt
        # differently when more tokens share its pass (Doge's dynamic masks; rounding in bf16).
        draft = Draft.empty()
        block = torch.from_numpy(request.prompt)
        while True:
            step_started = time.perf_counter()
            sent = draft if lengths is None else draft.head(lengths.best_length(len(draft), draft.source))
            block = torch.cat([block, sent.tokens]).to(request.device)
            logits = target.forward(block, num_logits=len(sent) + 1)
            input_ids = sequence.with_draft(sent, request.device) if sampling.reads_tokens else None
            new_tokens = accept_draft(logits, sent, sampling, input_ids)
            target.rollback(len(sent) + 1 - len(new_tokens))
            if lengths is not None:
                if stats.steps:  # (the prefill is not a verification step)
                    lengths.record_step(len(block), time.perf_counter() - step_started)
                lengths.record_outcome(draft.tokens.tolist(), new_tokens, draft.source)
            stats.record_step(drafted=len(sent), accepted=len(new_tokens) - 1)
            if stats.steps == 1:
                stats.prefill_time_s = time.perf_counter() - started
            kept, finished = sequence.append(new_tokens)
            if streamer is not None:
                streamer.put(torch.tensor(kept))
            if proposer is not None:
                proposer.observe(kept, min(len(new_tokens) - 1, len(kept)))
            if finished:
                break
            draft = next_draft()
            block = torch.from_numpy(sequence.tokens[sequence.length - 1 : sequence.length])
    if streamer is not None:
        streamer.end()
    stats.new_tokens = sequence.length - stats.prompt_tokens
    stats.wall_time_s = time.perf_counter() - started
    return GenerateOutput(sequences=torch.from_numpy(sequence.ids.copy())[None].to(request.device), stats=stats)
