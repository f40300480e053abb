"""A memory budget for the keys and values a run holds: requests join the batch only while its cache still fits.

Each row of a batch may grow to its room: its prompt, its ``max_new_tokens`` and room for a draft. On the CPU a row's
memory is what it wrote (:class:`~specula.verifier.cache_layers.PreallocatedLayer`'s pages), so a request joins where
the rows' rooms, with its own, add up to at most the budget. Elsewhere the cache is a rectangle of the rows in use,
each as long as the longest may grow, and that rectangle must fit. Otherwise the request waits, first in line, for
rows to leave. A request that would not fit even alone is refused before any work (the server's 400, a file's
skipped line). Worked example: 46,080 bytes a token (SmolLM2-135M in fp32) and a budget of 1 GB hold two rows of
8,192 tokens (0.75 GB), not three; beside one of them, on the CPU, 26 rows of 512 tokens, as a rectangle one.
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
    per_row: bool = True  # each row's memory its own tokens (paged), not the longest row's (a rectangle)
    page_tokens: int = 1  # ... in whole pages of this many tokens (a page of one key or value head)
    chunk: int = 1  # ... in chunks of this many bytes (a GPU's arena: every layer's states of a row together)

    @classmethod
    def of(cls, model: torch.nn.Module, limit: int, compiled: bool = False) -> CacheBudget:
        """``model``'s cache held to ``limit`` bytes, as its batches hold it (``compiled``: passes run compiled)."""
        from ..machine.memory import Pages
        from ..verifier.cache_layers import PAGED, arena_granule
        from ..verifier.static import ON_ARENA
        from ..verifier.support import kv_heads, model_device

        heads, head_bytes = kv_heads(model)
        device = model_device(model)
        chunk = arena_granule(device)
        if chunk is not None and (not compiled or device.type in ON_ARENA):
            return cls(limit, heads * head_bytes, True, chunk=chunk)
        paged = device.type in PAGED
        return cls(limit, heads * head_bytes, paged, Pages.whole(1, head_bytes) if paged else 1)

    def row_bytes(self, room: int) -> int:
        """The memory a row of ``room`` tokens takes (paged)."""
        tokens = -(-room // self.page_tokens) * self.page_tokens
        return -(-tokens * self.per_token // self.chunk) * self.chunk

    def fits(self, rooms: list[int], rows: int | None = None) -> bool:
        """Whether rows that may grow to ``rooms`` tokens each fit (as a rectangle: ``rows`` rows, at least as many,
        as long as the longest)."""
        if self.per_row:
            return sum(self.row_bytes(room) for room in rooms) <= self.limit
        return max(rows or 0, len(rooms)) * max(rooms) * self.per_token <= self.limit

    def refusal(self, tokens: int) -> str | None:
        """Why a request whose row may hold ``tokens`` tokens never fits; ``None`` where it fits alone."""
        if self.fits([tokens]):
            return None
        return (
            f"this request may hold {tokens} tokens of keys and values ({gigabytes(tokens * self.per_token)}), "
            f"over the cache's memory budget of {gigabytes(self.limit)} (--max-memory): ask for fewer new tokens "
            f"(max_tokens) or send a shorter prompt"
        )

    def report(self) -> dict:
        """What the budget admits (the server's /health)."""
        tokens = self.limit // self.per_token
        return {
            "budget_bytes": self.limit,
            "bytes_per_token": self.per_token,
            "tokens": tokens,
            "per_row": self.per_row,
        }
