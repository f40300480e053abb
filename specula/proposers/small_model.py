"""SmallModelDrafter: a smaller HF causal LM of the same vocabulary drafts for the target."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..core.draft import Draft, check_int
from ..core.sampling import Sampling
from ..verifier.runner import CachedModel, OneSequence, RaggedRows
from ..verifier.support import UnsupportedModelError, model_device, vocab_size
from .base import RequestProposer


def _vocab_description(tokenizer) -> str:
    return (
        f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}, {len(tokenizer)} tokens)"
    )


class SmallModelDrafter(RequestProposer):
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
        if (
            tokenizer is not None
            and target_tokenizer is not None
            and tokenizer.get_vocab() != target_tokenizer.get_vocab()
        ):
            raise ValueError(
                f"The drafter's tokenizer {_vocab_description(tokenizer)} and the target's "
                f"{_vocab_description(target_tokenizer)} have different vocabularies; a drafter must use the target's "
                "token ids. Pick a draft model from the target's family."
            )
        self.model = draft_model.eval()
        self.num_draft, self.max_draft, self.adaptive = num_draft, max_draft, adaptive
        self.min_confidence = min_confidence
        self.tokenizer = tokenizer
        self.device = model_device(draft_model)
        self.target_vocab = self.shared_vocab = vocab_size(draft_model)
        self.requests: dict[object, _Request] = {}  # what it keeps per request, by request id
        self.batch = _Rows()  # the draft model's cache for requests drafted together

    def check_target(self, model: torch.nn.Module) -> None:
        draft_rows, target_rows = vocab_size(self.model), vocab_size(model)
        if draft_rows != target_rows:
            real = len(self.tokenizer) if self.tokenizer is not None else None
            if real is None or real > min(draft_rows, target_rows):
                raise ValueError(
                    f"The draft model {type(self.model).__name__} has a vocabulary of {draft_rows} tokens and the "
                    "target "
                    f"{type(model).__name__} has {target_rows}: they must share one token space. If the difference "
                    "is only padding rows of the embedding matrix, pass tokenizer= so the real vocabulary can be "
                    "checked."
                )
        self.target_vocab = target_rows
        self.shared_vocab = min(draft_rows, target_rows) if self.tokenizer is None else len(self.tokenizer)

    def start_request(self, request, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self.requests[request] = _Request(sampling, self.num_draft)

    def stop_request(self, request) -> None:
        state = self.requests.pop(request, None)
        if state is not None and state.slot is not None:
            self.batch.release(state.slot)

    @torch.no_grad()
    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        return self.propose_requests([None], [context_ids], [max_tokens])[0]

    @torch.no_grad()
    def propose_requests(self, requests, contexts, max_tokens) -> list[Draft]:
        """All requests' drafts from batched passes of the draft model: each pass feeds every drafting request its
        next token (requests that catch up feed the tokens the verifier appended). Requests keep their own rows of
        one cache of the draft model; a model that cannot be batched drafts request by request."""
        states = [self.requests[request] for request in requests]
        batch = self.batch.cache_for(self.model, states, self.requests.values())
        if batch is None:  # (each request alone, in a cache of its own)
            return [
                self._drafts([state], [context], [most], state.own_cache(self.model))[0]
                for state, context, most in zip(states, contexts, max_tokens)
            ]
        return self._drafts(states, contexts, max_tokens, batch)

    def _drafts(self, states: list["_Request"], contexts, max_tokens, cache: CachedModel) -> list[Draft]:
        """Draft for ``states`` in ``cache`` (a request's own, or the requests' shared one)."""
        logits = self._catch_up(states, contexts, cache)  # per request [1, vocab]
        lengths = [min(state.num_draft, most) for state, most in zip(states, max_tokens)]
        tokens, probs = [[] for _ in states], [[] for _ in states]
        drafting = [length > 0 for length in lengths]
        while any(drafting):
            for r, state in enumerate(states):
                if not drafting[r]:
                    continue
                token, q, stop = self._next_token(state, logits[r], tokens[r])
                tokens[r].append(token)
                if q is not None:
                    probs[r].append(q)
                drafting[r] = not stop and len(tokens[r]) < lengths[r]
            if any(drafting):
                fed = [torch.cat(drafted[-1:]) if going else None for drafted, going in zip(tokens, drafting)]
                logits = self._feed(states, fed, cache)
                for state, token in zip(states, fed):
                    if token is not None:
                        state.cached_ids.append(int(token))
        drafts = []
        for state, drafted, drawn_from in zip(states, tokens, probs):
            state.last_draft_length = len(drafted)
            if not drafted:
                drafts.append(Draft.empty())
                continue
            q = self._over_target_vocab(torch.stack(drawn_from)) if drawn_from else None
            drafts.append(Draft(torch.cat(drafted).cpu(), q))
        return drafts

    def _next_token(
        self, state: "_Request", logits: torch.Tensor, drafted: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The next draft token from the drafter's ``logits`` ([1, vocab]), the distribution it was drawn from
        (sampling), and whether drafting stops after it (greedy: the drafter is not confident of it)."""
        logits = logits.float()
        logits[:, self.shared_vocab :] = float("-inf")  # padding rows: never drafted
        sampling = state.sampling
        scores = sampling.scores(logits, self._input_ids(state, drafted) if sampling.reads_tokens else None)
        if sampling.greedy:
            token = scores.argmax(dim=-1)
            return (
                token,
                None,
                self.min_confidence > 0 and float(torch.softmax(scores, -1)[0, token]) < self.min_confidence,
            )
        q = torch.softmax(scores, dim=-1)
        return sampling.sample(q), q[0], False

    def observe_request(self, request, new_ids: Sequence[int], num_accepted: int) -> None:
        state = self.requests[request]
        if self.adaptive and state.last_draft_length:
            if num_accepted == state.last_draft_length:
                state.num_draft = min(state.num_draft + 2, self.max_draft)
            else:
                state.num_draft = max(state.num_draft - 1, 1)
        state.last_draft_length = 0

    def _catch_up(self, states: list["_Request"], contexts, cache: CachedModel) -> list[torch.Tensor]:
        """Roll each request's row of ``cache`` back to where it agrees with its context, feed the rest (a new
        request's prompt alone); return each request's next logits."""
        fed = []
        for state, context in zip(states, contexts):
            cached, keep = state.cached_ids, state.confirmed
            while keep < min(len(cached), len(context) - 1) and cached[keep] == context[keep]:
                keep += 1
            cache.truncate_row(state.row(cache), keep)
            del cached[keep:]
            new = context[keep:]
            cached.extend(new.tolist())
            state.confirmed = len(cached)
            fed.append(torch.from_numpy(new.copy()).to(self.device))
        logits = [
            cache.start_row(state.row(cache), tokens) if state.confirmed == len(tokens) else None
            for state, tokens in zip(states, fed)
        ]  # (new requests: their prompt alone)
        caught = self._feed(states, [tokens if got is None else None for tokens, got in zip(fed, logits)], cache)
        return [got if got is not None else other for got, other in zip(logits, caught)]

    def _feed(self, states: list["_Request"], fed: list[torch.Tensor | None], cache: CachedModel):
        """Feed each request its tokens (``None``: nothing) in one pass; return each request's next logits."""
        if all(tokens is None for tokens in fed):
            return [None] * len(states)
        idle = torch.zeros(1, dtype=torch.long, device=cache.device)
        blocks = [idle] * cache.batch  # rows of the cache not fed (free, or done drafting)
        for state, tokens in zip(states, fed):
            if tokens is not None:
                blocks[state.row(cache)] = tokens
        logits = cache.forward_rows(blocks, [1] * len(blocks))
        if isinstance(
            cache, RaggedRows
        ):  # (a cache held alone rolls back at the next catch-up: sliding-window layers keep what a
            cache.keep_rows([0 if block is idle else len(block) for block in blocks])  # rollback needs until then)
        return [None if tokens is None else logits[state.row(cache)] for state, tokens in zip(states, fed)]

    def _input_ids(self, state: "_Request", drafted: list[torch.Tensor]) -> torch.Tensor:
        """The request's sequence so far and the tokens drafted in this proposal, for processors that read them."""
        return torch.tensor(
            [state.cached_ids[: state.confirmed] + [int(token) for token in drafted]], device=self.device
        )

    def _over_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """The drafter's distributions as probabilities over the target's token ids (zero past the shared ones)."""
        over_target = q.new_zeros(q.shape[0], self.target_vocab)
        width = min(q.shape[1], self.target_vocab)
        over_target[:, :width] = q[:, :width]
        return over_target

    def __repr__(self) -> str:
        return f"SmallModelDrafter({type(self.model).__name__}, num_draft={self.num_draft})"


@dataclasses.dataclass
class _Request:
    """What the drafter keeps for one request."""

    sampling: Sampling
    num_draft: int  # its draft length now
    last_draft_length: int = 0  # of its latest draft
    cached_ids: list[int] = dataclasses.field(default_factory=list)  # what its cache (row) holds
    confirmed: int = 0  # how many of them are known to be in the sequence
    slot: int | None = None  # its row of the batch cache (None: it drafts alone, with ``cache``)
    cache: CachedModel | None = None

    def own_cache(self, model: torch.nn.Module) -> CachedModel:
        """Its cache for drafting alone (made on first use)."""
        if self.cache is None:
            self.cache = OneSequence(model, rollback=True)
        return self.cache

    def row(self, cache: CachedModel) -> int:
        """Its row of ``cache``."""
        return 0 if cache is self.cache else self.slot


class _Rows:
    """The draft model's cache for the requests of a batch: one :class:`CachedModel` row per request, freed when the
    request stops."""

    def __init__(self) -> None:
        self.cache: CachedModel | None = None
        self.batchable = True
        self.free: list[int] = []  # rows no request holds

    def cache_for(
        self, model: torch.nn.Module, states: list[_Request], running: Iterable[_Request]
    ) -> CachedModel | None:
        """The shared cache with a row for every request of ``states`` (rebuilt, and what every ``running`` request
        cached dropped, when new requests do not fit); ``None`` while there is one request (and no batch yet), or
        for a draft model that cannot be batched."""
        if not self.batchable or (self.cache is None and len(states) < 2):
            return None
        if self.cache is None or sum(state.slot is None for state in states) > len(self.free):
            running = list(running)
            try:
                self.cache = RaggedRows(model, rollback=True, capacity=256, slots=2 * len(running))
            except UnsupportedModelError:
                self.batchable = False
                return None
            self.free = list(range(self.cache.slots - 1, -1, -1))
            for state in running:
                state.slot = None
        for state in states:
            if state.slot is None:  # (what it cached alone is not in the batch's cache: it starts again there)
                state.slot = self.free.pop()
                state.cached_ids[:], state.confirmed = [], 0
        return self.cache

    def release(self, slot: int) -> None:
        self.free.append(slot)
