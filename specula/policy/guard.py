"""The cost model's backstop: drafts that made fewer tokens a second than plain passes in the run at hand are sent
no more for a while.

The cost model sends what its estimates say pays, and estimates can be wrong: acceptance guessed for a request's
first passes, costs timed at another moment or extrapolated. So where timings may decide (fp32, row-exact: the
output does not depend on draft lengths), the run's outcome is watched too: per number of rows, over its last
:data:`WINDOW` passes, where most sent drafts, the tokens a second those made against what its plain passes make (the
rows over the median of the last 3 plain passes' times, which the loop times now and then). Where the drafts made
fewer, the next :data:`REST` passes of that many rows send none; then drafts are tried again. (A few passes with
drafts among plain ones are the cost model's own exploration, bounded by it.) Worked example, 4 rows, plain passes
of 0.1 s (40 tokens a second): 16 passes with drafts that took 0.2 s and made 6 tokens each (30 a second) lose, so
the next 32 passes of 4 rows are plain.
"""

from __future__ import annotations

import collections
import statistics

WINDOW = 16  # passes weighed at once, most of them with drafts
REST = 32  # passes without drafts after a window that lost


class DraftGuard:
    """Per number of rows: whether the next pass may send drafts (:meth:`allows`, asked once a pass) and what the
    passes with drafts made (:meth:`record`)."""

    def __init__(self) -> None:
        self.window: dict[int, collections.deque] = {}  # by rows: (seconds, tokens made) of passes, None: plain
        self.resting = collections.Counter()  # by rows: passes left without drafts

    def allows(self, rows: int) -> bool:
        """Whether this pass of ``rows`` rows may send drafts (a pass that may not counts towards the rest)."""
        if self.resting[rows] > 0:
            self.resting[rows] -= 1
            return False
        return True

    def record(
        self, rows: int, seconds: float, tokens: float | None, plain: list[float], worth: float | None = None
    ) -> None:
        """A pass of ``rows`` rows took ``seconds`` and made ``tokens`` (``None``: a plain pass); ``plain``: the
        seconds of this run's plain passes of as many rows, oldest first. Where the rows' tokens are worth less than
        one each (a draining batch: :func:`~specula.policy.adaptive.finishing_worth`), ``tokens`` weighs each row's by
        its worth and ``worth`` is their sum: what a plain pass would have made, weighed alike."""
        window = self.window.setdefault(rows, collections.deque(maxlen=WINDOW))
        window.append(None if tokens is None else (seconds, tokens, rows if worth is None else worth))
        drafted = [outcome for outcome in window if outcome is not None]
        if len(window) == WINDOW and 2 * len(drafted) > WINDOW and plain:
            made = sum(tokens for _, tokens, _ in drafted)
            if made < sum(seconds * worth for seconds, _, worth in drafted) / statistics.median(plain[-3:]):
                self.resting[rows] = REST
                window.clear()
