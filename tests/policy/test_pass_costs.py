"""Pass costs on a shared machine, with fake clocks: the adaptive policy follows a machine that gets busy and quiet
again, both ways; stalls and bursts do not switch drafts off for good; re-measuring costs a bounded share."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from specula import Draft
from specula.machine import store
from specula.machine.load import LoadMeter
from specula.policy import costs as costs_module
from specula.policy.adaptive import AdaptiveDrafts
from specula.policy.costs import (
    DOUBTING,
    EXPLORE,
    FORGET,
    RECENT,
    PassCosts,
    _kept_key,
    keep_pass_costs,
    shared_pass_costs,
)
from specula.policy.protocol import Pass

MAX_DRAFT = 32
SETTING = (torch.device("cpu"), torch.float32)
WRONG = 10_000  # the target's token where a draft token is wrong


def quiet(tokens: int, step: int) -> float:
    """A quiet machine: a pass over n tokens costs 1 + 0.1 (n - 1) one-token steps (sending ~9 pays best)."""
    return 1.0 + 0.1 * (tokens - 1)


def busy(tokens: int, step: int) -> float:
    """The same machine with another job on it: every pass 3x slower, and each extra token 15x dearer (drafts of
    0.9 acceptance no longer pay: none is best)."""
    return 3.0 * (1.0 + 1.5 * (tokens - 1))


def phases(*spans: tuple[int, object]):
    """A machine that behaves as ``spans[0][1]`` for ``spans[0][0]`` steps, then as the next, and so on."""

    def machine(tokens: int, step: int) -> float:
        for length, phase in spans:
            if step < length:
                return phase(tokens, step)
            step -= length
        return spans[-1][1](tokens, step)

    return machine


def drive(
    machine, steps: int, acceptance: float = 0.9, seed: int = 0, costs: PassCosts | None = None
) -> tuple[list[int], list[float], list[int]]:
    """One request decoded for ``steps`` steps by the adaptive policy, its passes timed by ``machine(tokens, step)``
    (a fake clock) into ``costs`` (default: new ones), each draft token right with chance ``acceptance`` after the
    ones before it. Returns the draft tokens sent, the seconds and the tokens made, per step."""
    rng = np.random.default_rng(seed)
    costs = costs or PassCosts(1, MAX_DRAFT + 2)
    policy = AdaptiveDrafts(MAX_DRAFT, timed=True, costs=lambda rows: costs)
    state = policy.start()
    sent_lengths, seconds, made = [], [], []
    for step in range(steps):
        budget = policy.budgets([state], [1000])[0]
        proposed = Draft(np.arange(1, budget + 1)) if budget else Draft.empty()
        sent = proposed.select(policy.trim([state], [proposed], [None])[0])
        draws = rng.random(budget + 1) < acceptance
        right = int(np.argmin(draws)) if not draws.all() else len(draws)  # leading right tokens of the draft
        accepted = min(right, len(sent))
        new = proposed.tokens[:accepted].tolist() + [int(proposed.tokens[accepted]) if accepted < right else WRONG]
        pass_seconds = machine(len(sent) + 1, step)
        policy.learn(Pass([state], [proposed], [sent], [new], len(sent) + 1, pass_seconds))
        sent_lengths.append(len(sent))
        seconds.append(pass_seconds)
        made.append(len(new))
    return sent_lengths, seconds, made


def test_quiet_drafts_busy_does_not_and_quiet_again_drafts_again() -> None:
    """Both ways: the widths a busy spell measured dear are measured again when it ends."""
    sent, _, _ = drive(phases((300, quiet), (300, busy), (400, quiet)), 1000)
    assert np.median(sent[150:300]) >= 6  # quiet: long drafts
    assert np.mean(np.array(sent[450:600]) == 0) >= 0.9  # busy: plain steps, but for rare re-measurements
    assert np.median(sent[800:]) >= 6  # quiet again: long drafts again
    resumed = next(step for step in range(600, 1000) if min(sent[step : step + 5]) >= 3)
    assert resumed < 600 + 3 * RECENT  # soon after the machine got quiet


def test_a_machine_busy_from_the_start_drafts_once_it_is_quiet() -> None:
    sent, _, _ = drive(phases((200, busy), (400, quiet)), 600)
    assert np.mean(np.array(sent[100:200]) == 0) >= 0.9
    assert np.median(sent[400:]) >= 6


@pytest.mark.parametrize("length", [1, 12])
def test_stalls_and_bursts_do_not_switch_drafts_off(length: int) -> None:
    """Every pass of a stall (one pass) or a burst (12 in a row) takes 40x: drafting goes on, or resumes within a
    bounded number of steps."""

    def stalling(tokens: int, step: int) -> float:
        return quiet(tokens, step) * (40.0 if 200 <= step < 200 + length else 1.0)

    sent, _, _ = drive(stalling, 600)
    after = 200 + length
    resumed = next(step for step in range(after, 600) if min(sent[step : step + 5]) >= 3)
    assert resumed < after + 3 * RECENT
    assert np.median(sent[400:]) >= 6


def test_re_measuring_costs_a_bounded_share_on_a_steady_machine() -> None:
    """On a quiet machine the policy makes at least 95% of the tokens per second of the best fixed draft length
    (re-measuring stale widths may spend EXPLORE of the time), and re-measures something now and then."""
    sent, seconds, made = drive(quiet, 3000, seed=1)
    rates = {k: sum(0.9**i for i in range(k + 1)) / quiet(k + 1, 0) for k in range(MAX_DRAFT + 1)}
    best = max(rates.values())
    assert sum(made[300:]) / sum(seconds[300:]) >= 0.95 * best
    assert len(set(sent[300:])) > 1  # (the mutant that re-measures nothing sends one width)


def test_a_pass_is_weighed_against_the_plain_passes_timed_about_when_it_was() -> None:
    """A quiet spell, then a busy one in which every pass is 3x slower: a pass over 9 tokens costs twice a plain pass
    in both, and is estimated so, not against the quiet plain passes (6x)."""
    costs = PassCosts(1, MAX_DRAFT + 2)
    for _ in range(6):
        costs.record(1, 1.0)
        costs.record(9, 2.0)
    assert costs.ratios()[8] == pytest.approx(2.0)
    costs.record(1, 3.0)
    for _ in range(6):
        costs.record(9, 6.0)
        costs.record(9, 6.0)
        costs.record(1, 3.0)
    assert costs.ratios()[8] == pytest.approx(2.0)
    assert costs.seconds()[8] == pytest.approx(6.0)  # what it costs now


def test_a_stale_width_is_sent_again_only_out_of_credit() -> None:
    costs = PassCosts(1, 10)
    costs.record(1, 1.0)
    costs.record(3, 4.0)  # a dear moment
    rates = np.array([1.0, 0.5, 0.4])  # tokens per second of sending 0, 1, 2 tokens
    expected = np.array([1.0, 1.5, 1.8])
    assert costs.probe(0, expected, rates) == 0  # not stale yet
    for _ in range(RECENT):
        costs.record(1, 1.0)
    loss = expected[2] * (1 / rates[2] - 1 / rates[0])  # in plain passes: what sending 2 tokens loses
    assert costs.credit == pytest.approx(EXPLORE * (RECENT + 1 + 4.0))
    costs.credit = loss - 1e-6
    assert costs.probe(0, expected, rates) == 0  # stale, but not affordable
    costs.credit = loss
    assert costs.probe(0, expected, rates) == 2 and costs.credit == pytest.approx(0.0)
    assert costs_module.lower_median([5.0]) == 5.0


def _measured_on(machine, steps: int = 300) -> dict[int, float]:
    """The pass costs a process that decoded ``steps`` steps on ``machine`` keeps for the next."""
    costs = PassCosts(1, MAX_DRAFT + 2)
    drive(machine, steps, costs=costs)
    return costs.table()


def test_a_process_starts_from_the_costs_an_earlier_one_kept() -> None:
    """A fresh process with the costs an earlier one measured on this quiet machine sends long drafts from its first
    steps (after one plain pass, their unit); without them it explores first (mutant: the prior ignored fails)."""
    prior = _measured_on(quiet)
    assert prior[9] == pytest.approx(quiet(9, 0) / quiet(1, 0))
    fresh, _, _ = drive(quiet, 8)
    primed, _, _ = drive(quiet, 8, costs=PassCosts(1, MAX_DRAFT + 2, prior))
    assert fresh[:3] == [0, 1, 3] and 3 < fresh[3] <= 7  # (a width is sent once one half as wide was timed)
    assert primed[0] > 0 and primed[1] == 0  # (the prior's drafts, then the plain pass they are weighed against)
    assert max(primed[:3]) >= 7 > max(fresh[:3])


def test_costs_kept_at_another_context_are_not_taken_there() -> None:
    """A prior kept after about 1,000 keys a row prices widths a run after 900 takes at once, but once a plain pass
    shows a context ten times shorter (where a wide pass costs more plain passes: attention is less of either) the run
    sends only what its own timings reach, one token after a plain pass, and probes none of the prior's widths
    (mutant: the context not looked at lets drafts of 65 tokens through)."""
    prior = {3: 1.2, 9: 1.6, 17: 2.2, 33: 3.4}
    near, far = (PassCosts(1, MAX_DRAFT + 2, prior, prior_keys=1000) for _ in range(2))
    near.record(1, 0.1, keys=900)
    far.record(1, 0.1, keys=100)
    assert near.explored_width() == 65 and far.explored_width() == 1
    even = np.ones(MAX_DRAFT + 1)  # (every width as good as sending none: the likeliest to pay of the stale ones)
    near.credit = far.credit = 100.0  # (credit enough to measure any stale width again)
    assert near.probe(0, even, even) in (2, 8, 16, 32) and far.probe(0, even, even) == 0


def test_costs_kept_from_a_busy_process_do_not_switch_drafts_off_for_good() -> None:
    """Kept from a busy spell (every width dear), the prior sends nothing at first on a quiet machine, but its widths
    are timed again out of the exploration credit and the rest forgotten as any stale estimate, and long drafts resume
    (mutant: a prior never forgotten fails)."""
    prior = _measured_on(busy)
    sent, _, _ = drive(quiet, 600, costs=PassCosts(1, MAX_DRAFT + 2, prior))
    assert sent[1:5] == [0, 0, 0, 0]
    resumed = next(step for step in range(600) if min(sent[step : step + 5]) >= 3)
    assert resumed < FORGET + 3 * RECENT
    assert np.median(sent[300:]) >= 6


def test_kept_costs_have_a_unit() -> None:
    """Ratios of passes timed without a plain pass to weigh them against are seconds: none is kept, and the prior does
    not mix with them until a plain pass is timed."""
    costs = PassCosts(2, 20, {4: 1.2, 8: 2.0})
    costs.record(6, 0.05)
    assert costs.table() == {}
    assert costs.ratios()[4] == pytest.approx(0.05) and np.isnan(costs.ratios()[2])
    costs.record(2, 0.04)
    assert costs.table() == {4: 1.2, 6: 1.25, 8: 2.0}


def test_a_primed_process_on_a_dearer_machine_times_a_plain_pass_and_cuts_its_drafts() -> None:
    """Primed by costs kept on a quiet machine, a process on a busy one sends the prior's drafts at first, then times
    a plain pass (the unit its other passes are weighed in), drops the prior its timings contradict and stops sending
    drafts that do not pay: within the exploration's cost of plain decoding (mutants: no plain pass timed while the
    prior's widths are, so drafts look free for good: 1.45x; a contradicted prior kept, each of its widths sent
    once: 1.38x)."""
    sent, seconds, made = drive(busy, 300, costs=PassCosts(1, MAX_DRAFT + 2, _measured_on(quiet)))
    assert sent[0] > 0 and 0 in sent[1:4]
    assert np.median(sent[100:]) == 0
    assert sum(seconds) / sum(made) <= 1.1 * busy(1, 0)


class _Shared:
    """A load meter that saw other programs take the CPUs."""

    def disturbed(self) -> bool:
        return True


def _kept_after(owner, seconds: dict[int, list[float]], keys: int = 1000, load=None, plain: int = 1) -> dict:
    """One process decoding in batches of 4 rows on a steady machine: plain passes of 1 s (after ``keys`` keys a row)
    around the passes over ``t`` tokens, which took ``seconds[t]``, and ``plain`` more; kept as the loop keeps at its
    end. What the next process is primed with (its prior)."""
    store.forget()
    costs = shared_pass_costs(owner, SETTING, MAX_DRAFT, rows=4)
    for tokens, taken in seconds.items():
        for each in taken:
            costs.record(4, 1.0, keys=keys)
            costs.record(tokens, each)
    for _ in range(plain):
        costs.record(4, 1.0, keys=keys)
    keep_pass_costs(owner, SETTING, MAX_DRAFT, 4, load or LoadMeter())
    store.forget()
    return shared_pass_costs(owner, SETTING, MAX_DRAFT, rows=4).prior


def test_one_run_a_burst_slowed_does_not_move_the_costs_the_next_starts_from(fresh_store) -> None:
    """Each run's figures are kept beside the last runs' and the next process starts from their lower median: a run
    whose passes of 6 tokens a burst slowed to 2.5 plain passes leaves the prior at the 1.2 the runs around it
    measured (mutant: the last run's figures replace the earlier ones fails)."""
    owner = tiny_model("llama")
    assert _kept_after(owner, {6: [1.2, 1.2], 8: [1.4, 1.4]}) == {6: 1.2, 8: 1.4}
    assert _kept_after(owner, {6: [2.5, 2.5]}) == {6: 1.2, 8: 1.4}
    assert _kept_after(owner, {6: [1.1, 1.1]}) == {6: 1.2, 8: 1.4}
    assert _kept_after(owner, {6: [1.1, 1.1]}) == {6: 1.1, 8: 1.4}  # (three runs kept: the burst's is gone)


def test_what_a_run_keeps_stands_on_passes_it_timed_on_a_machine_it_had_alone(fresh_store) -> None:
    """A width timed once (a stall may be all of it) is not kept (mutant: one pass kept fails), nor anything from a run
    while other programs took the CPUs (mutant: the load not looked at fails)."""
    owner = tiny_model("llama")
    assert _kept_after(owner, {6: [3.0], 8: [1.4, 1.4]}) == {8: 1.4}
    assert _kept_after(owner, {6: [1.2, 1.2]}, load=_Shared()) == {8: 1.4}


def test_a_process_keeps_its_own_figure_once_and_a_run_at_other_contexts_starts_anew(fresh_store) -> None:
    """A process that keeps again (a notebook's second generate) replaces its own figure, never weighs as two runs
    (mutant: appended again fails); a run after ten times fewer keys a row starts the figures anew (a wide pass costs
    other plain passes there; mutant: merged fails)."""
    owner = tiny_model("llama")
    _kept_after(owner, {6: [1.2, 1.2]})
    costs = shared_pass_costs(owner, SETTING, MAX_DRAFT, rows=4)
    for _ in range(2):
        costs.record(4, 1.0, keys=1000)
        costs.record(6, 1.6)
        costs.record(6, 1.6)
        keep_pass_costs(owner, SETTING, MAX_DRAFT, 4, LoadMeter())
    kept = store.shared().known[_kept_key(owner, 4)]
    assert kept["6"] == [1.2, 1.6]
    assert _kept_after(owner, {6: [2.0, 2.0]}, keys=100) == {6: 2.0}


def test_a_kept_width_too_dear_to_send_is_dropped_after_two_runs_that_did_not_time_it(fresh_store) -> None:
    """A figure a stall made dear is never sent, so never timed again: two runs in a row of 16 passes or more that
    did not time it drop it, and the next run explores the width as never timed (mutant: kept figures never doubted
    fails); a short run, or one that timed it, doubts nothing (mutant: every run doubts fails)."""
    owner = tiny_model("llama")
    _kept_after(owner, {6: [2.5, 2.5], 8: [1.4, 1.4]})
    assert _kept_after(owner, {8: [1.4, 1.4]}, plain=DOUBTING) == {6: 2.5, 8: 1.4}
    assert _kept_after(owner, {}, plain=DOUBTING - 5) == {6: 2.5, 8: 1.4}  # (too short to tell)
    assert _kept_after(owner, {8: [1.4, 1.4]}, plain=DOUBTING) == {8: 1.4}
    _kept_after(owner, {6: [1.2, 1.2]}, plain=DOUBTING)  # (kept again, then doubted by one run, timed by the next)
    _kept_after(owner, {8: [1.4, 1.4]}, plain=DOUBTING)
    _kept_after(owner, {6: [1.2, 1.2]}, plain=DOUBTING)
    assert _kept_after(owner, {8: [1.4, 1.4]}, plain=DOUBTING) == {6: 1.2, 8: 1.4}  # (in a row: mutant "ever" fails)
