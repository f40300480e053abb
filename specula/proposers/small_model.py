"""SmallModelDrafter: a smaller HF causal LM of the same vocabulary drafts for the target."""

from __future__ import annotations

import copy

from typing import Sequence

import numpy as np
import torch

from ..target.runner import CachedModel, UnsupportedModelError
from ..target.support import vocab_size
from ..core.draft import Draft, check_int
from .base import Proposer
from ..core.sampling import Sampling


def _vocab_description(tokenizer) -> str:
    return f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}, {len(tokenizer)} tokens)"


class SmallModelDrafter(Proposer):
    """Draft with a smaller model of the target's vocabulary (speculative decoding as in Leviathan et al. 2023).

    The drafter keeps its own KV cache: the prompt is read once, on the first proposal; afterwards only the tokens
    the verifier appended are fed, and the cache is rolled back past rejected drafts, so the context is never
    re-read. It drafts greedily when the target decodes greedily, and under sampling draws each token with the
    target's warpers and returns the distributions ``q`` it drew from (which the acceptance rule needs).

    Draft length adapts between 1 and ``max_draft``: +2 after a fully accepted draft, -1 otherwise (HF's schedule);
    in greedy decoding a draft also stops early where the drafter's own probability of its token falls below
    ``min_confidence``, the point past which its guesses are mostly rejected.

    Args:
        draft_model: any HF decoder-only causal LM sharing the target's token ids; its dtype and device may differ
            from the target's.
        num_draft: draft length to start with (and the fixed length when ``adaptive=False``).
        max_draft: longest draft when adapting.
        adaptive: adapt the draft length to the acceptance.
        min_confidence: greedy drafts stop after a token the drafter gives less than this probability (0 disables).
        tokenizer, target_tokenizer: when both are given they must have the same vocabulary; ``tokenizer`` also
            tells the real vocabulary size when the two models' embedding matrices differ only by padding rows.
    """

    samples_drafts = True  # under sampling it draws its drafts (and says from what: Draft.probs)

    def __init__(
        self,
        draft_model: torch.nn.Module,
        num_draft: int = 5,
        *,
        max_draft: int = 16,
        adaptive: bool = True,
        min_confidence: float = 0.4,
        tokenizer=None,
        target_tokenizer=None,
    ) -> None:
        check_int("num_draft", num_draft, 1, " (tokens proposed per step)")
        check_int("max_draft", max_draft, num_draft, " (num_draft)")
        if not 0 <= min_confidence < 1:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence!r}.")
        if tokenizer is not None and target_tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(
                f"The drafter's tokenizer {_vocab_description(tokenizer)} and the target's "
                f"{_vocab_description(target_tokenizer)} have different vocabularies; a drafter must use the target's "
                "token ids. Pick a draft model from the target's family."
            )
        self.model = draft_model.eval()
        self.num_draft, self.max_draft, self.adaptive = num_draft, max_draft, adaptive
        self.min_confidence = min_confidence
        self.tokenizer = tokenizer
        self.device = draft_model.get_input_embeddings().weight.device
        self.target_vocab = self.shared_vocab = vocab_size(draft_model)
        self.batch = _Rows()  # the draft model's cache for the rows of a batch, shared with forks
        self.slot: int | None = None  # this row's place in it

    def check_target(self, model: torch.nn.Module) -> None:
        draft_rows, target_rows = vocab_size(self.model), vocab_size(model)
        if draft_rows != target_rows:
            real = len(self.tokenizer) if self.tokenizer is not None else None
            if real is None or real > min(draft_rows, target_rows):
                raise ValueError(
                    f"The draft model {type(self.model).__name__} has a vocabulary of {draft_rows} tokens and the target "
                    f"{type(model).__name__} has {target_rows}: they must share one token space. If the difference "
                    "is only padding rows of the embedding matrix, pass tokenizer= so the real vocabulary can be "
                    "checked."
                )
        self.target_vocab = target_rows
        self.shared_vocab = min(draft_rows, target_rows) if self.tokenizer is None else len(self.tokenizer)

    def begin(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self.sampling = sampling
        self.cache = CachedModel(self.model, positions=None, attention_mask=None, rollback=True)
        self.cached_ids: list[int] = []  # what the cache holds (this row's, in a batch)
        self.confirmed = 0  # how many of them are known to be in the sequence
        self.last_draft_length = 0

    @torch.inference_mode()
    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        return self._drafts([self], [context_ids], [max_tokens], None)[0]

    @torch.inference_mode()
    def propose_rows(self, rows, contexts, budgets) -> list[Draft]:
        """All rows' drafts from batched passes of the draft model: each pass feeds every drafting row its next
        token (rows that catch up feed the tokens the verifier appended). Rows keep their own places in one cache
        of the draft model; a model that cannot be batched drafts row by row."""
        batch = self.batch.cache_for(self.model, rows)
        if batch is None:
            return super().propose_rows(rows, contexts, budgets)
        return self._drafts(rows, contexts, budgets, batch)

    def _drafts(self, rows: list["SmallModelDrafter"], contexts, budgets, batch: CachedModel | None) -> list[Draft]:
        """Draft for ``rows`` (alone: one row and its own cache; else ``batch``, the rows' shared cache)."""
        logits = self._catch_up(rows, contexts, batch)  # per row [1, vocab]
        lengths = [min(row.num_draft, budget) for row, budget in zip(rows, budgets)]
        tokens, probs = [[] for _ in rows], [[] for _ in rows]
        drafting = [length > 0 for length in lengths]
        while any(drafting):
            for r, row in enumerate(rows):
                if not drafting[r]:
                    continue
                token, q, stop = row._next_token(logits[r], tokens[r])
                tokens[r].append(token)
                if q is not None:
                    probs[r].append(q)
                drafting[r] = not stop and len(tokens[r]) < lengths[r]
            if any(drafting):
                fed = [torch.cat(row_tokens[-1:]) if going else None for row_tokens, going in zip(tokens, drafting)]
                logits = self._feed(rows, fed, batch)
                for row, token in zip(rows, fed):
                    if token is not None:
                        row.cached_ids.append(int(token))
        drafts = []
        for row, row_tokens, row_probs in zip(rows, tokens, probs):
            row.last_draft_length = len(row_tokens)
            if not row_tokens:
                drafts.append(Draft.empty())
                continue
            q = row._over_target_vocab(torch.stack(row_probs)) if row_probs else None
            drafts.append(Draft(torch.cat(row_tokens).cpu(), q))
        return drafts

    def _next_token(self, logits: torch.Tensor, drafted: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The next draft token from the drafter's ``logits`` ([1, vocab]), the distribution it was drawn from
        (sampling), and whether drafting stops after it (greedy: the drafter is not confident of it)."""
        logits = logits.float()
        logits[:, self.shared_vocab :] = float("-inf")  # padding rows: never drafted
        scores = self.sampling.scores(logits, self._input_ids(drafted) if self.sampling.reads_tokens else None)
        if self.sampling.greedy:
            token = scores.argmax(dim=-1)
            return token, None, self.min_confidence > 0 and float(torch.softmax(scores, -1)[0, token]) < self.min_confidence
        q = torch.softmax(scores, dim=-1)
        return self.sampling.sample(q), q[0], False

    def fork(self) -> "SmallModelDrafter":
        """Another row's drafter: the same draft model (and batch cache), its own cache, place in the batch and
        draft length (set up by ``begin``)."""
        clone = copy.copy(self)
        clone.slot = None
        return clone

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        if self.adaptive and self.last_draft_length:
            if num_accepted == self.last_draft_length:
                self.num_draft = min(self.num_draft + 2, self.max_draft)
            else:
                self.num_draft = max(self.num_draft - 1, 1)
        self.last_draft_length = 0

    def _catch_up(self, rows: list["SmallModelDrafter"], contexts, batch: CachedModel | None) -> list[torch.Tensor]:
        """Roll each row's cache back to where it agrees with its context, feed the rest (a new request's prompt
        alone); return each row's next logits."""
        fed = []
        for row, context in zip(rows, contexts):
            cached, keep = row.cached_ids, row.confirmed
            while keep < min(len(cached), len(context) - 1) and cached[keep] == context[keep]:
                keep += 1
            if batch is None:
                row.cache.rollback(len(cached) - keep)
            else:
                batch.truncate_row(row.slot, keep)
            del cached[keep:]
            new = context[keep:]
            cached.extend(new.tolist())
            row.confirmed = len(cached)
            fed.append(torch.from_numpy(new.copy()).to(self.device))
        if batch is None:
            return [rows[0].cache.forward(fed[0], num_logits=1)]
        logits = [batch.start_row(row.slot, tokens) if row.confirmed == len(tokens) else None
                  for row, tokens in zip(rows, fed)]  # (new requests: their prompt alone)
        caught = self._feed(rows, [tokens if got is None else None for tokens, got in zip(fed, logits)], batch)
        return [got if got is not None else other for got, other in zip(logits, caught)]

    def _feed(self, rows: list["SmallModelDrafter"], fed: list[torch.Tensor | None], batch: CachedModel | None):
        """Feed each row its tokens (``None``: nothing) in one pass; return each row's next logits."""
        if batch is None:
            return [rows[0].cache.forward(fed[0], num_logits=1)]
        if all(tokens is None for tokens in fed):
            return [None] * len(rows)
        idle = self.batch.idle
        blocks = [idle] * batch.batch  # rows of the cache not fed (finished, or done drafting)
        for row, tokens in zip(rows, fed):
            if tokens is not None:
                blocks[row.slot] = tokens
        logits = batch.forward_rows(blocks, [1] * len(blocks))
        batch.keep_rows([0 if block is idle else len(block) for block in blocks])
        return [None if tokens is None else logits[row.slot] for row, tokens in zip(rows, fed)]

    def _input_ids(self, drafted: list[torch.Tensor]) -> torch.Tensor:
        """The sequence so far and the tokens drafted in this proposal, for processors that read them."""
        return torch.tensor([self.cached_ids[: self.confirmed] + [int(token) for token in drafted]], device=self.device)

    def _over_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """The drafter's distributions as probabilities over the target's token ids (zero past the shared ones)."""
        over_target = q.new_zeros(q.shape[0], self.target_vocab)
        width = min(q.shape[1], self.target_vocab)
        over_target[:, :width] = q[:, :width]
        return over_target

    def __repr__(self) -> str:
        return f"SmallModelDrafter({type(self.model).__name__}, num_draft={self.num_draft})"


class _Rows:
    """The draft model's cache for the rows of a batch: one :class:`CachedModel` row per drafter (the first
    drafter and its forks), each keeping its place across the requests it serves."""

    def __init__(self) -> None:
        self.cache: CachedModel | None = None
        self.batchable = True

    def cache_for(self, model: torch.nn.Module, rows: list[SmallModelDrafter]) -> CachedModel | None:
        """The shared cache with a place for every drafter of ``rows`` (rebuilt, and every row's state dropped, when
        new drafters do not fit); ``None`` while there is one row (and no batch yet), or for a draft model that
        cannot be batched."""
        if not self.batchable or (self.cache is None and len(rows) < 2):
            return None
        slots = {row.slot for row in rows} - {None}
        if self.cache is None or len(slots) + sum(row.slot is None for row in rows) > self.cache.slots:
            try:
                self.cache = CachedModel(model, None, None, rollback=True, capacity=256, slots=2 * len(rows))
            except UnsupportedModelError:
                self.batchable = False
                return None
            self.idle = torch.zeros(1, dtype=torch.long, device=self.cache.device)  # fed to rows with nothing to feed
            self.taken = 0
            for row in rows:
                row.slot, row.cached_ids[:], row.confirmed = None, [], 0
        for row in rows:
            if row.slot is None:  # (what it cached alone is not in the batch's cache: it starts again there)
                row.slot, self.taken = self.taken, self.taken + 1
                row.cached_ids[:], row.confirmed = [], 0
        return self.cache
