"""Pass costs: what a verification pass over ``n`` tokens takes with this model on this machine, measured while
decoding, on a machine that other programs share.

Load comes and goes, and it slows a pass over several tokens more than a plain pass (docs/hardware.md). So a pass is
weighed against the plain
passes (one token a row) timed nearest it, before or after: its cost is kept as that ratio, estimated robustly (the
lower median of its recent samples: a stall only ever adds time). An estimate not refreshed for :data:`RECENT`
passes is stale: a stale width is sent again now and then, out of a credit of :data:`EXPLORE` of the decoding time
(:meth:`PassCosts.probe`); after :data:`FORGET` passes it is forgotten, and explored again like a width never
timed. So one busy moment never switches drafts off for good: when the machine is quiet again, the widths it made
look dear are measured again and sent.

What a process measured is kept for the next (:func:`keep_pass_costs`) beside what the runs before it measured, and
the next starts from the lower median of the last :data:`HISTORY` runs' figures of each width (each the lower median
of at least :data:`SAMPLES_KEPT` passes): one stall, or one run that a burst slowed, moves the prior of no width,
and a run that other programs shared the CPUs with (:mod:`specula.machine.load`) keeps nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable

import numpy as np
import torch

from ..machine import store
from ..machine.load import LoadMeter
from ..machine.profile import profile_of
from ..machine.timing import lower_median
from ..verifier.exactness import model_key

KEEP = 8  # samples kept per pass width (plain passes: those of the last FORGET passes)
RECENT = 32  # passes after which a width's last sample is stale
FORGET = 4 * RECENT  # passes after which a width not sent again is forgotten (plain passes: never)
EXPLORE = 0.02  # share of the decoding time that measuring stale widths again may cost
CONTRADICTED = 1.5  # a prior is dropped once a width timed here costs this many times what it said
CONTEXTS = 2.0  # a prior is taken at contexts within this factor of the one it was measured at
KEPT = "timed pass costs"  # what the costs one process measured are kept as, for the next (a calibration)
KEYS = "keys"  # ... with the keys a row their plain passes followed
HISTORY = 3  # runs whose figures of a width are kept: the next process starts from their lower median
SAMPLES_KEPT = 2  # passes of a width a run timed, at least, for its figure to be kept (one stall moves none)
UNCONFIRMED = "unconfirmed"  # ... with, by tokens, the runs in a row that started from its figures and did not time it
DOUBTED = 2  # runs in a row that did not time a kept width, after which its figures are dropped ...
DOUBTING = 16  # ... each of at least as many passes of its rows


class PassCosts:
    """What passes of ``rows`` rows cost, by the tokens they compute in all (their rows padded to the widest; fewer
    than ``size``), passes with trees apart from chain passes (a tree pass costs more than a chain as wide)."""

    def __init__(
        self, rows: int, size: int, prior: dict[int, float] | None = None, prior_keys: int | None = None
    ) -> None:
        self.rows, self.size = rows, size
        # by tokens: a chain pass's cost in plain passes as an earlier process measured it, until this one times it
        # (a stale estimate, forgotten after FORGET passes as any is), at contexts near the one it was measured at
        # (prior_keys: the keys a row of its plain passes followed; None: not known, taken at any)
        self.prior = {tokens: ratio for tokens, ratio in (prior or {}).items() if rows < tokens < size}
        self.prior_keys = prior_keys
        self._given = dict(sorted(self.prior.items()))  # (the prior as given: what this process's timings test)
        self.samples: dict[tuple[int, bool], deque] = {}  # (tokens, tree): (pass number, seconds), newest last
        self.keys: deque = deque(maxlen=KEEP)  # the keys a row of the last plain passes recorded followed
        self.passes = 0  # passes recorded
        self.credit = 0.0  # what measuring stale widths may still cost, in plain passes
        self.kept: dict[str, float] = {}  # by tokens: the figures this process last kept (keep_pass_costs)
        self.doubted: set[str] = set()  # tokens of the kept widths this process counted as not timed
        self._estimates: dict[bool, np.ndarray] = {}  # (cached until the next record)

    def record(self, tokens: int, seconds: float, tree: bool = False, keys: int | None = None) -> None:
        """A pass over ``tokens`` tokens took ``seconds`` (``keys``: the most its rows' caches held before it)."""
        if tokens >= self.size:
            return
        self.passes += 1
        keep = FORGET if tokens == self.rows else KEEP  # (plain passes: what the others are weighed against)
        self.samples.setdefault((tokens, tree), deque(maxlen=keep)).append((self.passes, seconds))
        if keys is not None and tokens == self.rows and not tree:
            self.keys.append(keys)
        if not tree:
            self.prior.pop(tokens, None)
        self._estimates.clear()
        self.credit += EXPLORE * seconds / (self.plain() or seconds)

    def plain(self) -> float | None:
        """What a plain pass costs now: the lower median of the last 3 (``None`` before any)."""
        plain = self.samples.get((self.rows, False))
        return lower_median(seconds for _, seconds in list(plain)[-3:]) if plain else None

    def ratios(self, tree: bool = False) -> np.ndarray:
        """Index ``e``: a pass over ``rows + e`` tokens in plain passes timed about when it was, ``nan`` where none
        was timed in the last :data:`FORGET` passes (with ``tree``: a tree pass's where measured, else a chain
        pass's). Each width's estimate is the lower median over its samples of the last :data:`RECENT` passes (or
        its last 3, where none is that recent) of each against the plain passes timed nearest it; a width never
        timed here takes the prior's estimate."""
        if tree not in self._estimates:
            ratios = np.full(self.size - self.rows, np.nan)
            widths = [
                (tokens, np.array(samples))
                for (tokens, is_tree), samples in sorted(  # [samples, 2]: pass, seconds
                    self.samples.items(), key=lambda item: item[0][1]
                )  # (trees last: theirs win)
                if is_tree <= tree and samples[-1][0] > self.passes - FORGET
            ]
            if widths:
                plain = np.array(self.samples.get((self.rows, False), [])).reshape(-1, 2)  # [plain passes, 2]
                every = np.concatenate([samples for _, samples in widths])
                relative = np.split(
                    every[:, 1] / nearest_plain(every[:, 0], plain[:, 0], plain[:, 1]),
                    np.cumsum([len(samples) for _, samples in widths])[:-1],
                )
                for (tokens, samples), ratio in zip(widths, relative):
                    recent = samples[:, 0] > self.passes - RECENT
                    ratios[tokens - self.rows] = lower_median(ratio[recent] if recent.any() else ratio[-3:])
            unit = (self.rows, False) in self.samples  # (without a plain pass, ratios are seconds)
            if unit and self.prior and self._contradicted(ratios):
                self.prior.clear()
            prior = self._prior() if unit or not widths else {}
            for tokens, ratio in prior.items():
                if np.isnan(ratios[tokens - self.rows]):
                    ratios[tokens - self.rows] = ratio
            if unit or prior:
                ratios[0] = 1.0
            self._estimates[tree] = ratios
        return self._estimates[tree]

    def _prior(self) -> dict[int, float]:
        """The prior where it still holds: within :data:`FORGET` passes, and where the last plain pass recorded
        followed about as many keys a row as the prior's (within :data:`CONTEXTS` times; before any, or where either
        is not known, taken as it is). A wide pass costs more plain passes after a short context than after a long
        one (attention is less of either), so a prior kept from other contexts would misprice every width.

        >>> costs = PassCosts(1, 10, {5: 1.4}, prior_keys=1000)
        >>> costs.record(1, 0.1, keys=900); costs._prior()
        {5: 1.4}
        >>> costs.record(1, 0.1, keys=100); costs._prior()
        {}
        """
        if self.passes > FORGET:
            return {}
        if self.prior_keys and self.keys and not 1 / CONTEXTS <= self.keys[-1] / self.prior_keys <= CONTEXTS:
            return {}
        return self.prior

    def _contradicted(self, ratios: np.ndarray) -> bool:
        """Whether a width timed here cost over :data:`CONTRADICTED` times what the prior says (between its widths,
        interpolated): then none of the prior is trusted, and the widths it priced are explored again as never timed.

        >>> costs = PassCosts(1, 10, {3: 1.2, 5: 1.4})
        >>> costs._contradicted(np.array([1.0, np.nan, np.nan, 1.5])), costs._contradicted(np.array([1.0, 2.0]))
        (False, True)
        """
        timed = np.flatnonzero(~np.isnan(ratios[1:])) + 1 + self.rows  # tokens of the widths timed here
        said = np.interp(timed, list(self._given), list(self._given.values()))
        return bool(np.any(ratios[timed - self.rows] > CONTRADICTED * said))

    def seconds(self, tree: bool = False) -> np.ndarray:
        """Estimated seconds now of a pass over ``rows + e`` tokens (index ``e``); widths not measured take the
        value of the nearest measured ones (interpolated), and past the widest measured grow from it as steeply as
        the costs measured up to it, on average or over their last step, whichever is steeper (an untimed width is
        never free); all 1.0 before any measurement. Worked example: 1.0 and 1.5 measured at ``e`` 0 and 4, so 1.25 at
        2 and 2.0 at 8."""
        ratios = self.ratios(tree)
        measured = np.flatnonzero(~np.isnan(ratios))
        if not len(measured):
            return np.ones(len(ratios))
        at = np.arange(len(ratios))
        estimate = np.interp(at, measured, ratios[measured])
        if len(measured) > 1:
            last, before = measured[-1], measured[-2]
            slope = max(
                (ratios[last] - ratios[measured[0]]) / (last - measured[0]),
                (ratios[last] - ratios[before]) / (last - before),
                0.0,
            )
            estimate[last:] += slope * (at[last:] - last)
        return estimate * (self.plain() or 1.0)

    def explored_width(self, tree: bool = False) -> int:
        """The longest draft worth the risk in a pass: ``2w - 1`` tokens a row once a pass ``w`` tokens wide has
        been timed (none before any)."""
        measured = np.flatnonzero(~np.isnan(self.ratios(tree)))
        return 2 * (int(measured[-1]) + self.rows) // self.rows - 1 if len(measured) else 0

    def explored_tokens(self) -> int:
        """The most draft tokens in all worth the risk in a flat pass: a pass over twice the tokens of the widest
        timed (none before any)."""
        measured = np.flatnonzero(~np.isnan(self.ratios()))
        return 2 * (int(measured[-1]) + self.rows) - self.rows if len(measured) else 0

    def probe(self, best: int, expected: np.ndarray, rates: np.ndarray, flat: bool = False) -> int:
        """The number of draft tokens a row to send, of ``rates`` (tokens per second, index ``m``: ``m`` tokens a
        row, ``expected`` tokens from the pass; ``flat``: ``m`` tokens in all): ``best``, or, where the credit covers
        what it loses against ``best``, the likeliest to pay of the widths whose estimate is stale, to measure it
        again; none where passes were timed but no plain one (a process primed by a prior: the plain pass is the
        unit of every other)."""
        plain = self.plain()
        if plain is None:  # (passes timed, none plain: what they cost in plain passes is unknown, so time one now)
            return 0 if self.samples else best
        for width in sorted(range(len(rates)), key=lambda m: -rates[m]):
            tokens = self.rows + width if flat else self.rows * (width + 1)
            last = self.samples.get((tokens, False))
            if width == best or (
                tokens not in self._prior()
                if last is None
                else (last[-1][0] > self.passes - RECENT or (width and last[-1][0] <= self.passes - FORGET))
            ):
                continue  # (never timed, fresh or forgotten; a prior's width is stale until timed here)
            loss = expected[width] * (1.0 / rates[width] - 1.0 / rates[best]) / plain  # (in plain passes)
            if loss <= self.credit:
                self.credit -= loss
                return width
        return best

    def table(self) -> dict[int, float]:
        """Chain passes' costs in plain passes by tokens, as this process measured them, else as its prior said:
        what the next process starts from (:func:`keep_pass_costs`)."""
        if self.plain() is None:  # (no unit)
            return {}
        ratios = self.ratios()
        return {self.rows + e: round(float(ratio), 3) for e, ratio in enumerate(ratios) if e and not np.isnan(ratio)}


def nearest_plain(when: np.ndarray, passes: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """What a plain pass cost about each pass ``when[i]``: the lower median of the 3 plain passes (numbered
    ``passes``, ascending, taking ``seconds``) timed nearest it (1.0 where none was: ratios are then seconds).

    >>> nearest_plain(np.array([10, 30]), np.array([1, 2, 9, 12, 30]), np.array([5.0, 5.0, 1.0, 2.0, 7.0]))
    array([2., 2.])
    """
    if not len(passes):
        return np.ones(len(when))
    at = np.searchsorted(passes, when)[:, None] + np.arange(-3, 3)  # [when, 6]: the plain passes around each
    valid = (at >= 0) & (at < len(passes))
    at = np.clip(at, 0, len(passes) - 1)
    distance = np.where(valid, np.abs(passes[at] - when[:, None]), np.inf)
    nearest = np.take_along_axis(at, np.argsort(distance, axis=1, kind="stable")[:, :3], axis=1)  # [when, 3]
    values = np.sort(seconds[nearest], axis=1)
    return values[:, (min(3, len(passes)) - 1) // 2]  # (fewer than 3 plain passes: their lower median)


def shared_pass_costs(owner: torch.nn.Module, setting: Hashable, max_draft: int, rows: int = 1) -> PassCosts:
    """The pass costs (of ``rows`` rows) that every decision for ``owner`` (a target model) in ``setting`` (its
    device and dtype) shares: what one generation measured, the next starts from (the lower median of each width's
    kept figures). Kept per number of rows: ``n`` tokens over one row and over ``n`` rows cost differently (attention
    reads one cache or ``n``). Kept in the model's profile."""
    known = store.shared().known  # (first: a store read anew drops every profile)
    tables = profile_of(owner).pass_costs
    if (setting, max_draft, rows) not in tables:
        kept = dict(known.get(_kept_key(owner, rows), {}))
        keys = kept.pop(KEYS, None)
        kept.pop(UNCONFIRMED, None)
        prior = {int(tokens): lower_median(_figures(kept[tokens])) for tokens in kept}
        tables[setting, max_draft, rows] = PassCosts(rows, rows * (max_draft + 1) + 1, prior, keys)
    return tables[setting, max_draft, rows]


def keep_pass_costs(owner: torch.nn.Module, setting: Hashable, max_draft: int, rows: int, load: LoadMeter) -> None:
    """Keep the pass costs of ``rows`` rows this process measured for ``owner`` in ``setting`` with the calibrations,
    each width timed at least :data:`SAMPLES_KEPT` times, its figure after those of the last runs (:data:`HISTORY`
    in all; this process's figures of an earlier keep replaced; a run at contexts over :data:`CONTEXTS` times
    another's starts them anew): the next process on this machine starts from them (its prior: sent where it says
    they pay, timed again out of the exploration credit where it says they do not). A kept width that
    :data:`DOUBTED` runs in a row of at least :data:`DOUBTING` passes did not time is dropped: a figure that a stall
    made too dear to send would never be timed again, and every short run would take it. Nothing is kept where other
    programs took the CPUs since ``load`` started (the run's)."""
    known = store.shared().known  # (first: a store read anew drops every profile)
    costs = profile_of(owner).pass_costs.get((setting, max_draft, rows))
    if costs is None or load.disturbed():
        return
    measured = {
        str(t): ratio for t, ratio in costs.table().items() if len(costs.samples.get((t, False), ())) >= SAMPLES_KEPT
    }
    key = _kept_key(owner, rows)
    kept = dict(known.get(key, {}))
    before, now = kept.pop(KEYS, None), (int(np.median(costs.keys)) if costs.keys else None)
    doubts = dict(kept.pop(UNCONFIRMED, {}))
    if before and now and not 1 / CONTEXTS <= now / before <= CONTEXTS:
        kept, doubts = {}, {}
    history = {tokens: _figures(figures) for tokens, figures in kept.items()}
    for tokens, ratio in costs.kept.items():  # (this process's figures of an earlier keep: replaced)
        if history.get(tokens, [None])[-1] == ratio:
            history[tokens].pop()
    for tokens, ratio in measured.items():
        history[tokens] = [*history.get(tokens, []), ratio][-HISTORY:]
        doubts.pop(tokens, None)
    for tokens in set(history) - set(measured) - costs.doubted if costs.passes >= DOUBTING else ():
        doubts[tokens] = doubts.get(tokens, 0) + 1  # (a figure too dear to send is never timed)
    for tokens in [tokens for tokens, runs in doubts.items() if runs >= DOUBTED]:
        del history[tokens], doubts[tokens]
    costs.kept, costs.doubted = measured, (costs.doubted | set(history)) - set(measured)
    context = {KEYS: now} if now else {KEYS: before} if before else {}
    doubted = {UNCONFIRMED: doubts} if doubts else {}
    store.shared().keep(
        key, {**{tokens: figures for tokens, figures in history.items() if figures}, **context, **doubted}
    )


def _figures(kept: float | list[float]) -> list[float]:
    """A width's kept figures, oldest first (a store of an earlier version kept one figure)."""
    return list(kept) if isinstance(kept, list) else [kept]


def _kept_key(owner: torch.nn.Module, rows: int) -> str:
    weight = next(owner.parameters())
    attention = getattr(getattr(owner, "config", None), "_attn_implementation", None)
    return store.key(weight.device, KEPT, model_key(owner), weight.dtype, attention, rows)
