"""The draft policy interface: what the speculation loop asks before a pass, and what it tells after one.

For the rows (requests) of each pass, in this order::

    budgets(states, room)            -> tokens to ask each row's proposer for (0: do not ask)
    trim(states, drafts, seconds)    -> which tokens of each proposed draft the pass verifies
    learn(Pass(...))                 -> what the pass cost and gave

``states[r]`` is what :meth:`DraftPolicy.start` returned when row ``r``'s request started: the policy's state for
that request, opaque to the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from ..core.draft import Draft


@dataclass(frozen=True)
class Pass:
    """What one verification pass did, row by row."""

    states: Sequence[object]  # [R] each row's policy state
    proposed: Sequence["Draft"]  # [R] what each row's proposer drafted (empty where it was not asked)
    sent: Sequence["Draft"]  # [R] what of it the pass verified
    new_tokens: Sequence[list[int]]  # [R] what the pass gave each row: its accepted drafts, then the target's token
    tokens: int  # tokens the pass computed in all (its rows padded to the widest)
    seconds: float | None  # what the pass took; None: not a measure of what such a pass costs (it calibrated)
    keys: int | None = None  # the most tokens a row's cache held before it (what its attention read)


class DraftPolicy(Protocol):
    """How many draft tokens each request asks for and sends (see the module docstring)."""

    flat: bool  # whether the next pass computes each row's tokens only, unpadded (the loop sets it before a pass)
    # while no request waits for a slot and the run's time is what counts: each row's tokens left before its end, as
    # far as the run knows it (None: every row's tokens count alike; the loop sets it too)
    draining: Sequence[int] | None

    def start(self, drawn: bool = False) -> object:
        """The state of a request that starts now (``drawn``: its drafts are drawn at random, so no decision about
        them may depend on measured times)."""

    def budgets(self, states: Sequence[object], room: Sequence[int]) -> list[int]:
        """Tokens to ask each row's proposer for, with ``room[r]`` draft tokens left before row ``r``'s end."""

    def trim(
        self, states: Sequence[object], drafts: Sequence["Draft"], draft_seconds: Sequence[float | None]
    ) -> list[list[int]]:
        """Indices (ascending) of the tokens of each row's draft to verify; ``draft_seconds[r]`` is what asking row
        ``r``'s proposer took (``None``: not asked)."""

    def learn(self, done: Pass) -> None:
        """What the pass cost and gave."""
