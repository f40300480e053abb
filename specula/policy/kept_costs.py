"""Pass costs measured once per machine and model and kept: what sizes drafts where output depends on their lengths.

With ordinary verification in bf16 or fp16, a pass over several tokens rounds otherwise than one-token steps, so
which tokens come may depend on how many drafts each pass verified. Draft lengths must then not follow the clock,
or a request would decode differently from run to run. Yet they should follow what passes cost, or a machine where
a pass over 8 tokens costs several one-token steps would be slower than plain decoding. So there, draft lengths are
decided from a table of pass costs measured once per machine and model (passes over 1, 2, 3, 5, 9, 17 and 33 tokens
after :data:`CONTEXT` tokens, timed in rounds, the lower median of each width's ratio to the one-token pass) and kept
with the calibrations (:mod:`specula.machine.store`): later runs on the machine read the same table, so they
decide alike. Batches read tables of their own (:data:`ROWS`: passes of 2, 4 and 8 rows, up to 17 tokens a row,
after :data:`BATCH_CONTEXT` tokens each, against a one-token pass of as many rows): a batch of another size interpolates
between the tables of the rows around it.

A table measured at a bad moment, or on passes unlike a run's (other contexts, other neighbours on the machine),
may underprice wide passes, and drafts that do not pay would then be sent for good. So a run checks the table against
its own passes (the loop times a plain pass now and then; each width sent between two plain passes is weighed
against them): once a width cost over :data:`UNDERPRICED` times what the table says in :data:`STRIKES` such spans in
a row, that width and every wider one are priced that much dearer, and the correction is kept for later runs (which
then decide alike again), unless other programs took the CPUs meanwhile (:mod:`specula.machine.load`: then it holds
for that run only). Short of that, noise in the run's timings changes nothing, nor does a slow spell (another
program's burst, which the load meter may not see: a virtual machine's neighbours) between two plain passes:
decisions follow the table, not the clock.
"""

from __future__ import annotations

import torch

from ..machine import store
from ..machine.load import LoadMeter
from ..machine.timing import lower_median
from ..verifier.exactness import model_key
from ..verifier.timed import width_costs
from .costs import PassCosts

CONTEXT = 256  # tokens of cache the timed passes of one row follow
BATCH_CONTEXT = 1024  # ... of several rows (files' requests: retrieved passages, code to edit, articles)
WIDTHS = (1, 2, 3, 5, 9, 17, 33)  # tokens a row per timed pass (several rows: up to 17)
ROWS = (1, 2, 4, 8)  # rows of the timed passes
ROUNDS = 3
MAX_WIDTH = 65  # tokens a row of the loop's widest pass: compiled passes measured in the loop's own buckets
UNDERPRICED = 1.5  # a width costing this many times what the table says in a run is corrected ...
STRIKES = 3  # ... once it did in that many spans between two plain passes in a row ...
SPAN = 3  # ... each with at least that many passes of it
CORRECTED = "pass cost corrections"  # what corrections are kept as, by rows


class KeptCosts(PassCosts):
    """A :class:`PassCosts` that holds a kept table (the policy records no pass into it: ``timed=False``), and sends
    no draft longer than its widest pass measured (``widest`` tokens a row: a wider one's cost is not known, and
    never will be)."""

    def __init__(self, rows: int, size: int, widest: int, kept: str | None = None) -> None:
        super().__init__(rows, size)
        self.widest, self.kept = widest, kept  # (kept: the store's key of its corrections; None: not kept)
        self.run = PassCosts(rows, size)  # this run's passes, timed: what the table is checked against
        self.load = LoadMeter()  # what other programs took of the CPUs meanwhile (a busy run's correction is not kept)
        self._strikes: dict[int, list[float]] = {}  # by tokens: its cost in plain passes in the last spans it was dear

    def explored_width(self, tree: bool = False) -> int:
        return min(super().explored_width(tree), self.widest - 1)

    def explored_tokens(self) -> int:
        return min(super().explored_tokens(), self.rows * (self.widest - 1))

    def check(self, tokens: int, seconds: float, tree: bool = False) -> None:
        """A pass of the run over ``tokens`` tokens took ``seconds``. At each plain pass, each width sent at least
        :data:`SPAN` times since the plain pass before is weighed against the two (the lower median of its passes
        over their mean): where it cost over :data:`UNDERPRICED` times what the table says in :data:`STRIKES` such
        spans in a row, it and every wider one are priced dearer by what it cost over the table (the lower median of
        those spans; :meth:`correct`), and that is kept. A slow spell between two plain passes is one span: it
        corrects nothing."""
        if tree or tokens >= self.size:
            return
        self.run.record(tokens, seconds)
        plain = self.run.samples[tokens, False]
        if tokens != self.rows or len(plain) < 2:
            return
        (start, before), (end, after) = plain[-2], plain[-1]
        for (width, is_tree), samples in sorted(self.run.samples.items()):
            span = [seconds for number, seconds in samples if start < number < end]
            if is_tree or width == self.rows or len(span) < SPAN:
                continue
            said = self.seconds()[width - self.rows]
            ratio = lower_median(span) / ((before + after) / 2)
            strikes = self._strikes[width] = (
                self._strikes.get(width, []) + [ratio] if ratio > UNDERPRICED * said else []
            )
            if len(strikes) >= STRIKES:
                self.correct(width, lower_median(strikes) / said)
                self._strikes = {other: kept for other, kept in self._strikes.items() if other < width}
                self._keep(width, lower_median(strikes) / said)

    def _keep(self, tokens: int, factor: float) -> None:
        """Keep a correction of ``factor`` from ``tokens`` tokens on (on top of what earlier runs found), unless
        other programs took the CPUs during the run."""
        if self.kept is not None and not self.load.disturbed():
            kept = store.shared().known.get(self.kept, {})
            store.shared().keep(self.kept, {**kept, str(tokens): round(kept.get(str(tokens), 1.0) * float(factor), 3)})

    def correct(self, tokens: int, factor: float) -> None:
        """Price passes over ``tokens`` tokens and more ``factor`` times dearer than the table said, and narrower ones
        as if what the table says they cost beyond a plain pass were too low in the same proportion as for
        ``tokens`` (the table's shape is kept, its slope is what was wrong). Worked example: one row, the table says
        9 tokens cost 2.0 plain passes and 5 tokens 1.5; 9 are 5 times dearer (10.0: 9 more than a plain pass, not
        1), so 5 tokens cost 1 + 0.5 * 9 = 5.5."""
        said = self.seconds()[tokens - self.rows]
        slope = (factor * said - 1.0) / (said - 1.0) if said > 1.0 else None  # (None: no slope to scale)
        for (width, tree), samples in self.samples.items():
            if width == self.rows:
                continue
            self.samples[width, tree] = type(samples)(
                [
                    (
                        number,
                        seconds * factor
                        if width >= tokens or slope is None
                        else max(seconds, 1.0 + (seconds - 1.0) * slope),
                    )
                    for number, seconds in samples
                ],
                maxlen=samples.maxlen,
            )
        self._estimates.clear()


def _context(rows: int) -> int:
    """The tokens of cache each row of the timed passes of ``rows`` rows follows."""
    return CONTEXT if rows == 1 else BATCH_CONTEXT


def widths(rows: int) -> tuple[int, ...]:
    """The tokens a row of the timed passes of ``rows`` rows."""
    return WIDTHS if rows == 1 else WIDTHS[:-1]


def kept_pass_costs(
    model: torch.nn.Module, max_draft: int, rows: int = 1, compiled: str | None = None
) -> KeptCosts | None:
    """The kept pass costs of ``model`` on this machine (measured on first use), as costs of passes of ``rows`` rows
    for drafts of up to ``max_draft`` tokens a row (between two of :data:`ROWS`, interpolated in the rows from their
    tables; past the most, the most's); ``None`` where its passes cannot be timed so. Worked example: 2 rows cost
    1.2 and 4 rows 1.6 plain passes of as many rows over 3 tokens a row, so 3 rows cost 1.4."""
    fewer = max(count for count in ROWS if count <= rows)
    more = min((count for count in ROWS if count >= rows), default=fewer)
    low, high = _kept_table(model, fewer, compiled), _kept_table(model, more, compiled)
    if low is None or high is None:
        return None
    share = (rows - fewer) / (more - fewer) if more > fewer else 0.0
    weight = next(model.parameters())
    kept = store.key(
        weight.device,
        CORRECTED,
        model_key(model),
        weight.dtype,
        model.config._attn_implementation,
        rows,
        *([f"compiled {compiled}"] if compiled else []),
    )
    costs = KeptCosts(rows, rows * (max_draft + 1) + 1, widths(more)[-1], kept)
    for width, below, above in zip(widths(more), low, high):
        if rows * width < costs.size:
            costs.record(rows * width, below + (above - below) * share)
    for tokens, factor in sorted(store.shared().known.get(kept, {}).items(), key=lambda item: int(item[0])):
        costs.correct(int(tokens), factor)  # (what earlier runs found)
    return costs


def _kept_table(model: torch.nn.Module, rows: int, compiled: str | None = None) -> list[float] | None:
    """The kept ratios of passes of ``rows`` (one of :data:`ROWS`) over each of :func:`widths`, measured on first
    use (passes as ``compiled`` runs them: :class:`~specula.verifier.runner.CachedModel`)."""
    weight = next(model.parameters())
    key = store.key(
        weight.device,
        "pass costs",
        model_key(model),
        weight.dtype,
        model.config._attn_implementation,
        _context(rows),
        *([rows] if rows > 1 else []),
        *([f"compiled {compiled}"] if compiled else []),
    )
    return store.shared().get(key, lambda: _measure(model, rows, compiled))


def _measure(model: torch.nn.Module, rows: int = 1, compiled: str | None = None) -> list[float] | None:
    """The cost of a pass of ``rows`` rows over each of :func:`widths` tokens a row, over a one-token pass's,
    ordinary verification (:func:`~specula.verifier.timed.width_costs`)."""
    return width_costs(model, rows, widths(rows), _context(rows), ROUNDS, compiled, MAX_WIDTH)
