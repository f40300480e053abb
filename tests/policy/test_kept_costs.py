"""Ordinary verification in bf16: draft lengths follow pass costs measured once per machine and kept (never slower
than plain where passes are dear), not the clock (the same output on every run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bf16_cases import NEW_TOKENS, model, prompt
from helpers import Oracle

import specula
from specula import Draft
from specula.decoding import estimate
from specula.machine import store, timing
from specula.policy import kept_costs
from specula.policy.acceptance import RequestAcceptance
from specula.policy.adaptive import AdaptiveDrafts, choose_lengths
from specula.policy.protocol import Pass
from specula.verifier import gqa
from specula.verifier.runner import CachedModel


@pytest.fixture
def kept(fresh_store, monkeypatch, tmp_path):
    """Kept tables come from ``table[0]`` (ratios by :data:`kept_costs.WIDTHS`); counts the measurements."""
    table, measured = [None], []
    monkeypatch.setattr(kept_costs, "_measure", lambda m, rows=1, compiled=None: measured.append(m) or table[0])
    yield table, measured
    store.forget()


@pytest.fixture
def steady(monkeypatch):
    """Nothing else the run decides follows its own timings: the table is not checked against the run's passes (a
    tiny model's passes on a loaded machine do not cost what a table of ``1.0`` says; the check has its fake-clock
    tests below), and attention takes transformers' way (another, chosen by timing, rounds otherwise: the output may
    leave the reference's, and the oracle then drafts nothing)."""
    monkeypatch.setattr(kept_costs, "UNDERPRICED", float("inf"))
    monkeypatch.setattr(gqa, "_way", lambda *args: "repeated")


def test_dear_passes_send_no_drafts_and_cheap_ones_do(kept, steady) -> None:
    table, measured = kept
    reference = model("llama").generate(
        prompt(), attention_mask=prompt() * 0 + 1, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[]
    )
    table[0] = [1.0] + [10.0] * (len(kept_costs.WIDTHS) - 1)  # every pass over several tokens costs 10 steps
    dear = specula.generate(
        model("llama"), prompt(), Oracle(reference, 8), max_new_tokens=NEW_TOKENS, eos_token_id=[], exact=False
    )
    assert dear.stats.drafted == 0 and len(measured) == 1
    store.forget()
    table[0] = [1.0] * len(kept_costs.WIDTHS)  # as cheap as one token (another machine, another file)
    store.shared().known.clear()
    cheap = specula.generate(
        model("llama"), prompt(), Oracle(reference, 8), max_new_tokens=NEW_TOKENS, eos_token_id=[], exact=False
    )
    assert cheap.stats.accepted > NEW_TOKENS // 2 and len(measured) == 2


def test_the_table_is_kept_so_every_run_decides_alike(kept) -> None:
    table, measured = kept
    table[0] = [1.0, 1.3, 1.6, 2.0, 2.8, 4.0, 7.0]
    runs = [
        specula.generate(
            model("qwen2"), prompt(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS, eos_token_id=[], exact=False
        )
        for _ in range(2)
    ]
    store.forget()  # as a new process: from the file
    runs.append(
        specula.generate(
            model("qwen2"), prompt(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS, eos_token_id=[], exact=False
        )
    )
    assert len(measured) == 1
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist() == runs[2].sequences.tolist()
    assert [run.stats.drafted for run in runs] == [runs[0].stats.drafted] * 3


def test_the_measurement_times_each_width_against_a_one_token_pass(fresh_store, monkeypatch, tmp_path) -> None:
    """On a fake clock where a pass over n tokens costs 1 + (n - 1) / 4, the kept ratios are exactly that."""
    now = [0.0]
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits, *args, **kwargs):
        now[0] += 1.0 + (len(blocks[0]) - 1) / 4
        return forward_rows(self, blocks, num_logits, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    monkeypatch.setattr(timing, "CLOCK", lambda: now[0])
    costs = kept_costs.kept_pass_costs(model("llama"), 32)
    assert costs.ratios()[[w - 1 for w in kept_costs.WIDTHS]].tolist() == [1 + (w - 1) / 4 for w in kept_costs.WIDTHS]
    costs.record(2, 100.0)  # nothing is recorded into a kept table
    assert costs.ratios()[1] == 1.25
    store.forget()


def test_no_draft_is_longer_than_the_widest_pass_kept(kept) -> None:
    """Passes wider than the kept table's widest (33 tokens) were never timed, and are never sent: were a wider one
    taken to cost what the widest measured does, a long prediction would send 64 drafts where 65 tokens cost twice."""
    table, _ = kept
    table[0] = [1.0] * len(kept_costs.WIDTHS)  # every measured width as cheap as one token
    costs = kept_costs.kept_pass_costs(model("llama"), 64)
    nearly_sure = np.cumprod(np.full(64, 0.995))  # P_i of 64 drafts, each right 99.5% of the times
    assert choose_lengths([RequestAcceptance(64, timed=False)], [nearly_sure], costs) == [kept_costs.WIDTHS[-1] - 1]


def test_batches_send_drafts_where_their_kept_wide_passes_are_cheap_and_none_where_dear(kept, steady) -> None:
    """Ordinary bf16 batches size their drafts from kept tables of passes of as many rows (three rows between the
    two-row and the four-row tables): where a pass over several tokens a row costs ten one-token passes, none are sent;
    where it
    costs what one does, the rows send what they have."""
    table, measured = kept
    model_ = model("llama")
    prompts = [prompt()[0, :length] for length in (300, 200, 120)]
    references = [
        model_.generate(
            p[None],
            attention_mask=torch.ones_like(p[None]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            pad_token_id=0,
        )
        for p in prompts
    ]

    def drafted() -> int:
        decoder = specula.Decoder(model_, Oracle(references, 8), slots=3, exact=False)
        rows = [
            row
            for row, _ in decoder.run([specula.Job(p.numpy(), NEW_TOKENS, key=k) for k, p in enumerate(prompts)])
            if row.finished
        ]
        assert len(rows) == 3
        return sum(row.stats.drafted for row in rows)

    table[0] = [1.0] + [10.0] * (len(kept_costs.WIDTHS) - 1)
    assert drafted() == 0 and len(measured) == 3  # (the one-row, two-row and four-row tables, measured once each)
    store.forget()
    store.shared().known.clear()
    table[0] = [1.0] * len(kept_costs.WIDTHS)
    assert drafted() > NEW_TOKENS


def test_a_batch_table_times_its_rows_against_a_one_token_pass_of_as_many(fresh_store, monkeypatch, tmp_path) -> None:
    """On a fake clock where a pass costs 1 + (its tokens beyond one a row) / 8, the four-row table holds exactly
    that, up to 17 tokens a row; five rows interpolate between the four-row and eight-row tables."""
    now = [0.0]
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits, *args, **kwargs):
        now[0] += 1.0 + (len(blocks[0]) - 1) * len(blocks) / 8
        return forward_rows(self, blocks, num_logits, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    monkeypatch.setattr(timing, "CLOCK", lambda: now[0])
    costs = kept_costs.kept_pass_costs(model("llama"), 32, rows=5)
    widths = kept_costs.widths(4)
    assert widths[-1] == 17 and costs.explored_width() == 16
    assert costs.ratios()[[5 * w - 5 for w in widths]].tolist() == pytest.approx([1 + (w - 1) * 5 / 8 for w in widths])
    store.forget()


def test_the_speedup_over_plain_decoding_is_priced_by_plain_passes_timed_in_the_run(kept, monkeypatch) -> None:
    """Ordinary bf16, untimed: whatever the kept table says, a plain pass is priced at the mean of the run's own
    plain passes (the loop sends one after PLAIN_FIRST passes with drafts, then every PLAIN_EVERY: counted in passes,
    so the answer is the same on every run), and plain decoding of the request takes one such pass a token after its
    prefill."""
    table, _ = kept
    table[0] = [1 + (width - 1) / 8 for width in kept_costs.WIDTHS]
    monkeypatch.setattr(estimate, "PLAIN_FIRST", 2)  # (a short request)
    model_ = model("llama")
    reference = model_.generate(
        prompt(),
        attention_mask=torch.ones_like(prompt()),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        pad_token_id=0,
    )
    decoder = specula.Decoder(model_, Oracle(reference, 8), exact=False).prepare()
    steps = []  # (tokens the pass computed, its seconds)
    learn = decoder.policy.learn
    decoder.policy.learn = lambda step: steps.append((step.tokens, step.seconds)) or learn(step)
    list(decoder.run([specula.Job(prompt()[0].numpy(), NEW_TOKENS)]))
    plain, cost = decoder.plain_comparison()
    widths = [tokens for tokens, _ in steps]
    assert widths[0] > 1 and widths[estimate.PLAIN_FIRST] == 1  # (drafts pay from the first pass: the plain one is due)
    price = np.mean([seconds for tokens, seconds in steps if tokens == 1 and seconds is not None])
    assert plain == pytest.approx(decoder.prefill_seconds + (NEW_TOKENS - 1) * price)
    assert cost == pytest.approx(decoder.prefill_seconds + decoder.pass_seconds)
    assert decoder.plain_speedup() == pytest.approx(plain / cost)


@pytest.mark.parametrize("rows, widest", [(1, 32), (3, 16), (8, 16)])
def test_a_gpu_like_profile_sends_the_widest_drafts_measured(kept, rows, widest) -> None:
    """Wide passes at the price of one (an accelerator far from full), exactness dear (ordinary bf16): one row and
    batches send every draft token that is nearly sure, up to the widest pass their tables measured."""
    table, _ = kept
    table[0] = [1.0] * len(kept_costs.WIDTHS)
    costs = kept_costs.kept_pass_costs(model("llama"), 64, rows=rows)
    nearly_sure = np.cumprod(np.full(64, 0.995))
    states = [RequestAcceptance(64, timed=False) for _ in range(rows)]
    assert choose_lengths(states, [nearly_sure] * rows, costs) == [widest] * rows


def _table(cost, rows: int = 1, max_draft: int = 32) -> kept_costs.KeptCosts:
    """A kept table of ``cost(tokens)`` (in plain passes) at the measured widths, as :func:`kept_pass_costs` builds it
    (not kept in a store)."""
    table = kept_costs.KeptCosts(rows, rows * (max_draft + 1) + 1, kept_costs.WIDTHS[-1])
    for width in kept_costs.WIDTHS:
        table.record(rows * width, cost(width) / cost(1))
    return table


def _decide(
    machine, costs: kept_costs.KeptCosts, passes: int = 300, noise: float = 0.0, slow=lambda number: 1.0
) -> list[int]:
    """The draft tokens each pass of one request sends (each right with chance 0.9 after the ones before it, the same
    draws whatever the clock), ordinary bf16 (untimed: a kept table, checked against the run), a plain pass
    scheduled as the loop schedules them; pass ``number`` over n tokens takes ``machine(n) * slow(number)`` seconds
    times ``1 + noise * u``, ``u`` uniform in [-1, 1]."""
    draws, clock = np.random.default_rng(0), np.random.default_rng(1)
    policy = AdaptiveDrafts(32, timed=False, costs=lambda rows: costs)
    state, sent_lengths, since, plain = policy.start(), [], 0, False
    for number in range(passes):
        due = since >= (estimate.PLAIN_EVERY if plain else estimate.PLAIN_FIRST)
        budget = 0 if due else policy.budgets([state], [1000])[0]
        proposed = Draft(np.arange(1, budget + 1)) if budget else Draft.empty()
        sent = proposed.select(policy.trim([state], [proposed], [None])[0])
        draw = draws.random(33) < 0.9
        right = int(np.argmin(draw)) if not draw.all() else 33  # (leading right tokens of the draft)
        accepted = min(right, len(sent))
        new = proposed.tokens[:accepted].tolist() + [
            int(proposed.tokens[accepted]) if accepted < min(right, budget) else 10_000
        ]
        seconds = machine(len(sent) + 1) * slow(number) * (1 + noise * clock.uniform(-1, 1))
        policy.learn(Pass([state], [proposed], [sent], [new], len(sent) + 1, seconds))
        sent_lengths.append(len(sent))
        since, plain = (0, True) if not len(sent) else (since + 1, plain)
    return sent_lengths


def cheap(tokens: int) -> float:
    return 1.0 + 0.1 * (tokens - 1)


def dear(tokens: int) -> float:
    return 1.0 + 1.0 * (tokens - 1)  # (at 0.9 acceptance no draft pays)


def test_a_table_that_underprices_the_runs_passes_is_corrected_and_drafts_are_cut_back() -> None:
    """A kept table of a cheap machine met by a run whose passes cost several times more: once enough passes of a
    width were timed, that width and wider are priced dearer, and the drafts stop (mutant: the table trusted for
    good sends long drafts to the end)."""
    sent = _decide(dear, _table(cheap))
    assert max(sent[:10]) >= 7  # (the table says long drafts pay)
    assert np.median(sent[150:]) == 0


def test_noise_in_the_runs_timings_changes_no_decision() -> None:
    """Passes that cost what the table says, timed with +-30% noise: the same decisions as on an exact clock (mutant:
    the table corrected by the run's raw timings, UNDERPRICED = 1, changes them)."""
    exact = _decide(cheap, _table(cheap))
    assert _decide(cheap, _table(cheap), noise=0.3) == exact
    assert np.median(exact) >= 7


def test_a_slow_spell_between_plain_passes_changes_no_decision() -> None:
    """Passes that cost what the table says, but twice that for 16 passes in every 100 (another program's burst),
    none of them a plain pass: the same decisions as on a quiet machine, as a table is corrected only where a width
    costs more in several spans between plain passes in a row (mutant: its last passes' ratio to the plain passes
    nearest them decides, and the spell's passes are all of them)."""
    quiet = _decide(cheap, _table(cheap))
    spells = _decide(cheap, _table(cheap), slow=lambda number: 2.0 if 15 <= number % 100 < 31 else 1.0)
    assert spells == quiet and np.median(quiet) >= 7


def test_a_correction_is_kept_for_later_runs(kept) -> None:
    """What a run found is kept with the table: the next process prices those widths as the run measured them."""
    table, _ = kept
    table[0] = [cheap(width) for width in kept_costs.WIDTHS]
    costs = kept_costs.kept_pass_costs(model("llama"), 32)
    _decide(dear, costs, passes=150)
    store.forget()  # (a new process, reading the file)
    later = kept_costs.kept_pass_costs(model("llama"), 32)
    assert later.seconds()[8] == pytest.approx(costs.seconds()[8], rel=1e-3) and later.seconds()[8] > 3 * cheap(9)
    assert _decide(dear, later, passes=40)[5:] == [0] * 35


def test_a_correction_scales_what_narrower_passes_cost_beyond_a_plain_one() -> None:
    """correct()'s worked example: 9 tokens 5 times dearer than the table's 2.0, so 5 tokens (1.5) cost 5.5, a plain
    pass still 1.0, 17 tokens 5 times the table."""
    costs = kept_costs.KeptCosts(1, 34, 33)
    for tokens, ratio in ((1, 1.0), (5, 1.5), (9, 2.0), (17, 3.0)):
        costs.record(tokens, ratio)
    costs.correct(9, 5.0)
    assert costs.seconds()[[0, 4, 8, 16]] == pytest.approx([1.0, 5.5, 10.0, 15.0])
