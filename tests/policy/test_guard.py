"""The cost model's backstop (:mod:`specula.policy.guard`): drafts that made fewer tokens a second than the run's plain
passes are switched off for a while, then tried again; drafts that pay never are."""

from __future__ import annotations

import time

import torch
from helpers import AlwaysWrong, hf_greedy
from tiny_models import VOCAB, tiny_model

import specula
from specula.policy import guard
from specula.policy.adaptive import AdaptiveDrafts
from specula.policy.guard import REST, WINDOW, DraftGuard
from specula.verifier.runner import CachedModel


def test_drafts_that_lose_against_plain_passes_rest_then_are_tried_again() -> None:
    """The module's worked example: 4 rows, plain passes of 0.1 s, passes with drafts of 0.2 s making 6 tokens."""
    keeper = DraftGuard()
    for _ in range(WINDOW):
        assert keeper.allows(4)
        keeper.record(4, 0.2, 6, [0.1, 0.1, 0.5])
    assert [keeper.allows(4) for _ in range(REST + 1)] == [False] * REST + [True]
    assert keeper.allows(2)  # (per number of rows)


def test_drafts_that_pay_are_never_stopped_nor_a_few_among_plain_passes() -> None:
    keeper = DraftGuard()
    for _ in range(3 * WINDOW):
        assert keeper.allows(4)
        keeper.record(4, 0.2, 9, [0.1, 0.1])  # (45 tokens a second against 40)
    for index in range(3 * WINDOW):  # (the cost model exploring: one pass in three with drafts, losing)
        assert keeper.allows(2)
        keeper.record(2, 0.2, 2, [0.1]) if index % 3 == 0 else keeper.record(2, 0.1, None, [0.1])


def test_a_draining_batch_is_judged_by_what_its_rows_tokens_are_worth() -> None:
    """4 rows, plain passes of 0.1 s (40 tokens a second); passes of 0.12 s where the row that ends the run sends
    drafts and makes 1.5 tokens and the 3 others (worth 0.1 a token) 1 each: 4.5 tokens, 37.5 a second, fewer than
    plain passes make. But weighed as the policy weighed them, 1.8 in 0.12 s (15 a second) against 1.3 in 0.1 s (13):
    the drafts go on, where raw tokens judged would rest them."""
    weighed, raw = DraftGuard(), DraftGuard()
    for _ in range(WINDOW):
        assert weighed.allows(4) and raw.allows(4)
        weighed.record(4, 0.12, 1.5 + 3 * 0.1, [0.1, 0.1], worth=1.3)
        raw.record(4, 0.12, 4.5, [0.1, 0.1])
    assert weighed.allows(4) and not raw.allows(4)


def test_the_loop_stops_drafts_that_lose_where_timings_decide(monkeypatch) -> None:
    """fp32 (timed), a policy made to send every draft whole, drafts always wrong, on a fake clock where a pass costs
    a second plus one a draft token: after a window of such passes the loop sends plain ones, answers unchanged
    (mutant: the guard not asked sends drafts in all but the plain passes scheduled for the summary)."""
    target = tiny_model("llama", seed=3)
    prompt = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8]])
    expected = hf_greedy(target, prompt, 120, eos_token_id=[])
    now = [0.0]
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits, *args, **kwargs):
        now[0] += float(max(map(len, blocks)))
        return forward_rows(self, blocks, num_logits, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(AdaptiveDrafts, "budgets", lambda self, states, room: [4] * len(states))
    monkeypatch.setattr(
        AdaptiveDrafts, "trim", lambda self, states, drafts, seconds: [list(range(len(d))) for d in drafts]
    )
    out = specula.generate(target, prompt, AlwaysWrong(expected, 4, VOCAB), max_new_tokens=120, eos_token_id=[])
    assert out.sequences.tolist() == expected.tolist()
    plain = out.stats.passes - out.stats.drafted // 4 - 1  # (passes after the prefill that sent no draft)
    assert plain >= REST and guard.REST == REST
