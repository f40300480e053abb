"""A memory budget for the keys and values a run holds: requests join the batch only while its cache still fits.

A batch's cache is a rectangle (:class:`~specula.verifier.cache_layers.PreallocatedLayer`): its rows in use, each as
long as the longest of them may grow (its prompt, its ``max_new_tokens`` and room for a draft). So a request joins
only where that rectangle, with it, stays within the budget; otherwise it waits, first in line, for rows to leave.
A request that would not fit even alone is refused before any work (the server's 400, a file's skipped line).
Worked example: 46,080 bytes a token (SmolLM2-135M in fp32) and a budget of 1 GB hold two rows of 8,192 tokens
(0.75 GB), not three; eight rows of 2,048.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the command line reads sizes before torch is imported)
    import torch

UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes from a size as people write it: ``4GB``, ``512MiB``, ``1.5 G``, ``2000000``.

    >>> parse_size("4GB"), parse_size("512MiB"), parse_size("1.5 g")
    (4000000000, 536870912, 1500000000)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size: write a number of bytes with a unit, such as 4GB or 512MiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


class OverBudget(ValueError):
    """A request whose cache would not fit the budget even alone."""


@dataclass(frozen=True)
class CacheBudget:
    """At most ``limit`` bytes of keys and values, ``per_token`` bytes a token of a row."""

    limit: int
    per_token: int

    @classmethod
    def of(cls, model: torch.nn.Module, limit: int) -> CacheBudget:
        from ..verifier.support import kv_bytes_per_token

        return cls(limit, kv_bytes_per_token(model))

    def fits(self, rows: int, tokens: int) -> bool:
        """Whether ``rows`` rows of ``tokens`` tokens each fit."""
        return rows * tokens * self.per_token <= self.limit

    def refusal(self, tokens: int) -> str | None:
        """Why a request whose row may hold ``tokens`` tokens never fits; ``None`` where it fits alone."""
        if self.fits(1, tokens):
            return None
        return (
            f"this request may hold {tokens} tokens of keys and values ({gigabytes(tokens * self.per_token)}), "
            f"over the cache's memory budget of {gigabytes(self.limit)} (--max-memory): ask for fewer new tokens "
            f"(max_tokens) or send a shorter prompt"
        )

    def report(self) -> dict:
        """What the budget admits (the server's /health)."""
        return {"budget_bytes": self.limit, "bytes_per_token": self.per_token, "tokens": self.limit // self.per_token}
