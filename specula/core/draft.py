"""Drafts: the tokens a proposer guesses will come next, as a chain or a tree, and the checks every proposer
shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Draft:
    """Tokens a proposer guesses will come next, optionally with the distribution each was drawn from: a chain, or a
    tree of candidate continuations verified in the same pass.

    Args:
        tokens: 1-D token ids (list, numpy array or tensor on any device: kept on the host), at most the
            ``max_tokens`` the loop asked for.
        probs: ``[len(tokens), vocab_size]`` probabilities the tokens were sampled from, for stochastic drafters;
            ``None`` for deterministic proposers (their ``q`` is one-hot on the token).
        source: a hashable label of how the draft was made (e.g. ``("match", 3)``), for proposers whose drafts
            differ in quality: the loop learns acceptance per label and sends each kind as far as it pays.
        parents: for a tree, ``parents[i]`` is the index of token ``i``'s parent (``-1``: it follows the last
            verified token), always below ``i``; siblings are tried in their order, so put the likelier first, and
            they must differ. ``None`` (or ``[-1, 0, 1, ..]``) is a chain. Tree ``[-1, 0, 0, -1]`` over tokens
            ``[a, b, c, d]``: ``a b`` or ``a c`` or ``d``.

    Trimming, by what each keeps: :meth:`first` the first ``n`` tokens by index (a count), :meth:`to_depth` the
    tokens at most ``d`` deep (a depth: of a chain, the same as :meth:`first`), :meth:`select` the tokens of given
    indices, :meth:`chain` a tree's first branch (:meth:`first_branch`: its indices).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    source: object = None
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        tokens = self.tokens
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1))
        if tokens.dtype != torch.long:
            if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
                raise ValueError(f"Draft tokens must be integer token ids, got dtype {tokens.dtype}.")
            tokens = tokens.long()
        object.__setattr__(self, "tokens", tokens.reshape(-1).cpu())
        if self.probs is not None and (self.probs.ndim != 2 or self.probs.shape[0] != len(self)):
            raise ValueError(
                f"Draft probs must have shape [num_tokens, vocab_size] = [{len(self)}, V], "
                f"got {tuple(self.probs.shape)}."
            )
        if self.parents is not None:
            object.__setattr__(self, "parents", _checked_parents(self.parents, self.tokens.tolist()))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def parent_list(self) -> list[int]:
        """Each token's parent (``-1``: the last verified token); ``[-1, 0, 1, ..]`` for a chain."""
        return list(range(-1, len(self) - 1)) if self.parents is None else list(self.parents)

    def first(self, num_tokens: int) -> "Draft":
        """The first ``num_tokens`` tokens (and their probabilities): of a tree, the tree they form."""
        if num_tokens >= len(self):
            return self
        probs = None if self.probs is None else self.probs[:num_tokens]
        parents = None if self.parents is None else self.parents[:num_tokens]
        return Draft(self.tokens[:num_tokens], probs, self.source, parents)

    def to_depth(self, depth: int) -> "Draft":
        """The tokens at most ``depth`` deep (the first ``depth`` of a chain): what ``max_tokens`` bounds."""
        if self.parents is None:
            return self.first(depth)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return self.select([i for i, d in enumerate(depths) if d <= depth])

    def children(self) -> list[list[int]]:
        """``children()[i + 1]``: the tokens whose parent is token ``i`` (``[0]``: of the last verified token)."""
        children: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for index, parent in enumerate(self.parent_list()):
            children[parent + 1].append(index)
        return children

    def path(self, new_tokens: Sequence[int]) -> list[int]:
        """The draft tokens (indices) that ``new_tokens`` took, from the first on, while they follow the draft."""
        children, tokens, taken, node = self.children(), self.tokens.tolist(), [], -1
        for token in new_tokens:
            node = next((child for child in children[node + 1] if tokens[child] == token), None)
            if node is None:
                break
            taken.append(node)
        return taken

    def select(self, indices: Sequence[int]) -> "Draft":
        """The draft of these tokens (ascending indices, each with its parent): of a chain, its first ones."""
        if list(indices) == list(range(len(indices))):
            return self.first(len(indices))
        where = {old: new for new, old in enumerate(indices)}
        parents = [-1 if self.parents[i] < 0 else where[self.parents[i]] for i in indices]
        probs = None if self.probs is None else self.probs[list(indices)]
        return Draft(self.tokens[list(indices)], probs, self.source, parents)

    def first_branch(self) -> list[int]:
        """The indices of a tree's first branch (each token's first child, from the first token on); of a chain,
        all."""
        if self.parents is None:
            return list(range(len(self)))
        nodes, last = [], -1
        for index, parent in enumerate(self.parents):
            if parent == last:
                nodes.append(index)
                last = index
        return nodes

    def chain(self) -> "Draft":
        """A tree's first branch, as a chain; a chain itself."""
        return self.select(self.first_branch())

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long))


def _checked_parents(parents: Sequence[int], tokens: list[int]) -> tuple[int, ...] | None:
    """``parents`` as a tuple (``None`` for a chain), or a ValueError saying what is wrong."""
    parents = tuple(int(parent) for parent in np.asarray(parents).reshape(-1))
    if len(parents) != len(tokens):
        raise ValueError(f"Draft parents must have one entry per token ({len(tokens)}), got {len(parents)}.")
    seen = set()
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(
                f"Draft parents[{index}] = {parent}: a token's parent must come before it (-1 .. {index - 1})."
            )
        if (parent, tokens[index]) in seen:
            raise ValueError(
                f"Draft token {index} repeats a sibling's token {tokens[index]} under parent {parent}; merge them."
            )
        seen.add((parent, tokens[index]))
    return None if parents == tuple(range(-1, len(parents) - 1)) else parents


# The source of tokens a grammar forces (specula.proposers.guide): the target writes them unless it spells their text
# with other tokens, so the draft policy expects them accepted (FORCED_PRIOR) until it learns otherwise.
FORCED, FORCED_PRIOR = "grammar", 0.95
DEPTH_DECAY = 0.8  # how much less likely a token is than its parent on the same continuation (merged's prior)


def merged(continuations: Sequence[Sequence[int]], source: object = None) -> Draft:
    """The tree of these continuations (token lists, the likeliest first) with shared prefixes merged, its
    tokens ordered by a score of how likely each is to be accepted, so that the first ``k`` are the tree worth
    verifying where only ``k`` can be (a token scores below its parent, so it comes after it; siblings are tried
    in the same order).

    A token's score is the summed weight of the continuations through it (the ``r``-th weighs ``1 / (r + 1)``,
    ``r`` from 0: a prior on the proposer's own ranking) times ``DEPTH_DECAY`` per level: a token that several
    continuations agree on comes before one that a single better-ranked one proposes, and deep tokens of one
    continuation give way to the first tokens of the next. The first continuation stays the first branch (each of
    its tokens scores at least as high as its best sibling), so that where only the first branch pays, it is the
    proposer's own best chain (how far this reaches, replayed: ``docs/trees.md``).

    >>> tree = merged([[4, 5, 6], [4, 7, 8], [9, 5, 6]])  # 4 -> 5 -> 6, 4 -> 7 -> 8, 9 -> 5 -> 6
    >>> tree.tokens.tolist(), tree.parents  # scores 4: 1.5, 5: 0.8, 6: 0.64, 7: 0.4, 9: 0.33, 8: 0.32 ...
    ([4, 5, 6, 7, 9, 8, 5, 6], (-1, 0, 1, 0, -1, 3, 4, 6))
    >>> merged([[1, 2], [3, 4], [3, 4], [3, 5]]).tokens.tolist()  # 3: 1/2 + 1/3 + 1/4 > 1, yet 1 leads its branch
    [1, 3, 2, 4, 5]
    """
    nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node, in the order made
    parents: list[int] = []
    tokens: list[int] = []
    scores: list[float] = []  # summed weight of the continuations through each node
    depths: list[int] = []
    for rank, continuation in enumerate(continuations):
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
    keys = [score * DEPTH_DECAY**depth for score, depth in zip(scores, depths)]
    # the first continuation stays the first branch (its own chain, what is sent where a tree does not pay): each
    # of its tokens goes first among its siblings (a parent still keys above its children: it sums all of them)
    best: dict[int, float] = {}  # parent -> its children's highest key
    for node, parent in enumerate(parents):
        best[parent] = max(best.get(parent, 0.0), keys[node])
    for node in range(len(continuations[0]) if len(continuations) else 0):  # (its nodes were made first)
        keys[node] = best[parents[node]]
    order = sorted(range(len(tokens)), key=lambda node: (-keys[node], node))
    where = {node: i for i, node in enumerate(order)}
    return Draft(
        [tokens[node] for node in order],
        source=source,
        parents=[-1 if parents[node] < 0 else where[parents[node]] for node in order],
    )


def check_int(name: str, value: object, minimum: int, what: str = "") -> int:
    """``value`` if it is an integer >= ``minimum``, else a ValueError naming the argument."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{what}, got {value!r}.")
    return value
