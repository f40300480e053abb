"""Tree masks: which tokens of a pass's blocks each token sees (its row's past, and its own ancestors in a tree
draft), as attention masks of the model's kind."""

from __future__ import annotations

import functools

import numpy as np
import torch


def ancestry_of(trees: list[list[int] | None], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of ``n`` block tokens: whether token ``j`` is ``i`` or one of its ancestors (``[B, n, n]``), and
    each token's depth (``[B, n]``). ``trees[b]`` gives row ``b``'s parents (``trees[b][i] < i``, ``-1`` for the
    first; tokens past them, padding, follow the token before); ``None`` is a chain.

    >>> ancestry, depth = ancestry_of([[-1, 0, 0, 2], None], 4, torch.device("cpu"))  # 0 -> 1, and 0 -> 2 -> 3
    >>> ancestry[0].int().tolist(), depth.tolist()
    ([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], [[0, 1, 1, 2], [0, 1, 2, 3]])
    """
    if all(tree is None for tree in trees):
        return _chains(len(trees), n, device)
    ancestry = np.tril(np.ones((n, n), dtype=bool))[None].repeat(len(trees), axis=0)
    depth = np.arange(n)[None].repeat(len(trees), axis=0)
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        parents = parents_of([tree], n)[0]
        for i in range(1, n):  # (only the first token has no parent: -1)
            ancestry[b, i, :i], depth[b, i] = ancestry[b, parents[i], :i], depth[b, parents[i]] + 1
    return torch.from_numpy(ancestry).to(device), torch.from_numpy(depth).to(device)


@functools.lru_cache(maxsize=64)
def _chains(batch: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ancestry_of` rows that are all chains (made once per shape and device: every plain pass asks)."""
    ancestry = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return ancestry.expand(batch, n, n), torch.arange(n, device=device).expand(batch, n)


def parents_of(trees: list[list[int] | None], n: int) -> list[list[int]]:
    """Each row's parents (see :func:`ancestry_of`) for all ``n`` tokens of the block: a chain's the token before,
    padding after a tree follows its last token."""
    return [list(range(-1, n - 1)) if tree is None else tree + list(range(len(tree) - 1, n - 1)) for tree in trees]


def paths_of(ancestry: torch.Tensor, trees: list[list[int] | None]) -> list[list[list[int] | None] | None]:
    """For each tree row, each block token's ancestors and itself (block indices), ``None`` where they are just
    the tokens before it; ``None`` for chain rows. ``ancestry``: ``[B, n, n]`` (see :func:`ancestry_of`)."""
    paths = []
    for row, tree in zip(ancestry.cpu().numpy(), trees):
        lists = None if tree is None else [np.flatnonzero(seen).tolist() for seen in row]
        paths.append(None if lists is None else [None if p == list(range(len(p))) else p for p in lists])
    return paths


def block_mask(
    starts: torch.Tensor,
    keys: torch.Tensor,
    ancestry: torch.Tensor,
    depth: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    additive: bool,
    dtype: torch.dtype,
    mixed: bool,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of a pass over blocks of tokens (``[B, 1, n, keys]``; for a model with both kinds of layers
    (``mixed``), one per layer type) over ``keys`` (every slot a query may see), rows' blocks starting at ``starts``
    (``[B]``), their tokens' ``ancestry`` (``[B, n, n]``), ``depth`` in it and ``positions`` (``[B, n]``); with a
    sliding ``window``, its layers see only that many positions back; ``additive``: as eager attention adds it to
    the scores (0 or the lowest ``dtype``), else boolean."""
    n = ancestry.shape[1]
    inside = keys - starts[:, None]  # [B, keys]: a key's index in its row's block (< 0: the row's cache)
    in_block = ancestry.gather(2, inside.clamp(0, n - 1)[:, None].expand(-1, n, -1))  # [B, n, keys]
    seen = (inside < 0)[:, None] | ((inside < n)[:, None] & in_block)  # a token sees its row's past and path
    masks = {"full_attention": seen}
    if window is not None:  # ... and in a sliding-window layer only the last `window` positions
        key_positions = torch.where(inside < 0, keys, starts[:, None] + depth.gather(1, inside.clamp(0, n - 1)))
        masks["sliding_attention"] = seen & (key_positions[:, None] > positions[..., None] - window)
    for kind, seen in masks.items():
        mask = seen[:, None]  # [B, 1, n, keys]
        if additive:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[kind] = mask
    # models with both kinds of layers take a mask per layer type; the others the one their layers use
    return masks if mixed else masks["sliding_attention" if window is not None else "full_attention"]
