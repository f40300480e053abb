"""How many draft tokens to send each pass: the cost model behind the speculation loop.

Speculation pays when the tokens a pass gains outweigh what the longer verification pass costs. Both sides are
measured while decoding, never assumed:

- **cost**: the wall time of a pass that verifies ``n`` tokens (last token + ``n - 1`` drafts), smoothed per ``n``.
  It is not linear in ``n``, and its shape differs between machines and dtypes (``docs/cost-model.md``).
- **acceptance**: for each draft position ``i`` the share of passes whose token ``i`` was accepted given that tokens
  ``1 .. i-1`` were, with exponential forgetting so that it follows the text (copying a passage, then writing new
  prose). Drafts that were proposed but not sent still count where the tokens generated anyway reveal whether they
  were right, so a proposer that was switched off can earn its way back.

Costs are learnt by sending, so sending is what exploration risks: a length is sent only once a pass over about
half as many tokens has been timed (``k <= 2n - 1`` draft tokens after a pass over ``n`` tokens; the first pass after
the prefill is a plain pass, while the proposer's draft is checked for free against the token it
produces). What a pass costs is a fact of the model and the machine, not of the text, so the measured costs are
remembered
per target model (and its device and dtype) and later generations start from them
(:func:`specula.policy.costs.shared_pass_costs`):
only the first generation with a model explores; later ones send what pays from their first pass (later processes
too: the costs are kept with the calibrations as their prior, taken near the context it was measured at). The machine's
load is not a fact to remember: costs are weighed against plain passes timed about when they were, and a length
whose cost was not measured for a while is sent again now and then (:class:`specula.policy.costs.PassCosts`).

With ``P_i`` the chance that the first ``i`` draft tokens are all accepted, sending ``k`` tokens yields
``E(k) = 1 + P_1 + .. + P_k`` tokens for ``cost(k + 1)`` seconds plus the drafting time; each pass sends the ``k``
that maximises tokens per second (Leviathan et al. 2023, Theorem 3.8, with measured costs and per-position
acceptance instead of a constant ratio and rate). ``k = 0`` sends nothing: when drafts do not pay, decoding runs
as plain passes and only pays for asking the proposer, which is itself rationed (at most ~3% of a
plain pass) when the proposer is expensive. Worked example, costs ``[1.0, 1.6, 1.9, 1.4, 1.2]`` seconds for
``n = 1..5`` and ``P = [0.5, 0.3, 0.2, 0.1]``: ``E/cost`` is ``1.0, 0.94, 0.95, 1.43, 1.75`` for ``k = 0..4``, so
all 4 tokens are sent, although any shorter draft would have been slower than sending none.

A batch counts each row's tokens alike while requests wait for its slots: a row that finishes sooner lets the next
one in. Once none waits, the run ends with its last row, and a token of a row that will finish well before it makes
the run no shorter: the rows' tokens are then weighed by :func:`finishing_worth`, so the rows furthest from their
end send the drafts (docs/cost-model.md, "Batches").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .acceptance import RequestAcceptance
from .costs import PassCosts
from .protocol import Pass

if TYPE_CHECKING:
    from ..core.draft import Draft

SPREAD = 2.0  # rows this many times the square root of the most room left nearer their end than the furthest ...
FLOOR = 0.1  # ... are worth this share of its tokens (finishing_worth)


def finishing_worth(room: Sequence[int]) -> np.ndarray:
    """What a token of each row is worth, against one of the row furthest from its end, to a run that ends with its
    last row (no request waits for a slot), ``room`` the tokens each row may still make: ``1`` for that row, falling
    linearly with how much less room a row has to :data:`FLOOR` at ``SPREAD * sqrt(most room)`` tokens less (how far
    rows' progress may yet part: the rows' acceptance to come is not known, and their ends are bounds, not known
    either). The floor lets rows ahead send drafts that cost next to nothing (an accelerator's). Worked example, room
    100, 90 and 60 tokens: the spread is 20 tokens, so each token is worth 1.0, 0.55 and 0.1.

    >>> finishing_worth([100, 90, 60]).round(2).tolist()
    [1.0, 0.55, 0.1]
    """
    room = np.asarray(room, dtype=float)
    most = max(float(room.max(initial=0.0)), 1.0)
    return FLOOR + (1.0 - FLOOR) * np.clip(1.0 - (most - room) / (SPREAD * np.sqrt(most)), 0.0, 1.0)


def choose_lengths(
    states: Sequence["RequestAcceptance"],
    chances: Sequence[np.ndarray],
    costs: PassCosts | None,
    flat: bool = False,
    worth: Sequence[float] | None = None,
) -> list[int]:
    """How many draft tokens each row of a pass sends: ``chances[r]`` holds ``P_1, P_2 ..`` for the tokens row ``r``
    has (``states[r]``: its policy state), ``costs`` the measured pass costs for ``len(states)`` rows (``None``:
    untimed, every pass costs the same); ``flat``: the pass computes each row's tokens only, unpadded; ``worth``:
    what a token of each row is worth (``None``: 1 each; :func:`finishing_worth`). See :func:`_choice` and
    :func:`_flat_choice`."""
    return (_flat_choice if flat else _choice)(states, chances, costs, worth=worth)[0]


def _usable(states: Sequence["RequestAcceptance"], chances: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each row's chances as far as they reach its least chance worth sending (none where its first does not)."""
    return [
        chance[: int(np.sum(chance >= state.min_chance)) if len(chance) and chance[0] >= state.min_chance else 0]
        for state, chance in zip(states, chances)
    ]


def _flat_choice(
    states: Sequence["RequestAcceptance"],
    chances: Sequence[np.ndarray],
    costs: PassCosts | None,
    width: int | None = None,
    probe: bool = False,
    worth: Sequence[float] | None = None,
) -> tuple[list[int], float, int | None]:
    """:func:`_choice` for a flat pass, which costs what the tokens it verifies in all cost: the ``k`` draft tokens of
    all its rows worth most (chance times the row's ``worth``; a row's chances fall along its draft, so each row sends
    its first ones), ``k`` chosen to maximise tokens per second (``width``, ``probe``: as :func:`_choice`'s, counted in
    draft tokens of the pass).
    Worked example, two rows with ``P = [0.9, 0.5]`` and ``[0.6]``, pass costs 1.0 / 1.2 / 1.4 / 2.0 for 2 / 3 / 4 /
    5 tokens: ``k = 0 .. 3`` gives ``2.0, 2.42, 2.57, 1.5`` tokens per second, so ``k = 2``: ``[1, 1]``."""
    worth = np.ones(len(states)) if worth is None else np.asarray(worth, dtype=float)
    usable = [w * chance[: state.max_draft] for state, chance, w in zip(states, _usable(states, chances), worth)]
    rows = np.concatenate([np.full(len(chance), row) for row, chance in enumerate(usable)] + [np.zeros(0, int)])
    order = np.argsort(-np.concatenate([*usable, np.zeros(0)]), kind="stable")  # (a row's own in its order)
    most = len(order) if costs is None else min(len(order), costs.explored_tokens(), len(costs.seconds()) - 1)
    picked = np.concatenate([[0.0], np.cumsum(np.concatenate([*usable, np.zeros(0)])[order])])[: most + 1]
    expected = worth.sum() + picked  # [k + 1]
    seconds = np.ones(len(expected)) if costs is None else costs.seconds()[: len(expected)]
    rates = expected / (seconds + sum(state.draft_seconds for state in states))
    best = int(np.argmax(rates))  # the first maximum: ties go to fewer tokens
    probed = None
    if width is not None:
        probed = min(width, most)
    elif probe and costs is not None:
        probed = None if (stale := costs.probe(best, expected, rates, flat=True)) == best else stale
    chosen = best if probed is None else probed
    return np.bincount(rows[order[:chosen]], minlength=len(states)).tolist(), float(rates[chosen]), probed


def _choice(
    states: Sequence["RequestAcceptance"],
    chances: Sequence[np.ndarray],
    costs: PassCosts | None,
    tree: bool = False,
    width: int | None = None,
    probe: bool = False,
    worth: Sequence[float] | None = None,
) -> tuple[list[int], float, int | None]:
    """:func:`choose_lengths`, the expected tokens per second (per unit of cost) of that choice, and the width
    chosen instead of the best: ``width`` where given, else with ``probe`` the stale width
    :meth:`PassCosts.probe` asks to measure again (``None``: the best was chosen).

    The ``R`` rows of a pass are computed equally wide, ``m + 1`` tokens with ``m`` the longest draft sent (shorter
    blocks are padded), so a pass costs what ``R * (m + 1)`` tokens cost, and yields ``R + sum of the sent tokens'
    P`` tokens (each row's weighed by its ``worth``). For a given ``m`` every row sends what it has up to ``m`` (the
    padding is computed anyway); ``m`` is chosen to maximise tokens per second. One row is the single-request case.
    Worked example, two rows with ``P = [0.9, 0.5]`` and ``[0.6]``, pass costs 1.0 / 1.3 / 2.0 for 2 / 4 / 6 tokens:
    ``m = 0, 1, 2`` gives ``2.0, 2.69, 1.98`` tokens per second, so ``m = 1``: ``[1, 1]``.
    """
    usable = _usable(states, chances)
    longest = min(max(map(len, usable), default=0), max(state.max_draft for state in states))
    if costs is not None:
        longest = min(longest, costs.explored_width(tree))
    widths = np.arange(longest + 1)  # m
    worth = np.ones(len(states)) if worth is None else np.asarray(worth, dtype=float)
    expected = sum(
        w * np.concatenate([[1.0], 1.0 + np.cumsum(c)])[np.minimum(widths, len(c))] for c, w in zip(usable, worth)
    )
    seconds = np.ones(len(widths)) if costs is None else costs.seconds(tree)[len(states) * widths]
    rates = expected / (seconds + sum(state.draft_seconds for state in states))
    best = int(np.argmax(rates))  # the first maximum: ties go to fewer tokens
    probed = None
    if width is not None:
        probed = min(width, longest)
    elif probe and costs is not None:  # (untimed, every cost is the same: nothing to measure again)
        probed = None if (stale := costs.probe(best, expected, rates)) == best else stale
    chosen = best if probed is None else probed
    return [min(chosen, len(c)) for c in usable], float(rates[chosen]), probed


def budgets(
    states: Sequence["RequestAcceptance"],
    remaining: Sequence[int],
    costs: PassCosts | None,
    probe: bool = False,
    flat: bool = False,
    worth: Sequence[float] | None = None,
) -> tuple[list[int], int | None]:
    """How many tokens to ask each row's proposer for (0: do not ask), ``remaining`` the room each row has left
    (``worth``: what a token of each row is worth, as :func:`choose_lengths` takes it), and, with ``probe``, the width
    of a stale cost to measure again this pass (``None``: none). While a row's
    drafts pay (were its draft full, from its best source so far): what it would send, plus one token whose fate
    the pass will reveal for free, when asking is cheap. When not: a one-token probe that is never sent, rationed
    to ``probe_budget`` of the row's share of a plain pass."""
    hopes = [
        np.max([state.chances(source) for source in state.acceptance or [None]], axis=0)[: max(left, 0)]
        for state, left in zip(states, remaining)
    ]
    best, _, probed = (_flat_choice if flat else _choice)(states, hopes, costs, probe=probe, worth=worth)
    share = 1.0 if costs is None else costs.seconds()[0] / len(states)
    return [state.ask(k, left, share) for state, k, left in zip(states, best, remaining)], probed


class AdaptiveDrafts:
    """The :class:`~specula.policy.protocol.DraftPolicy` of ``adaptive_draft=True``: each request's acceptance is
    its own (:class:`RequestAcceptance`, its state), what a pass costs is measured by the tokens it verifies in all,
    per number of rows (``costs(rows)``, shared per target model; ``timed=False``: the costs are a kept table or
    ``None``, and no pass is timed into them), a width whose cost is stale measured again now and then
    (:meth:`PassCosts.probe`). Where its passes are flat (:attr:`flat`, the loop's target says), each row sends the
    tokens that pay for themselves (:func:`_flat_choice`), else all rows alike (:func:`_choice`). Where the run ends
    with its last row (:attr:`draining`, the loop says: each row's tokens left), a row's tokens are worth
    :func:`finishing_worth` of them."""

    flat = False  # whether the next pass's rows are computed unpadded (a chain pass)
    draining: Sequence[int] | None = None  # while the run ends with its last row: each row's tokens left

    def __init__(self, max_draft: int, timed: bool, costs: Callable[[int], PassCosts]) -> None:
        self.max_draft, self.timed, self.costs = max_draft, timed, costs
        self.pool = RequestAcceptance(max_draft, memory=48.0, timed=False)  # every request's outcomes, for new ones
        self._probing: int | None = None  # the width this pass measures again, chosen with the budgets
        self._worth: np.ndarray | None = None  # what a token of each row is worth this pass (None: 1 each)

    def start(self, drawn: bool = False) -> RequestAcceptance:
        return RequestAcceptance(self.max_draft, timed=self.timed and not drawn, pool=self.pool, drawn=drawn)

    def budgets(self, states: Sequence[RequestAcceptance], room: Sequence[int]) -> list[int]:
        self._worth = None if self.draining is None else finishing_worth(self.draining)
        asks, self._probing = budgets(
            states, room, self.costs_for(states), probe=True, flat=self.flat, worth=self._worth
        )
        return asks

    def trim(
        self, states: Sequence[RequestAcceptance], drafts: Sequence["Draft"], draft_seconds: Sequence[float | None]
    ) -> list[list[int]]:
        """The likeliest tokens of each draft, as many as pay (or as the width measured again this pass). Of a
        chain, its first ones; of a tree, a tree (a token is never likelier than its parent). Where a row has a
        tree, the pass is costed as a tree pass (verifying a tree costs more than a chain as wide) and sent only if
        it yields more tokens per second than the first branches alone as chains."""
        for state, seconds in zip(states, draft_seconds):
            if seconds is not None:
                state.record_draft_time(seconds)
        probing, self._probing = self._probing, None
        chains = [draft.first_branch() for draft in drafts]
        picks, rate = self._pick(states, [draft.select(chain) for draft, chain in zip(drafts, chains)], False, probing)
        picks = [[chain[i] for i in pick] for chain, pick in zip(chains, picks)]  # (indices into the drafts)
        if probing is None and any(draft.is_tree for draft in drafts):
            tree_picks, tree_rate = self._pick(states, drafts, True)
            if tree_rate > rate:
                return tree_picks
        return picks

    def _pick(
        self, states: Sequence[RequestAcceptance], drafts: Sequence["Draft"], tree: bool, width: int | None = None
    ) -> tuple[list[list[int]], float]:
        chances = [state.node_chances(draft) for state, draft in zip(states, drafts)]
        orders = [np.argsort(-chance, kind="stable") for chance in chances]
        ordered, costs = [c[o] for c, o in zip(chances, orders)], self.costs_for(states)
        if self.flat and not tree:
            counts, rate, _ = _flat_choice(states, ordered, costs, width, worth=self._worth)
        else:
            counts, rate, _ = _choice(states, ordered, costs, tree, width, worth=self._worth)
        return [sorted(order[:count].tolist()) for order, count in zip(orders, counts)], rate

    def costs_for(self, states: Sequence[RequestAcceptance]) -> PassCosts | None:
        """The pass costs the decisions for these rows use (``None``: every pass taken to cost the same, as for a
        pass with a row whose drafts are drawn at random: how many it sends changes its random draws, so no
        measured time may decide it)."""
        return None if any(state.drawn for state in states) else self.costs(len(states))

    def learn(self, done: Pass) -> None:
        """The pass's time goes into the costs of its number of rows (a tree pass's where one row sent a tree; a kept
        table's check), each row's outcome into its acceptance and the pool's."""
        costs = self.costs(len(done.states)) if done.seconds is not None else None
        tree = any(draft.is_tree for draft in done.sent)
        if costs is not None and self.timed:  # (the costs decisions follow)
            costs.record(done.tokens, done.seconds, tree, done.keys)
        elif costs is not None:  # (a kept table, checked against the run)
            costs.check(done.tokens, done.seconds, tree)
        for state, draft, verified, new in zip(done.states, done.proposed, done.sent, done.new_tokens):
            for learner in (state, self.pool):
                if verified.is_tree:
                    learner.record_tree(verified, new)
                learner.record_outcome(draft, new)


class FixedDrafts:
    """The :class:`~specula.policy.protocol.DraftPolicy` of ``adaptive_draft=False``: ask for every token there is
    room for, up to ``max_draft``, send every draft whole (a tree's first ``max_draft`` tokens). It keeps no state."""

    flat, draining = False, None  # (every draft is sent whole whatever the pass)

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def start(self, drawn: bool = False) -> None:
        return None

    def budgets(self, states: Sequence[None], room: Sequence[int]) -> list[int]:
        return [min(left, self.max_draft) for left in room]

    def trim(self, states: Sequence[None], drafts: Sequence["Draft"], draft_seconds) -> list[list[int]]:
        return [list(range(min(len(draft), self.max_draft))) for draft in drafts]

    def learn(self, done: Pass) -> None:
        pass
