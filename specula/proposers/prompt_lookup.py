"""PromptLookup: draft by copying from the prompt and the output so far."""

from __future__ import annotations

import numpy as np

from ..core.draft import Draft, check_int, merged
from .base import RequestProposer
from .kernels import lookup_candidates, prompt_lookup


class PromptLookup(RequestProposer):
    """Propose the tokens that followed the latest n-gram of the sequence where it occurred before.

    The longest suffix of prompt + output (``max_ngram`` tokens down to ``min_ngram``) that occurred earlier is
    looked up, and the tokens that followed it are proposed, as many as the loop asks for (see
    :func:`specula.proposers.kernels.prompt_lookup`).

    How many: by default no limit of its own. The loop asks for what its cost model says pays (from measured pass
    costs and the acceptance of each match length), so a copy deep in a repeated block or an edited file is drafted
    as far as verifying it pays; HF's ``prompt_lookup_num_tokens`` fixes 10, which cut such copies short (measured
    in ``docs/proposers.md``).

    Which occurrence: the **most recent** one (HF's ``prompt_lookup_num_tokens`` takes the leftmost, vLLM the
    earliest): text being copied tends to continue the copy it is in the middle of. Which n-grams: down to single
    tokens (``min_ngram=1``), and every draft carries its match length as ``Draft.source``, so the loop learns how
    often drafts from 1-, 2- and 3-token matches are accepted and sends each kind as far as it pays
    (:mod:`specula.policy.adaptive`). The replays behind both choices: ``docs/proposers.md``.

    Which occurrences: with ``branches > 1``, the continuations of several (the longest matches first, then the most
    recent) as a tree, merged where they agree, all verified in one pass (:class:`specula.Draft` ``parents``); the
    loop sends the likeliest of its tokens, as many as pay (:mod:`specula.policy.adaptive`), so a tree costs a pass
    over more tokens only where that is worth it.

    Args:
        num_draft: at most this many tokens proposed per step (of a tree, per branch); ``None``: as many as asked.
        min_ngram: shortest suffix that may be matched.
        max_ngram: longest suffix tried first.
        branches: occurrences whose continuations are proposed (1: a chain).
    """

    def __init__(self, num_draft: int | None = None, min_ngram: int = 1, max_ngram: int = 3, branches: int = 1) -> None:
        if num_draft is not None:
            check_int("num_draft", num_draft, 1, " (tokens proposed per step; None: as many as asked)")
        check_int("min_ngram", min_ngram, 1)
        check_int("max_ngram", max_ngram, min_ngram, " (min_ngram)")
        check_int("branches", branches, 1, " (occurrences proposed as a tree; 1: a chain)")
        self.num_draft = num_draft
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.branches = branches
        self.proposes_trees = branches > 1

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        length = max_tokens if self.num_draft is None else min(self.num_draft, max_tokens)
        if self.branches == 1:
            tokens, match_length = prompt_lookup(context_ids, self.min_ngram, self.max_ngram, length)
            return Draft(tokens, source=match_length)
        continuations, matches = lookup_candidates(context_ids, self.min_ngram, self.max_ngram, length, self.branches)
        return merged(continuations.tolist(), source=int(matches[0]) if len(matches) else 0)

    def __repr__(self) -> str:
        branches = f", branches={self.branches}" if self.branches > 1 else ""
        return (
            f"PromptLookup(num_draft={self.num_draft}, min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            f"{branches})"
        )
