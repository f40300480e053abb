"""SmallModelDrafter: a smaller HF causal LM of the same vocabulary drafts for the target."""

from __future__ import annotations

import copy

from typing import Sequence

import numpy as np
import torch

from .cached_model import CachedModel
from .inputs import vocab_size
from .proposer import Draft, Proposer, check_int
from .sampling import Sampling


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
        self.cached_ids: list[int] = []  # what the cache holds
        self.confirmed = 0  # how many of them are known to be in the sequence
        self.last_draft_length = 0

    @torch.inference_mode()
    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        logits = self._catch_up(context_ids)
        tokens, probs = [], []
        for index in range(min(self.num_draft, max_tokens)):
            logits = logits.float()
            logits[:, self.shared_vocab :] = float("-inf")  # padding rows: never drafted
            scores = self.sampling.scores(logits, self._input_ids(tokens) if self.sampling.reads_tokens else None)
            if self.sampling.greedy:
                token = scores.argmax(dim=-1)
                stop = self.min_confidence > 0 and float(torch.softmax(scores, -1)[0, token]) < self.min_confidence
            else:
                q = torch.softmax(scores, dim=-1)
                token = self.sampling.sample(q)
                probs.append(q[0])
                stop = False
            tokens.append(token)
            if stop or index + 1 == min(self.num_draft, max_tokens):
                break
            logits = self.cache.forward(token, num_logits=1)
            self.cached_ids.append(int(token))
        self.last_draft_length = len(tokens)
        draft_tokens = torch.cat(tokens).cpu()
        return Draft(draft_tokens, self._over_target_vocab(torch.stack(probs)) if probs else None)

    def fork(self) -> "SmallModelDrafter":
        """Another row's drafter: the same draft model, its own cache and draft length (set up by ``begin``)."""
        return copy.copy(self)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        if self.adaptive and self.last_draft_length:
            if num_accepted == self.last_draft_length:
                self.num_draft = min(self.num_draft + 2, self.max_draft)
            else:
                self.num_draft = max(self.num_draft - 1, 1)
        self.last_draft_length = 0

    def _catch_up(self, context_ids: np.ndarray) -> torch.Tensor:
        """Roll the cache back to where it agrees with ``context_ids``, feed the rest; return the next logits."""
        cached, confirmed = self.cached_ids, self.confirmed
        keep = confirmed
        while keep < min(len(cached), len(context_ids) - 1) and cached[keep] == context_ids[keep]:
            keep += 1
        self.cache.rollback(len(cached) - keep)
        del cached[keep:]
        new = context_ids[keep:]
        cached.extend(new.tolist())
        self.confirmed = len(cached)
        return self.cache.forward(torch.from_numpy(new.copy()).to(self.device), num_logits=1)

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
