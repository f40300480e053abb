"""The summary's estimate: what a run would have cost as plain decoding (one token a row a pass) of the same requests
in batches of as many rows, priced by plain passes timed in the run itself, which the loop sends now and then."""

from __future__ import annotations

import collections

import numpy as np

# Where drafts are sized by the cost model, a pass of a number of rows that has had PLAIN_FIRST passes (then
# PLAIN_EVERY) without a plain one (no drafts) is plain: what the estimate prices plain decoding by (and kept pass
# costs are checked against). Counted in passes, so due alike on every run; a short request (a notebook's) is seldom
# held up by one.
PLAIN_FIRST, PLAIN_EVERY = 8, 32


class PlainEstimate:
    """A run's plain passes and what its requests needed, for :meth:`comparison`."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.needs: dict[int, int] = {}  # by request, in the order they finished: one-token passes after its prefill
        self.plain: dict[int, list[float]] = {}  # by rows: seconds of the run's plain passes (timed ones)
        self.unpriced = collections.Counter()  # by rows: passes since the last plain one

    def due(self, rows: int) -> bool:
        """Whether the next pass of ``rows`` rows is to be a plain one (:data:`PLAIN_FIRST`, :data:`PLAIN_EVERY`)."""
        return self.unpriced[rows] >= (PLAIN_EVERY if rows in self.plain else PLAIN_FIRST)

    def record(self, rows: int, width: int, seconds: float | None) -> None:
        """A pass of ``rows`` rows, each ``width`` tokens wide, took ``seconds`` (``None``: not timed)."""
        self.unpriced[rows] = 0 if width == 1 else self.unpriced[rows] + 1
        if width == 1 and seconds is not None:
            self.plain.setdefault(rows, []).append(seconds)

    def finished(self, request: int, needs: int) -> None:
        """Request ``request`` ended ``needs`` tokens after its prefill."""
        self.needs[request] = needs

    def comparison(self, prefill_seconds: float, pass_seconds: float) -> tuple[float, float] | None:
        """What the run would have cost as plain decoding, and what it cost (``prefill_seconds`` in prefills,
        ``pass_seconds`` in the other passes, proposing included). Plain decoding is replayed (:func:`plain_passes`:
        each request's tokens after its prefill, rows leaving and joining as they would); a plain pass of ``r`` rows
        costs the mean of the run's plain passes of ``r`` rows (the mean, as the run's own passes are summed with
        their stalls), between the numbers of rows timed so, interpolated. ``None`` where that would price under
        half of the replayed passes from their own rows' plain passes (no pass, ``adaptive_draft=False`` with drafts
        in every pass, rows that never ran a plain pass)."""
        price = {rows: float(np.mean(seconds)) for rows, seconds in sorted(self.plain.items())}
        passes = plain_passes(list(self.needs.values()), self.slots)
        if sum(count for rows, count in passes.items() if rows in price) * 2 < max(sum(passes.values()), 1):
            return None
        plain = sum(count * float(np.interp(rows, list(price), list(price.values()))) for rows, count in passes.items())
        return prefill_seconds + plain, prefill_seconds + pass_seconds


def plain_passes(needs: list[int], slots: int) -> collections.Counter:
    """How many passes of each number of rows plain decoding takes for requests needing ``needs`` one-token passes
    each after their prefills, started in this order in ``slots`` slots (a finished request's slot taken by the next
    before the following pass). Worked example: needs [3, 1, 2] in 2 slots: a pass of 2 rows (3 -> 2, 1 done), then
    of 2 (2 -> 1, and the third joins: 2 -> 1), then of 2 (both done): {2: 3}; in 1 slot, {1: 6}.

    >>> plain_passes([3, 1, 2], 2), plain_passes([3, 1, 2], 1)
    (Counter({2: 3}), Counter({1: 6}))
    """
    waiting, running, passes = iter(needs), [], collections.Counter()
    while True:
        while len(running) < slots and (need := next(waiting, None)) is not None:
            running += [need] if need > 0 else []  # (a request done with its prefill takes no pass)
        if not running:
            return passes
        passes[len(running)] += 1
        running = [need - 1 for need in running if need > 1]
