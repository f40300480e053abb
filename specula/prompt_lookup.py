"""PromptLookup: draft by copying from the prompt and the output so far."""

from __future__ import annotations

import numpy as np

from .kernels import lookup_candidates, prompt_lookup
from .proposer import Draft, Proposer, check_int


class PromptLookup(Proposer):
    """Propose the tokens that followed the latest n-gram of the sequence where it occurred before.

    The longest suffix of prompt + output (``max_ngram`` tokens down to ``min_ngram``) that occurred earlier is
    looked up, and up to ``num_draft`` tokens that followed it are proposed (see :func:`specula.kernels.prompt_lookup`).

    Which occurrence: the **most recent** one. HF's ``prompt_lookup_num_tokens`` takes the leftmost and vLLM the
    earliest, but text being copied tends to continue the copy it is in the middle of, and the recent past (the
    answer being written, the latest version of an edited line) predicts better than the first mention. Replaying
    SmolLM2-135M-Instruct's greedy outputs (fp32, 12 prompts per public workload, 128 new tokens, K=10,
    ``examples/prompt_lookup_occurrence.py``), tokens per target step, ngram 1-3:

    ============  ====  ====  =========  ====  =========
    occurrence    chat  code  code_edit  rag   summarize
    ============  ====  ====  =========  ====  =========
    most recent   3.14  1.50  2.43       1.84  1.95
    earliest      3.04  1.51  2.36       1.80  1.89
    ============  ====  ====  =========  ====  =========

    Which n-grams: down to single tokens (``min_ngram=1``), and every draft carries its match length as
    ``Draft.source``, so the loop learns how often drafts from 1-, 2- and 3-token matches are accepted and sends each
    kind as far as it pays (:mod:`specula.draft_length`). Single-token matches are right less often (acceptance 20%
    vs 36% on code_edit) but cost nearly nothing to verify where a pass over several tokens costs what a one-token
    pass does: replaying SmolLM2 bf16 outputs (12 prompts per workload, ``examples/draft_replay.py``) they raise
    tokens per step from 2.06 to 2.18 on code_edit and from 1.66 to 1.83 on summarize. Where verification is dear
    (fp32 on CPU) the learnt acceptance keeps weak matches from being sent.

    Which occurrences: with ``branches > 1``, the continuations of several (the longest matches first, then the most
    recent) as a tree, merged where they agree, all verified in one pass (:class:`specula.Draft` ``parents``); the
    loop sends the likeliest of its tokens, as many as pay (:mod:`specula.draft_length`), so a tree costs a pass
    over more tokens only where that is worth it.

    Args:
        num_draft: maximum tokens proposed per step (K); of a tree, per branch.
        min_ngram: shortest suffix that may be matched.
        max_ngram: longest suffix tried first.
        branches: occurrences whose continuations are proposed (1: a chain).
    """

    def __init__(self, num_draft: int = 10, min_ngram: int = 1, max_ngram: int = 3, branches: int = 1) -> None:
        check_int("num_draft", num_draft, 1, " (tokens proposed per step)")
        check_int("min_ngram", min_ngram, 1)
        check_int("max_ngram", max_ngram, min_ngram, " (min_ngram)")
        check_int("branches", branches, 1, " (occurrences proposed as a tree; 1: a chain)")
        self.num_draft = num_draft
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.branches = branches
        self.proposes_trees = branches > 1

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        length = min(self.num_draft, max_tokens)
        if self.branches == 1:
            tokens, match_length = prompt_lookup(context_ids, self.min_ngram, self.max_ngram, length)
            return Draft(tokens, source=match_length)
        continuations, matches = lookup_candidates(context_ids, self.min_ngram, self.max_ngram, length, self.branches)
        return merged(continuations, source=int(matches[0]) if len(matches) else 0)

    def __repr__(self) -> str:
        branches = f", branches={self.branches}" if self.branches > 1 else ""
        return (f"PromptLookup(num_draft={self.num_draft}, min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
                f"{branches})")


DEPTH_DECAY = 0.8  # how much less likely a token is than its parent on the same continuation (merged's prior)


def merged(continuations: np.ndarray, source: object = None) -> Draft:
    """The tree of these continuations (``[m, length]``, the likeliest first) with shared prefixes merged, its
    tokens ordered by a score of how likely each is to be accepted, so that the first ``k`` are the tree worth
    verifying where only ``k`` can be (a token scores below its parent, so it comes after it; siblings are tried
    in the same order).

    A token's score is the summed weight of the continuations through it (the ``r``-th weighs ``1 / (r + 1)``,
    ``r`` from 0: the occurrence ranking's own prior) times ``DEPTH_DECAY`` per level: a token that several
    occurrences agree on comes before one that a single better-ranked occurrence proposes, and deep tokens of one
    continuation give way to the first tokens of the next. Replaying SmolLM2-135M's bf16 outputs (12 prompts per
    public workload, 16 continuations, 32 tokens sent; ``examples/draft_replay.py``) this reaches 95-100% of the
    copy bound where ordering by depth plus rank reached 95-99.6%.

    >>> tree = merged(np.array([[4, 5, 6], [4, 7, 8], [9, 5, 6]]))  # 4 -> 5 -> 6, 4 -> 7 -> 8, 9 -> 5 -> 6
    >>> tree.tokens.tolist(), tree.parents  # scores 4: 1.5, 5: 0.8, 6: 0.64, 7: 0.4, 9: 0.33, 8: 0.32 ...
    ([4, 5, 6, 7, 9, 8, 5, 6], (-1, 0, 1, 0, -1, 3, 4, 6))
    >>> merged(np.array([[1, 2], [3, 4], [3, 4], [3, 5]])).tokens.tolist()  # 3: 1/2 + 1/3 + 1/4 > 1: 3 first
    [3, 1, 2, 4, 5]
    """
    nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node, in the order made
    parents: list[int] = []
    tokens: list[int] = []
    scores: list[float] = []  # summed weight of the continuations through each node
    depths: list[int] = []
    for rank, continuation in enumerate(continuations.tolist()):
        node, weight = -1, 1.0 / (rank + 1)
        for depth, token in enumerate(continuation):
            if (node, token) not in nodes:
                nodes[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                scores.append(0.0)
                depths.append(depth)
            node = nodes[node, token]
            scores[node] += weight
    # (a parent scores more than its child: a superset of its continuations, one level less of decay)
    order = sorted(range(len(tokens)), key=lambda node: (-scores[node] * DEPTH_DECAY ** depths[node], node))
    where = {node: i for i, node in enumerate(order)}
    return Draft([tokens[node] for node in order], source=source,
                 parents=[-1 if parents[node] < 0 else where[parents[node]] for node in order])
