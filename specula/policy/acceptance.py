"""What the adaptive policy learns about one request's drafts: the chance that each draft token is accepted, per
draft source, position and sibling rank, with forgetting; and what asking its proposer costs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..core.draft import FORCED, FORCED_PRIOR

if TYPE_CHECKING:
    from ..core.draft import Draft

RANKS = 4  # sibling ranks learnt apart (a tree's first child, second, third, and the later ones together)
DEEPER = 0.95  # what a position with no record of its own is expected to do, as a share of the position before it


class RequestAcceptance:
    """Per-pass choice of how many draft tokens to verify, from measured pass costs and running acceptance.

    Args:
        max_draft: the longest draft ever sent.
        prior: acceptance assumed for a position before anything is known (optimistic, so that drafts get tried).
        memory: roughly how many recent trials of a position its acceptance estimate reflects.
        min_chance: a draft token is only sent if the chance that it and all before it are accepted is at least
            this; it stops near-hopeless tokens that would only be sent because a longer pass measured cheaper.
        probe_budget: the share of a one-token step that asking a switched-off proposer for drafts may cost.
        timed: use measured times of asking its proposer (``False``: taken as free to ask).
        drawn: its drafts are drawn at random (sampled, from a sampling drafter): how many it sends changes its
            random draws, so a seed reproduces its output only if no decision depends on timings; a pass with such a
            row takes every length to cost the same.
        pool: acceptance pooled over the requests of a run (a :class:`RequestAcceptance` the policy feeds every row's
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
        pool: "RequestAcceptance | None" = None,
        pool_weight: float = 4.0,
        drawn: bool = False,
    ) -> None:
        self.max_draft, self.drawn = max_draft, drawn
        self.pool, self.pool_weight = pool, pool_weight
        self.decay = 1.0 - 1.0 / memory
        self.min_chance = min_chance
        self.probe_budget = probe_budget
        self.timed = timed
        self.prior = prior
        self.acceptance: dict[object, tuple[np.ndarray, np.ndarray]] = {}  # per draft source: (trials, accepts)
        self.draft_seconds = 0.0  # smoothed time of one propose() call
        self.steps_since_probe = 0
        self.off_branch = (0.0, 0.0)  # tokens off their first branches that sent trees were expected to / did accept
        self.outcomes = 0  # outcomes recorded so far: what _rates was computed at
        self._known: dict[object, tuple[tuple[int, int], np.ndarray]] = {}  # source: (outcomes, pool's), its _rates

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

        Each position's acceptance is its record smoothed, with the weight of one trial, toward :data:`DEEPER` times
        the estimate of the position before it (the first toward ``prior``): a position not tried yet is expected to
        do nearly as well as the one before it. While drafts are not sent only the first position is checked
        (against the token generated anyway); were later positions pinned at ``prior``, known costs would keep a
        right proposer from ever being sent again (on some CPUs a pass over 4 tokens costs several one-token steps:
        ``docs/hardware.md``). Not quite as well: after one long draft accepted whole, each of its positions has a
        record of one trial, and at as well, a request's next draft of 64 tokens would be taken to be accepted
        whole as often as its first token is: bets that lost batches of summaries their gain (replayed:
        docs/cost-model.md). A grammar's forced tokens stay as likely all along."""
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
        tried, at later ones 2 of 10; expected 45% there, trees were sent that gained 3 tokens for the 10 expected.)
        Computed again only once an outcome was recorded here or in the pool (every row asks for it every pass);
        read-only."""
        at = (self.outcomes, -1 if self.pool is None else self.pool.outcomes)
        known = self._known.get(source)
        if known is None or known[0] != at:
            rates = self._computed_rates(source)
            rates.flags.writeable = False
            self._known[source] = known = (at, rates)
        return known[1]

    def _computed_rates(self, source: object) -> np.ndarray:
        empty = np.zeros((self.max_draft, RANKS))
        trials, accepts = self.acceptance.get(source, (empty, empty))
        if self.pool is not None:
            pooled = self.pool._rates(source)
            return (accepts + self.pool_weight * pooled) / (trials + self.pool_weight)
        first = FORCED_PRIOR if source == FORCED else self.prior  # (a grammar's forced tokens: near-certain)
        deeper = 1.0 if source == FORCED else DEEPER
        recorded = np.flatnonzero(trials.any(axis=1))
        depth = int(recorded[-1]) + 1 if len(recorded) else 1  # (deeper positions have no record: their priors)
        rates: list[list[float]] = []  # [position][rank]
        for position_accepts, position_trials in zip(accepts[:depth].tolist(), trials[:depth].tolist()):
            estimate: list[float] = []
            for rank, (accepted, tried) in enumerate(zip(position_accepts, position_trials)):
                prior = rates[-1][rank] * deeper if rates else first if rank == 0 else estimate[-1] / 2
                estimate.append((accepted + prior) / (tried + 1.0))
            rates.append(estimate)
        unrecorded = np.full((self.max_draft - depth + 1, RANKS), deeper)
        unrecorded[0] = rates[-1]
        return np.concatenate([rates, np.cumprod(unrecorded, axis=0)[1:]])  # (each the one before times deeper)

    def sibling_factor(self) -> float:
        """How far the learnt chances of tokens off a tree's first branch hold: of the trees sent, the tokens they
        accepted off their first branches over those expected (:meth:`record_tree`), smoothed with the weight of one
        expected token toward 1 (the pool's factor where pooled); at most 1. Rates per position and rank are learnt
        from every step, most of them where the first child is right; this checks them where trees are sent."""
        expected, accepted = self.off_branch
        prior, weight = (1.0, 1.0) if self.pool is None else (self.pool.sibling_factor(), self.pool_weight)
        return min(1.0, (accepted + weight * prior) / (expected + weight))

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
        trials, accepts = self._counts(draft.source)
        self.outcomes += 1
        if not len(draft):  # (nothing proposed: nothing tried)
            return
        tokens, children = draft.tokens.tolist(), draft.children()
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
