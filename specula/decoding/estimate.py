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
SPAN = 64  # keys a run's plain passes of some rows must span for their cost to be read as a line in the keys


class PlainEstimate:
    """A run's plain passes and what its requests needed, for :meth:`comparison`."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.needs: dict[int, tuple[int, int]] = {}  # by request, in the order they finished: (one-token passes
        # after its prefill, tokens it held then)
        self.plain: dict[int, list[float]] = {}  # by rows: seconds of the run's plain passes (timed ones)
        self.plain_keys: dict[int, list[int]] = {}  # by rows: the tokens the longest row held before each of them
        self.unpriced = collections.Counter()  # by rows: passes since the last plain one

    def due(self, rows: int) -> bool:
        """Whether the next pass of ``rows`` rows is to be a plain one (:data:`PLAIN_FIRST`, :data:`PLAIN_EVERY`)."""
        return self.unpriced[rows] >= (PLAIN_EVERY if rows in self.plain else PLAIN_FIRST)

    def record(self, rows: int, width: int, seconds: float | None, keys: int) -> None:
        """A pass of ``rows`` rows, each ``width`` tokens wide, after the longest held ``keys`` tokens, took
        ``seconds`` (``None``: not timed)."""
        self.unpriced[rows] = 0 if width == 1 else self.unpriced[rows] + 1
        if width == 1 and seconds is not None:
            self.plain.setdefault(rows, []).append(seconds)
            self.plain_keys.setdefault(rows, []).append(keys)

    def finished(self, request: int, needs: int, prompt: int) -> None:
        """Request ``request`` ended ``needs`` tokens after its prefill of ``prompt`` tokens."""
        self.needs[request] = (needs, prompt)

    def price(self, rows: int, keys: int) -> float | None:
        """What a plain pass of ``rows`` rows after ``keys`` tokens cost in this run: a line in the keys through its
        plain passes of as many rows (least squares, rising or flat; where they span fewer than :data:`SPAN` keys,
        their mean), read within the keys they span; between the numbers of rows timed so, interpolated. A pass
        costs more as its rows hold more (attention reads them all), and the plain passes a run times need not fall
        where plain decoding's would (a run's own plain passes come where drafts did not pay: late, or early). The
        mean, not a median: the run's own passes are summed with their stalls. ``None`` where no plain pass was
        timed."""
        lines = {}  # rows: (seconds at the fewest keys timed, seconds more a key, fewest keys, most keys)
        for count, seconds in sorted(self.plain.items()):
            at = np.array(self.plain_keys[count], dtype=float)
            slope = 0.0
            if at.max() - at.min() >= SPAN:
                slope = max(0.0, float(np.polyfit(at, seconds, 1)[0]))
            lines[count] = (float(np.mean(seconds)) - slope * (at.mean() - at.min()), slope, at.min(), at.max())
        if not lines:
            return None
        values = [base + slope * (min(max(keys, low), high) - low) for base, slope, low, high in lines.values()]
        return float(np.interp(rows, list(lines), values))

    def comparison(self, prefill_seconds: float, pass_seconds: float) -> tuple[float, float] | None:
        """What the run would have cost as plain decoding, and what it cost (``prefill_seconds`` in prefills,
        ``pass_seconds`` in the other passes, proposing included). Plain decoding is replayed (:func:`plain_passes`:
        each request's tokens after its prefill, rows leaving and joining as they would), each pass priced by
        :meth:`price`. ``None`` where that would price under half of the replayed passes from their own rows'
        plain passes (no pass, ``adaptive_draft=False`` with drafts in every pass, rows that never ran a plain
        pass)."""
        passes = plain_passes(list(self.needs.values()), self.slots)
        priced = sum(count for (rows, _), count in passes.items() if rows in self.plain)
        if not self.plain or priced * 2 < max(sum(passes.values()), 1):
            return None
        plain = sum(count * self.price(rows, keys) for (rows, keys), count in passes.items())
        return prefill_seconds + plain, prefill_seconds + pass_seconds


def plain_passes(needs: list[tuple[int, int]], slots: int) -> collections.Counter:
    """How many passes of each number of rows, the longest holding how many tokens, plain decoding takes for
    requests needing ``(passes, prompt)``: that many one-token passes after their prefills of that many tokens,
    started in this order in ``slots`` slots (a finished request's slot taken by the next before the following
    pass). Worked example: needs [(3, 10), (1, 4), (2, 7)] in 2 slots: a pass of 2 rows after 10 tokens (3 -> 2, 1
    done), then of 2 after 11 (2 -> 1, and the third joins at 7: 2 -> 1), then of 2 after 12 (both done); in 1
    slot, passes of 1 row after 10, 11, 12, 4, 7 and 8 tokens.

    >>> plain_passes([(3, 10), (1, 4), (2, 7)], 2)
    Counter({(2, 10): 1, (2, 11): 1, (2, 12): 1})
    >>> sum(plain_passes([(3, 10), (1, 4), (2, 7)], 1).values())
    6
    """
    waiting, running, passes = iter(needs), [], collections.Counter()
    while True:
        while len(running) < slots and (need := next(waiting, None)) is not None:
            running += [need] if need[0] > 0 else []  # (a request done with its prefill takes no pass)
        if not running:
            return passes
        passes[len(running), max(held for _, held in running)] += 1
        running = [(left - 1, held + 1) for left, held in running if left > 1]
