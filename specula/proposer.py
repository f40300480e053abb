"""The proposer interface: what a drafting method implements to plug into the speculation loop.

A proposer sees one sequence at a time. The loop calls

1. ``check_target(model)`` with the target model (e.g. to check that a draft model shares its vocabulary);
2. ``begin(prompt_ids, sampling)`` once, before decoding starts; ``sampling`` (a :class:`specula.Sampling`) says
   how the target decodes: a drafter that samples must draw with ``sampling.probs`` and ``sampling.generator`` and
   return the distributions it drew from as ``Draft.probs``;
3. ``propose(context_ids, max_tokens)`` before every target forward pass, and sends the returned draft to the target
   for verification;
4. ``observe(new_ids, num_accepted)`` after every verification, with the tokens appended to the sequence (the
   accepted draft prefix followed by the target's own token) and how many of them came from the draft.

``context_ids`` is a read-only numpy int64 view of prompt + output so far; it is only valid during the call (copy it
to keep it). A proposer that keeps no state needs only ``propose``.

Example, a proposer that always guesses the token that came before the last one::

    class Echo(specula.Proposer):
        def propose(self, context_ids, max_tokens):
            return specula.Draft(context_ids[-2:-1])
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .sampling import Sampling


@dataclass(frozen=True)
class Draft:
    """Tokens a proposer guesses will come next, optionally with the distribution each was drawn from.

    Args:
        tokens: 1-D token ids (list, numpy array or tensor), at most the ``max_tokens`` the loop asked for.
        probs: ``[len(tokens), vocab_size]`` probabilities the tokens were sampled from, for stochastic drafters;
            ``None`` for deterministic proposers (their ``q`` is one-hot on the token).
        source: a hashable label of how the draft was made (e.g. ``("match", 3)``), for proposers whose drafts
            differ in quality: the loop learns acceptance per label and sends each kind as far as it pays.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    source: object = None

    def __post_init__(self) -> None:
        tokens = self.tokens
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1))
        if tokens.dtype != torch.long:
            if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
                raise ValueError(f"Draft tokens must be integer token ids, got dtype {tokens.dtype}.")
            tokens = tokens.long()
        object.__setattr__(self, "tokens", tokens.reshape(-1))
        if self.probs is not None and (self.probs.ndim != 2 or self.probs.shape[0] != len(self)):
            raise ValueError(
                f"Draft probs must have shape [num_tokens, vocab_size] = [{len(self)}, V], got {tuple(self.probs.shape)}."
            )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def head(self, num_tokens: int) -> "Draft":
        """The first ``num_tokens`` tokens (and their probabilities)."""
        if num_tokens >= len(self):
            return self
        return Draft(self.tokens[:num_tokens], None if self.probs is None else self.probs[:num_tokens], self.source)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long))


def check_int(name: str, value: object, minimum: int, what: str = "") -> int:
    """``value`` if it is an integer >= ``minimum``, else a ValueError naming the argument."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{what}, got {value!r}.")
    return value


class RowProposalError(RuntimeError):
    """``propose()`` failed for row ``row`` of a batch (raised by :meth:`Proposer.propose_rows`)."""

    def __init__(self, row: int, error: Exception) -> None:
        super().__init__(str(error))
        self.row, self.error = row, error


class Proposer:
    """Base class for drafting methods; subclasses implement ``propose`` and, if they keep state, the other hooks."""

    def check_target(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if this proposer cannot draft for ``model``; called before every generation."""

    def begin(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        """A new sequence starts with these prompt tokens and is decoded with ``sampling``."""

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        """Guess up to ``max_tokens`` (>= 1) tokens that follow ``context_ids``; an empty draft means "no guess"."""
        raise NotImplementedError

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        """``new_ids`` were appended to the sequence; the first ``num_accepted`` of them were this proposer's draft."""

    def propose_rows(
        self, rows: Sequence["Proposer"], contexts: Sequence[np.ndarray], budgets: Sequence[int]
    ) -> list[Draft]:
        """Drafts for the rows of a batch at once, called on the batch's first proposer: ``rows[r]`` is row ``r``'s
        proposer (this one or a :meth:`fork` of it), ``contexts[r]`` its sequence, ``budgets[r]`` the most tokens
        it may propose (0: none). The default asks each row alone; a proposer that drafts rows together (one batched
        pass of a draft model) overrides it."""
        drafts = []
        for index, (row, context, budget) in enumerate(zip(rows, contexts, budgets)):
            try:
                drafts.append(row.propose(context, budget) if budget > 0 else Draft.empty())
            except Exception as error:
                raise RowProposalError(index, error) from error
        return drafts

    def fork(self) -> "Proposer":
        """A proposer for another row of the same batch: the state of a request is its own, state that should
        serve every request (learnt tables, a loaded model) is shared. The default, a deep copy, shares nothing;
        proposers with shared state override it."""
        return copy.deepcopy(self)
