"""Deciding which draft tokens the target keeps: the one acceptance rule every proposer goes through."""

from __future__ import annotations

import torch


def accept_draft(target_logits: torch.Tensor, draft_tokens: list[int]) -> list[int]:
    """Greedy verification of a draft against the target's logits.

    ``target_logits[i]`` is the target's prediction after the last verified token and ``draft_tokens[:i]``, so it has
    ``len(draft_tokens) + 1`` rows. Keeps the longest draft prefix equal to the target's argmax, then appends the
    target's own token: its correction at the first mismatch, or the bonus token when the whole draft matched.
    Returns the new tokens; ``len(result) - 1`` of them are accepted draft tokens.

    >>> logits = torch.eye(5)[[1, 2, 4]]           # the target predicts 1, then 2, then 4
    >>> accept_draft(logits, [1, 3])               # 1 agrees, 3 does not: keep 1, correct to 2
    [1, 2]
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return draft_tokens[:accepted] + [target_tokens[accepted]]
