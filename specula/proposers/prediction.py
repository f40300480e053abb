"""Predicted outputs: a request may bring the text it expects back (the file being edited, last run's answer for
the same record), and the loop drafts from it as from a proposer. The output is still exactly the model's; the
prediction only decides what is verified.

A :class:`Prediction` keeps a cursor into the predicted tokens: where the output would be had it followed the
prediction since it last did. Each step it drafts from the position whose preceding tokens match the longest suffix
of the output, the nearest to the cursor among equally long matches
(:func:`specula.proposers.kernels.prediction_lookup`): in step with the prediction that is the cursor itself; after
an edit, where the output rejoins the prediction (further on, or back at a repeated block); with nothing matching
yet, the cursor moved on by as many tokens as the output wrote (an edit that replaced as many as it wrote).
Its drafts carry their match length as ``Draft.source`` (``("prediction", n)``), so the draft policy learns how
far each kind pays and sends long runs where they are accepted.

The request's other proposer still drafts (:func:`with_prediction`): where both have a draft, they form a tree,
the prediction's first where its match is at least :data:`LEAD` tokens long; where the target takes no trees, the
loop verifies that first branch alone.
"""

from __future__ import annotations

import numpy as np

from ..core.draft import Draft, merged
from .kernels import prediction_lookup

MAX_NGRAM = 8  # the longest suffix matched: longer matches win over nearness to the cursor up to this length
LEAD = 2  # a prediction's draft goes before the other proposer's where its match is at least this long


class Prediction:
    """The predicted tokens of one request, its cursor, and what was verified of them: ``accepted`` and
    ``rejected`` count the prediction's tokens that passes verified and kept, or verified and rejected (OpenAI's
    ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int64)  # [P]
        self.cursor = 0
        self.proposed = self.tokens[:0]  # what it drafted for the current step
        self.accepted = self.rejected = 0

    def propose(self, output: np.ndarray, max_tokens: int) -> Draft:
        """Up to ``max_tokens`` predicted tokens to follow ``output`` (the request's output so far: the prediction
        is of the output, so matches do not reach into the prompt)."""
        position, length = prediction_lookup(self.tokens, output, self.cursor, MAX_NGRAM)
        if position < 0:
            self.proposed = self.tokens[:0]
            return Draft.empty()
        self.cursor = position
        self.proposed = self.tokens[position : position + max_tokens]
        return Draft(self.proposed, source=("prediction", length))

    def advance(self, sent: Draft, new_tokens: list[int]) -> None:
        """A pass verified ``sent`` (``new_tokens``: its accepted tokens, then the target's own): count the
        prediction's tokens in it, move the cursor past what the output wrote."""
        if len(self.proposed) and len(sent):
            predicted = sent.path(self.proposed.tolist())  # the sent tokens that follow the prediction's draft
            kept = sent.path(new_tokens[:-1])
            agreed = next(
                (i for i, (a, b) in enumerate(zip(predicted, kept)) if a != b), min(len(predicted), len(kept))
            )
            self.accepted += agreed
            self.rejected += len(predicted) - agreed
        self.proposed = self.tokens[:0]
        self.cursor += len(new_tokens)


def with_prediction(predicted: Draft, other: Draft) -> Draft:
    """One request's draft from its prediction's and its proposer's: either where the other is empty, else the tree
    of both continuations (shared prefixes merged), the prediction's first where its match length is at least
    :data:`LEAD`. A proposer's sampled draft (with ``probs``) cannot share a tree: it is kept alone unless the
    prediction leads.

    >>> with_prediction(Draft([4, 5, 6], source=("prediction", 8)), Draft([4, 7], source=2)).tokens.tolist()
    [4, 5, 6, 7]
    >>> with_prediction(Draft([9], source=("prediction", 0)), Draft([4, 7], source=2)).tokens.tolist()
    [4, 7, 9]
    """
    if not len(other) or not len(predicted):
        return other if len(other) else predicted
    leads = predicted.source[1] >= LEAD
    if other.probs is not None:
        return predicted if leads else other
    branches = [predicted.tokens.tolist()] + _branches(other)
    first = predicted if leads else other
    return merged(branches if leads else branches[1:] + branches[:1], source=first.source)


def _branches(draft: Draft) -> list[list[int]]:
    """A draft's continuations, root to leaf, its first branch first (a chain: itself)."""
    if not draft.is_tree:
        return [draft.tokens.tolist()]
    tokens, parents = draft.tokens.tolist(), draft.parent_list()
    has_child = set(parents)
    paths = []
    for leaf in (node for node in range(len(tokens)) if node not in has_child):
        path, node = [], leaf
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        paths.append(path[::-1])
    first = [tokens[node] for node in draft.first_branch()]
    return [first] + [path for path in paths if path != first]
