"""The proposer interface: what a drafting method implements to plug into the speculation loop.

A proposer sees one sequence at a time. The loop calls

1. ``check_target(model)`` with the target model (e.g. to check that a draft model shares its vocabulary);
2. ``begin(prompt_ids, sampling)`` once, before decoding starts; ``sampling`` (a :class:`specula.Sampling`) says
   how the target decodes: a drafter that samples must draw with ``sampling.probs`` and ``sampling.generator`` and
   return the distributions it drew from as ``Draft.probs``;
3. ``propose(context_ids, max_tokens)`` before every target forward pass, and sends the returned draft to the target
   for verification (``max_tokens`` bounds a chain's length, a tree's depth);
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

from ..core.draft import Draft, check_int, merged
from ..core.sampling import Sampling

__all__ = ["Draft", "Proposer", "RowProposalError", "check_int", "merged"]  # what a proposer is written with


class RowProposalError(RuntimeError):
    """``propose()`` failed for row ``row`` of a batch (raised by :meth:`Proposer.propose_rows`)."""

    def __init__(self, row: int, error: Exception) -> None:
        super().__init__(str(error))
        self.row, self.error = row, error


class Proposer:
    """Base class for drafting methods; subclasses implement ``propose`` and, if they keep state, the other hooks."""

    # Whether drafts may be trees (``Draft.parents``): the verifier then holds the target so that it can verify
    # them, and cuts them to their first branch where the model cannot (see ``specula.generate``).
    proposes_trees: bool = False
    # Whether, when the target samples, drafts are drawn at random (with ``Draft.probs``). Such drafts are verified
    # by speculative sampling, whose random draws depend on how many are sent; the cost model then leaves timings
    # out, so that a seeded request samples the same on every run. Other drafts are verified by drawing each token
    # as ``model.generate`` does, whatever their lengths.
    samples_drafts: bool = False

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
