"""Pass costs: what a verification pass over ``n`` tokens takes with this model on this machine, measured while
decoding and smoothed. A table is a float array indexed by the tokens a pass computes in all (its rows padded to the
widest), ``nan`` where no such pass was timed yet."""

from __future__ import annotations

from typing import Hashable

import numpy as np
import torch

from ..verifier.profile import profile_of


def shared_step_seconds(owner: torch.nn.Module, setting: Hashable, max_draft: int, rows: int = 1) -> np.ndarray:
    """The pass-cost table (seconds of a pass of ``rows`` rows verifying ``n`` tokens in all, padding included, at
    index ``n``) that every decision for ``owner`` (a target model) in ``setting`` (its device and dtype) shares:
    what one generation measured, the next starts from. Kept per number of rows: ``n`` tokens over one row and over ``n`` rows cost
    differently (attention reads one cache or ``n``). Kept in the model's profile."""
    tables = profile_of(owner).step_seconds
    return tables.setdefault((setting, max_draft, rows), np.full(rows * (max_draft + 1) + 1, np.nan))


def estimated(table: np.ndarray, rows: int) -> np.ndarray:
    """Estimated seconds of a pass over ``rows + e`` tokens (index ``e``), from ``table`` (index: tokens); lengths
    not measured yet take the value of the nearest measured ones (interpolated), all 1.0 before any measurement."""
    tokens = np.arange(rows, len(table))
    measured = ~np.isnan(table[rows:])
    if not measured.any():
        return np.ones(len(tokens))
    return np.interp(tokens, tokens[measured], table[rows:][measured])


def record(table: np.ndarray, tokens: int, seconds: float) -> None:
    """A pass over ``tokens`` tokens took ``seconds``: smoothed, and a one-off stall (another process, the
    allocator) counts at most 2x."""
    if tokens >= len(table):
        return
    previous = table[tokens]
    table[tokens] = seconds if np.isnan(previous) else 0.8 * previous + 0.2 * min(seconds, 2.0 * previous)


def explored_width(table: np.ndarray, rows: int) -> int:
    """The longest draft worth the risk in a pass of ``rows`` rows: ``2w - 1`` tokens a row once a pass ``w``
    tokens wide has been timed (none before any)."""
    measured = np.flatnonzero(~np.isnan(table[rows:]))
    return 2 * (int(measured[-1]) + rows) // rows - 1 if len(measured) else 0
