"""How many draft tokens to send each step: the cost model behind the speculation loop.

Speculation pays when the tokens a step gains outweigh what the longer verification pass costs. Both sides are
measured while decoding, never assumed:

- **cost**: the wall time of a step that verifies ``n`` tokens (last token + ``n - 1`` drafts), smoothed per ``n``.
  It is not linear in ``n``: on a 2-core CPU in bf16 a pass over 8 tokens costs what a pass over 1 does, in fp32 a
  pass over 2 costs 1.6x and one over 5 only 1.2x; on a GPU it is flat until the matmuls fill the device.
- **acceptance**: for each draft position ``i`` the share of steps whose token ``i`` was accepted given that tokens
  ``1 .. i-1`` were, with exponential forgetting so that it follows the text (copying a passage, then writing new
  prose). Drafts that were proposed but not sent still count where the tokens generated anyway reveal whether they
  were right, so a proposer that was switched off can earn its way back.

Costs are learnt by sending, so sending is what exploration risks: a length is sent only once a pass over about
half as many tokens has been timed (``k <= 2n - 1`` draft tokens after a pass over ``n`` tokens; the first step after
the prefill is a plain one-token step, while the proposer's draft is checked for free against the token it
produces). A good proposer reaches 15-token drafts by its fifth step; an always-wrong one sent 1 draft token per
request instead of 14 (optimistic first guesses sent several long drafts), on a CPU where a pass over 5 tokens
costs 2.3x a pass over 1 and those drafts had cost it 9-12% against plain decoding (``examples/auto_off.py``).
What a pass costs is a fact of the model and the machine, not of the text, so the measured costs are remembered
per target model (and its device and dtype) and later generations start from them (:func:`shared_step_seconds`):
only the first generation with a model explores; later ones send what pays from their first step.

With ``P_i`` the chance that the first ``i`` draft tokens are all accepted, sending ``k`` tokens yields
``E(k) = 1 + P_1 + .. + P_k`` tokens for ``cost(k + 1)`` seconds plus the drafting time; each step sends the ``k``
that maximises tokens per second (Leviathan et al. 2023, Theorem 3.8, with measured costs and per-position
acceptance instead of a constant ratio and rate). ``k = 0`` sends nothing: when drafts do not pay, decoding runs
as plain one-token steps and only pays for asking the proposer, which is itself rationed (at most ~3% of a
one-token step) when the proposer is expensive. Worked example, costs ``[1.0, 1.6, 1.9, 1.4, 1.2]`` seconds for
``n = 1..5`` and ``P = [0.5, 0.3, 0.2, 0.1]``: ``E/cost`` is ``1.0, 0.94, 0.95, 1.43, 1.75`` for ``k = 0..4``, so
all 4 tokens are sent, although any shorter draft would have been slower than sending none.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import numpy as np

if TYPE_CHECKING:
    from ..core.draft import Draft

_STEP_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
RANKS = 4  # sibling ranks learnt apart (a tree's first child, second, third, and the later ones together)


def shared_step_seconds(owner: object, setting: Hashable, max_draft: int, rows: int = 1) -> np.ndarray:
    """The pass-cost table (seconds of a pass of ``rows`` rows verifying ``n`` tokens in all, padding included, at
    index ``n``) that every decision for ``owner`` (a target model) in ``setting`` (its device and dtype) shares:
    what one generation measured, the next starts from. Kept per number of rows: ``n`` tokens over one row and over ``n`` rows cost
    differently (attention reads one cache or ``n``). Forgotten with the model."""
    tables = _STEP_SECONDS.setdefault(owner, {})
    return tables.setdefault((setting, max_draft, rows), np.full(rows * (max_draft + 1) + 1, np.nan))


def _costs(table: np.ndarray, rows: int) -> np.ndarray:
    """Estimated seconds of a pass over ``rows + e`` tokens (index ``e``), from ``table`` (index: tokens); lengths
    not measured yet take the value of the nearest measured ones (interpolated), all 1.0 before any measurement."""
    tokens = np.arange(rows, len(table))
    measured = ~np.isnan(table[rows:])
    if not measured.any():
        return np.ones(len(tokens))
    return np.interp(tokens, tokens[measured], table[rows:][measured])


def _record(table: np.ndarray, tokens: int, seconds: float) -> None:
    """A pass over ``tokens`` tokens took ``seconds``: smoothed, and a one-off stall (another process, the
    allocator) counts at most 2x."""
    if tokens >= len(table):
        return
    previous = table[tokens]
    table[tokens] = seconds if np.isnan(previous) else 0.8 * previous + 0.2 * min(seconds, 2.0 * previous)


def _explored_width(table: np.ndarray, rows: int) -> int:
    """The longest draft worth the risk in a pass of ``rows`` rows: ``2w - 1`` tokens a row once a pass ``w``
    tokens wide has been timed (none before any)."""
    measured = np.flatnonzero(~np.isnan(table[rows:]))
    return 2 * (int(measured[-1]) + rows) // rows - 1 if len(measured) else 0


def choose_lengths(rows: Sequence["DraftLength"], chances: Sequence[np.ndarray], table: np.ndarray | None) -> list[int]:
    """How many draft tokens each row of a pass sends: ``chances[r]`` holds ``P_1, P_2 ..`` for the tokens row ``r``
    has, ``table`` the measured pass costs for ``len(rows)`` rows (``None``: untimed, every pass costs the same).
    See :func:`_choice`."""
    return _choice(rows, chances, table)[0]


def _choice(
    rows: Sequence["DraftLength"], chances: Sequence[np.ndarray], table: np.ndarray | None
) -> tuple[list[int], float]:
    """:func:`choose_lengths`, and the expected tokens per second (per unit of cost) of that choice.

    The ``R`` rows of a pass are computed equally wide, ``m + 1`` tokens with ``m`` the longest draft sent (shorter
    blocks are padded), so a pass costs what ``R * (m + 1)`` tokens cost, and yields ``R + sum of the sent tokens'
    P`` tokens. For a given ``m`` every row sends what it has up to ``m`` (the padding is computed anyway); ``m`` is
    chosen to maximise tokens per second. One row is the single-request case. Worked example, two rows with
    ``P = [0.9, 0.5]`` and ``[0.6]``, pass costs 1.0 / 1.3 / 2.0 for 2 / 4 / 6 tokens: ``m = 0, 1, 2`` gives
    ``2.0, 2.69, 1.98`` tokens per second, so ``m = 1``: ``[1, 1]``.
    """
    usable = [
        chance[: int(np.sum(chance >= row.min_chance)) if len(chance) and chance[0] >= row.min_chance else 0]
        for row, chance in zip(rows, chances)
    ]
    longest = min(max(map(len, usable), default=0), max(row.max_draft for row in rows))
    if table is not None:
        longest = min(longest, _explored_width(table, len(rows)))
    widths = np.arange(longest + 1)  # m
    expected = len(rows) + sum(np.concatenate([[0.0], np.cumsum(c)])[np.minimum(widths, len(c))] for c in usable)
    costs = np.ones(len(widths)) if table is None else _costs(table, len(rows))[len(rows) * widths]
    rates = expected / (costs + sum(row.draft_seconds for row in rows))
    width = int(np.argmax(rates))  # the first maximum: ties go to fewer tokens
    return [min(width, len(c)) for c in usable], float(rates[width])


def budgets(rows: Sequence["DraftLength"], remaining: Sequence[int], table: np.ndarray | None) -> list[int]:
    """How many tokens to ask each row's proposer for (0: do not ask), ``remaining`` the room each row has left.
    While a row's drafts pay (were its draft full, from its best source so far): what it would send, plus one token
    whose fate the step will reveal for free, when asking is cheap. When not: a one-token probe that is never sent,
    rationed to ``probe_budget`` of the row's share of a plain pass."""
    hopes = [
        np.max([row.chances(source) for source in row.acceptance or [None]], axis=0)[: max(left, 0)]
        for row, left in zip(rows, remaining)
    ]
    best = choose_lengths(rows, hopes, table)
    share = 1.0 if table is None else _costs(table, len(rows))[0] / len(rows)
    return [row.ask(k, left, share) for row, k, left in zip(rows, best, remaining)]


class DraftLength:
    """Per-step choice of how many draft tokens to verify, from measured step costs and running acceptance.

    Args:
        max_draft: the longest draft ever sent.
        prior: acceptance assumed for a position before anything is known (optimistic, so that drafts get tried).
        memory: roughly how many recent trials of a position its acceptance estimate reflects.
        min_chance: a draft token is only sent if the chance that it and all before it are accepted is at least
            this; it stops near-hopeless tokens that would only be sent because a longer pass measured cheaper.
        probe_budget: the share of a one-token step that asking a switched-off proposer for drafts may cost.
        timed: use measured times. Sampling passes ``False``: a seed must reproduce the output, so no decision may
            depend on timings (costs are then taken as equal for every length, proposers as free to ask).
        step_seconds: a step-cost table to start from and update (:func:`shared_step_seconds`); a fresh one if
            ``None``.
        pool: acceptance pooled over the requests of a run (a :class:`DraftLength` the policy feeds every row's
            outcomes): a position's estimate starts from the pool's, with the weight of ``pool_weight`` trials,
            instead of from ``prior``. A new request then drafts as well as the earlier ones did from its first step,
            and a few lucky trials of its own do not make long drafts look safe.
    """

    def __init__(
        self,
        max_draft: int,
        prior: float = 0.5,
        memory: float = 12.0,
        min_chance: float = 0.05,
        probe_budget: float = 0.03,
        timed: bool = True,
        step_seconds: np.ndarray | None = None,
        pool: "DraftLength | None" = None,
        pool_weight: float = 4.0,
    ) -> None:
        self.max_draft = max_draft
        self.pool, self.pool_weight = pool, pool_weight
        self.decay = 1.0 - 1.0 / memory
        self.min_chance = min_chance
        self.probe_budget = probe_budget
        self.timed = timed
        self.prior = prior
        self.acceptance: dict[object, tuple[np.ndarray, np.ndarray]] = {}  # per draft source: (trials, accepts)
        if step_seconds is None:
            step_seconds = np.full(max_draft + 2, np.nan)
        elif step_seconds.shape != (max_draft + 2,):
            raise ValueError(f"step_seconds must have {max_draft + 2} entries, got shape {step_seconds.shape}.")
        self.step_seconds = step_seconds  # index n: a step verifying n tokens
        self.draft_seconds = 0.0  # smoothed time of one propose() call
        self.steps_since_probe = 0
        self.off_branch = (0.0, 0.0)  # tokens off their first branches that sent trees were expected to / did accept

    # Estimates
    def _counts(self, source: object) -> tuple[np.ndarray, np.ndarray]:
        """(trials, accepts) per position and sibling rank (``[max_draft, RANKS]``) for drafts from ``source``,
        with forgetting; none to start."""
        if source not in self.acceptance:
            self.acceptance[source] = (np.zeros((self.max_draft, RANKS)), np.zeros((self.max_draft, RANKS)))
        return self.acceptance[source]

    def chances(self, source: object = None) -> np.ndarray:
        """``P_i``: chance that draft tokens ``1..i`` of a chain from ``source`` are all accepted, for
        ``i = 1..max_draft``.

        Each position's acceptance is its record smoothed, with the weight of one trial, toward the estimate of the
        position before it (the first toward ``prior``): a position not tried yet is expected to do as well as the
        one before it. While drafts are not sent only the first position is checked (against the token generated
        anyway); were later positions pinned at ``prior``, known costs would keep a right proposer from ever being
        sent again (on the Xeon in bf16 a pass over 4 tokens costs 2.8x one)."""
        return np.cumprod(self._rates(source)[:, 0])

    def node_chances(self, draft: "Draft", calibrated: bool = True) -> np.ndarray:
        """For each token of ``draft`` (a chain or a tree), the chance that it is accepted: its parent's, times the
        chance that its elder siblings are rejected and it is accepted (learnt per position and sibling rank), times
        the :meth:`sibling_factor` for a token that is not its parent's first child (unless not ``calibrated``).
        Of a chain, :meth:`chances`."""
        parents = draft.parent_list()
        if not parents:
            return np.empty(0)
        rates = self._rates(draft.source)  # [max_draft, RANKS]
        ranks, children = [], {}  # ranks[i]: elder siblings of token i
        for parent in parents:
            ranks.append(children.get(parent, 0))
            children[parent] = ranks[-1] + 1
        tried = rates[:, np.minimum(np.arange(max(ranks) + 1), RANKS - 1)]  # [max_draft, ranks]: rate when tried
        rejected_before = np.cumprod(np.concatenate([np.ones((len(tried), 1)), 1.0 - tried[:, :-1]], axis=1), axis=1)
        reach = (tried * rejected_before).tolist()  # [depth][rank]: elder siblings rejected, this one accepted
        factor = self.sibling_factor() if calibrated and max(ranks) else 1.0
        chance, depth = [], []
        for parent, rank in zip(parents, ranks):
            depth.append(0 if parent < 0 else depth[parent] + 1)
            reached = reach[min(depth[-1], self.max_draft - 1)][rank] * (factor if rank else 1.0)
            chance.append((1.0 if parent < 0 else chance[parent]) * reached)
        return np.array(chance)

    def _rates(self, source: object) -> np.ndarray:
        """Each position's and sibling rank's chance of acceptance given that it is tried (its parent accepted, its
        elder siblings rejected), ``[max_draft, RANKS]`` (see :meth:`chances`). Each rank's record is smoothed, with
        the weight of one trial, toward its estimate at the position before; at the first position a rank is
        expected to do half as well as the one before it. (Not toward the rank before at the same position: deep in
        a copy the first child is right 90% of the time, but when it is wrong the others rarely are. Replaying
        PromptLookup trees on code_edit, the second child at the first position was right 14% of the times it was
        tried, at later ones 2 of 10; expected 45% there, trees were sent that gained 3 tokens for the 10 expected.)"""
        empty = np.zeros((self.max_draft, RANKS))
        trials, accepts = self.acceptance.get(source, (empty, empty))
        if self.pool is not None:
            pooled = self.pool._rates(source)
            return (accepts + self.pool_weight * pooled) / (trials + self.pool_weight)
        rates: list[list[float]] = []  # [position][rank]
        for position_accepts, position_trials in zip(accepts.tolist(), trials.tolist()):
            estimate: list[float] = []
            for rank, (accepted, tried) in enumerate(zip(position_accepts, position_trials)):
                prior = rates[-1][rank] if rates else self.prior if rank == 0 else estimate[-1] / 2
                estimate.append((accepted + prior) / (tried + 1.0))
            rates.append(estimate)
        return np.array(rates)

    def sibling_factor(self) -> float:
        """How far the learnt chances of tokens off a tree's first branch hold: of the trees sent, the tokens they
        accepted off their first branches over those expected (:meth:`record_tree`), smoothed with the weight of one
        expected token toward 1 (the pool's factor where pooled); at most 1. Rates per position and rank are learnt
        from every step, most of them where the first child is right; this checks them where trees are sent."""
        expected, accepted = self.off_branch
        prior, weight = (1.0, 1.0) if self.pool is None else (self.pool.sibling_factor(), self.pool_weight)
        return min(1.0, (accepted + weight * prior) / (expected + weight))

    def _table(self) -> np.ndarray | None:
        return self.step_seconds if self.timed else None

    def costs(self) -> np.ndarray:
        """Estimated seconds of a step verifying ``n = 1 .. max_draft + 1`` tokens (see :func:`_costs`)."""
        return _costs(self.step_seconds, 1)

    def best_length(self, available: int, source: object = None) -> int:
        """The number of draft tokens (0 .. ``available``) from ``source`` that maximises expected tokens per
        second."""
        return choose_lengths([self], [self.chances(source)[: max(min(available, self.max_draft), 0)]], self._table())[0]

    def budget(self, remaining: int) -> int:
        """How many tokens to ask the proposer for, alone (see :func:`budgets`)."""
        return budgets([self], [remaining], self._table())[0]

    def ask(self, best: int, remaining: int, one_step: float) -> int:
        """How many tokens to ask for when ``best`` would be sent from a full draft and a plain pass costs this row
        ``one_step`` seconds: ``best`` + 1 if asking is cheap; else, when nothing would be sent, a rationed probe."""
        if remaining <= 0:
            return 0
        cheap = self.draft_seconds <= self.probe_budget * one_step
        if best > 0:
            self.steps_since_probe = 0
            return min(best + cheap, remaining)
        interval = 1 if cheap else math.ceil(self.draft_seconds / (self.probe_budget * one_step))
        self.steps_since_probe += 1
        if self.steps_since_probe < interval:
            return 0
        self.steps_since_probe = 0
        return 1

    # Measurements
    def record_draft_time(self, seconds: float) -> None:
        if not self.timed:
            return
        self.draft_seconds = seconds if self.draft_seconds == 0.0 else 0.8 * self.draft_seconds + 0.2 * seconds

    def record_step(self, verified: int, seconds: float) -> None:
        """A step verified ``verified`` tokens (last token + drafts) in ``seconds``."""
        if self.timed:
            _record(self.step_seconds, verified, seconds)

    def record_tree(self, sent: "Draft", new_tokens: list[int]) -> None:
        """A tree ``sent`` to the target gave ``new_tokens``: what it accepted off its first branch (the tokens it
        gained over that branch alone), against what its uncalibrated chances expected there."""
        first = set(sent.first_branch())
        chances = self.node_chances(sent, calibrated=False)
        expected = sum(chance for node, chance in enumerate(chances) if node not in first)
        accepted = sum(node not in first for node in sent.path(new_tokens[:-1]))
        self.off_branch = (self.decay * self.off_branch[0] + expected, self.decay * self.off_branch[1] + accepted)

    def record_outcome(self, draft: "Draft", new_tokens: list[int]) -> None:
        """Learn from a proposed ``draft`` (sent in full, in part or not at all) and the tokens the step produced:
        from the last verified token on, the children of the node the tokens reached were tried in their order up to
        the one the next token matches (accepted), or all of them (rejected)."""
        tokens, children = draft.tokens.tolist(), draft.children()
        trials, accepts = self._counts(draft.source)
        node = -1
        for position, token in enumerate(new_tokens[: self.max_draft]):
            kids = children[node + 1]
            hit = next((rank for rank, child in enumerate(kids) if tokens[child] == token), None)
            for rank in range(len(kids) if hit is None else hit + 1):
                at = (position, min(rank, RANKS - 1))
                trials[at] = self.decay * trials[at] + 1.0
                accepts[at] = self.decay * accepts[at] + (rank == hit)
            if hit is None:
                return
            node = kids[hit]


class DraftPolicy:
    """Draft lengths for the requests of a pass (one, or the rows of a batch): each row's acceptance is its own
    (:class:`DraftLength`), what a pass costs is measured by the tokens it verifies in all, per number of rows and
    apart for passes with trees, and shared per target model (``tables(rows, tree)``; not consulted when untimed). The loop talks to it through
    :meth:`budgets`, :meth:`trim` and :meth:`learn`; :class:`FixedDrafts` is the same interface sending every draft
    as proposed."""

    def __init__(self, max_draft: int, timed: bool, tables: Callable[[int, bool], np.ndarray]) -> None:
        self.max_draft, self.timed, self.tables = max_draft, timed, tables
        self.pool = DraftLength(max_draft, memory=48.0, timed=False)  # every request's outcomes, for new ones

    def new_row(self) -> DraftLength:
        return DraftLength(self.max_draft, timed=self.timed, pool=self.pool)

    def budgets(self, lengths: Sequence[DraftLength], remaining: Sequence[int]) -> list[int]:
        """How many tokens to ask each row's proposer for, with ``remaining`` tokens of room per row."""
        return budgets(lengths, remaining, self._table(len(lengths), False))

    def trim(self, lengths: Sequence[DraftLength], drafts: Sequence["Draft"]) -> list[list[int]]:
        """Which tokens of each row's draft this pass verifies (indices, ascending): the likeliest, as many as pay.
        Of a chain, its first ones; of a tree, a tree (a token is never likelier than its parent). Where a row has a
        tree, the pass is costed as a tree pass (its own table: verifying a tree costs more than a chain as wide)
        and sent only if it yields more tokens per second than the first branches alone as chains."""
        chains = [draft.first_branch() for draft in drafts]
        picks, rate = self._pick(lengths, [draft.select(chain) for draft, chain in zip(drafts, chains)], tree=False)
        picks = [[chain[i] for i in pick] for chain, pick in zip(chains, picks)]  # (indices into the drafts)
        if any(draft.is_tree for draft in drafts):
            tree_picks, tree_rate = self._pick(lengths, drafts, tree=True)
            if tree_rate > rate:
                return tree_picks
        return picks

    def _pick(self, lengths: Sequence[DraftLength], drafts: Sequence["Draft"], tree: bool) -> tuple[list[list[int]], float]:
        chances = [row.node_chances(draft) for row, draft in zip(lengths, drafts)]
        orders = [np.argsort(-chance, kind="stable") for chance in chances]
        counts, rate = _choice(lengths, [c[o] for c, o in zip(chances, orders)], self._table(len(lengths), tree))
        return [sorted(order[:count].tolist()) for order, count in zip(orders, counts)], rate

    def _table(self, rows: int, tree: bool) -> np.ndarray | None:
        """The pass costs the decisions use (``None`` untimed); a tree pass's where measured, else a chain's."""
        if not self.timed:
            return None
        chain = self.tables(rows, False)
        return np.where(np.isnan(trees := self.tables(rows, True)), chain, trees) if tree else chain

    def learn(
        self, lengths: Sequence[DraftLength], drafts: Sequence["Draft"], sent: Sequence["Draft"],
        new_tokens: Sequence[list[int]], tokens: int, seconds: float | None,
    ) -> None:
        """A pass over ``tokens`` tokens in all (its rows padded to the widest) took ``seconds`` (``None``: not a
        measure of what such a pass costs) and gave each row ``new_tokens[r]`` for its proposed ``drafts[r]``, of
        which it verified ``sent[r]`` (timed as a tree pass where one is a tree)."""
        if self.timed and seconds is not None:
            _record(self.tables(len(lengths), any(draft.is_tree for draft in sent)), tokens, seconds)
        for row, draft, verified, new in zip(lengths, drafts, sent, new_tokens):
            for learner in (row, self.pool):
                if verified.is_tree:
                    learner.record_tree(verified, new)
                learner.record_outcome(draft, new)


class FixedDrafts:
    """The :class:`DraftPolicy` interface for ``adaptive_draft=False``: ask for every token there is room for, send
    every draft whole (a tree's first ``max_draft`` tokens)."""

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def new_row(self) -> None:
        return None

    def budgets(self, lengths: Sequence[None], remaining: Sequence[int]) -> list[int]:
        return list(remaining)

    def trim(self, lengths: Sequence[None], drafts: Sequence["Draft"]) -> list[list[int]]:
        return [list(range(min(len(draft), self.max_draft))) for draft in drafts]

    def learn(self, *args, **kwargs) -> None:
        pass
