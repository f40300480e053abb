"""Drafts from a grammar: a request whose output a grammar holds (``response_format``, ``tool_choice``, vLLM's guided
decoding: ``specula.hf.grammar.GrammarConstraint``) has tokens the grammar forces (a schema's keys and punctuation, a
function's name, the rest of an enum's value once it is begun) and drafts the grammar refuses.

A :class:`Guide` says both for the output so far; :func:`guided` makes a row's draft of them: where the grammar forces
tokens next, those, labelled :data:`SOURCE` so that the draft policy learns how far such runs are accepted (the
grammar forces bytes; the target may still write them as other tokens than the grammar's own); else its proposer's
draft cut where the grammar stops taking it (the target, masked, would reject the rest), then what the grammar forces
after it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..core.draft import FORCED as SOURCE
from ..core.draft import Draft


@runtime_checkable
class Guide(Protocol):
    """What holds a request's output to a grammar, asked about the output so far: a logits processor of the
    request's that has this method is its guide."""

    def guide(self, output: np.ndarray, draft: list[int], budget: int) -> tuple[int, list[int]]:
        """How many of ``draft``'s tokens (a chain after ``output``, the request's output so far) the grammar takes,
        and the tokens it then forces (at most ``budget`` less those)."""


def guided(guide: Guide, output: np.ndarray, draft: Draft, budget: int) -> Draft:
    """A row's draft where ``guide`` holds its output, ``budget`` tokens at most: the tokens the grammar forces next,
    where it forces some (a valid draft starts with their text anyway); else ``draft`` (a tree as its first branch)
    cut to what the grammar takes, then what it forces after that; a sampled draft (with ``probs``) only cut.

    >>> class Digits:  # (a grammar of digits that forces "." after every third token)
    ...     def guide(self, output, draft, budget):
    ...         taken = next((i for i, token in enumerate(draft) if token > 9), len(draft))
    ...         return taken, [46][: budget - taken] if (len(output) + taken) % 3 == 0 else []
    >>> guided(Digits(), np.array([1]), Draft([4, 2, 99], source=("match", 3)), 8).tokens.tolist()
    [4, 2, 46]
    >>> forced = guided(Digits(), np.array([1, 2, 3]), Draft([7]), 8)
    >>> forced.tokens.tolist(), forced.source
    ([46], 'grammar')
    """
    _, forced = guide.guide(output, [], budget)
    if forced:
        return Draft(np.asarray(forced, dtype=np.int64), source=SOURCE)
    draft = draft.chain()
    taken, forced = guide.guide(output, draft.tokens.tolist(), budget)
    if draft.probs is not None or not forced:
        return draft.to_depth(taken)
    return Draft(np.concatenate([draft.tokens[:taken], np.asarray(forced, dtype=np.int64)]), source=draft.source)
