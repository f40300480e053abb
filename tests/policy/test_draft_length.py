"""The cost model: draft lengths follow measured step costs and running acceptance; drafts that never pay stop."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch
from helpers import AlwaysWrong, NoisyModelDrafter, Oracle, hf_greedy
from tiny_models import VOCAB, tiny_model

import specula
from specula import Draft
from specula.decoding.loop import MAX_DRAFT
from specula.hf.inputs import left_padded
from specula.machine import store
from specula.policy.acceptance import DEEPER, RANKS, RequestAcceptance
from specula.policy.adaptive import FLOOR, AdaptiveDrafts, FixedDrafts, budgets, choose_lengths, finishing_worth
from specula.policy.costs import KEPT, PassCosts, shared_pass_costs
from specula.policy.protocol import Pass

PROMPT = [1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8]


@functools.cache
def model(name: str = "llama") -> torch.nn.Module:
    return tiny_model(name)


@functools.cache
def reference(name: str, new_tokens: int) -> torch.Tensor:
    return hf_greedy(model(name), torch.tensor([PROMPT]), new_tokens, eos_token_id=[])


class Decisions:
    """One request's acceptance (its :class:`RequestAcceptance`, whose attributes it shows) with a one-row pass-cost
    table of its own: what the adaptive policy decides for it alone."""

    def __init__(self, max_draft: int, table: PassCosts | None = None, **kwargs) -> None:
        self.state = RequestAcceptance(max_draft, **kwargs)
        self.table = PassCosts(1, max_draft + 2) if table is None else table

    def __getattr__(self, name: str):
        return getattr(self.state, name)

    def record_pass(self, verified: int, seconds: float) -> None:
        if self.state.timed:
            self.table.record(verified, seconds)

    def costs(self) -> np.ndarray:
        return self.table.seconds()

    def best_length(self, available: int, source: object = None) -> int:
        chances = self.state.chances(source)[: max(min(available, self.state.max_draft), 0)]
        return choose_lengths([self.state], [chances], self.table if self.state.timed else None)[0]

    def budget(self, remaining: int) -> int:
        return budgets([self.state], [remaining], self.table if self.state.timed else None)[0][0]


def lengths_with(step_costs: list[float], chances: list[float]) -> Decisions:
    """A request's decisions with these measured costs (n = 1, 2, ...) and acceptance chances P_i."""
    lengths = Decisions(len(chances), memory=1e9)
    for verified, seconds in enumerate(step_costs, start=1):
        lengths.record_pass(verified, seconds)
    conditional = np.array(chances) / np.concatenate([[1.0], chances[:-1]])
    lengths.acceptance[None] = chain_record(len(chances), conditional)
    return lengths


def chain_record(positions: int, rates) -> tuple[np.ndarray, np.ndarray]:
    """(trials, accepts) of a million chain drafts accepted at these rates per position (first children only)."""
    trials, accepts = np.zeros((positions, RANKS)), np.zeros((positions, RANKS))
    trials[:, 0], accepts[:, 0] = 1e6, np.asarray(rates) * 1e6
    return trials, accepts


def test_the_worked_example_of_the_docstring() -> None:
    lengths = lengths_with([1.0, 1.6, 1.9, 1.4, 1.2], [0.5, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(lengths.chances(), [0.5, 0.3, 0.2, 0.1], rtol=1e-5)
    assert lengths.best_length(4) == 4  # 1.75 tokens per unit of time
    assert lengths.best_length(3) == 3  # 1.43
    assert lengths.best_length(2) == 0  # one or two tokens would be slower than none: 0.94, 0.95 < 1.0


def test_flat_costs_send_every_token_worth_a_chance_and_no_more() -> None:
    lengths = lengths_with([1.0] * 6, [0.9, 0.8, 0.5, 0.2, 0.04])
    assert lengths.best_length(5) == 4  # the fifth token's chance is under min_chance
    assert lengths_with([1.0] * 6, [0.01] * 5).best_length(5) == 0


def test_costs_not_measured_are_interpolated_or_extrapolated_and_one_off_stalls_are_ignored() -> None:
    lengths = Decisions(8)
    np.testing.assert_allclose(lengths.costs(), 1.0)  # nothing known: every length looks alike
    lengths.record_pass(1, 0.1)
    lengths.record_pass(5, 0.2)
    np.testing.assert_allclose(lengths.costs()[:7], [0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25])  # (never free)
    lengths.record_pass(1, 10.0)  # a stall: the lower median of the last plain passes ignores it
    np.testing.assert_allclose(lengths.costs()[:7], [0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25])
    lengths.record_pass(5, 9.0)
    lengths.record_pass(5, 0.22)
    assert lengths.costs()[4] == pytest.approx(0.22)  # the median of 0.2, 9.0 and 0.22


def test_lengths_are_explored_by_doubling_the_longest_timed_pass() -> None:
    lengths = Decisions(16)
    lengths.acceptance[None] = chain_record(16, 0.99)  # drafts that are nearly always right
    assert lengths.best_length(16) == 0  # no pass timed yet: a plain step first
    for verified, expected in ((1, 1), (2, 3), (4, 7), (8, 15)):
        lengths.record_pass(verified, 1.0)
        assert lengths.best_length(16) == expected
    assert Decisions(16, timed=False).best_length(16) > 0  # sampling never times, so it never waits for timings


def test_acceptance_is_learnt_per_position_from_sent_and_unsent_tokens() -> None:
    lengths = RequestAcceptance(4, memory=1e9)
    prior = 0.5 * DEEPER ** np.arange(4)  # (each position expected to do DEEPER times as well as the one before)
    np.testing.assert_allclose(lengths.chances("s"), np.cumprod(prior))  # before any evidence
    lengths.record_outcome(Draft([5, 6, 7, 8], source="s"), [5, 6, 9])  # 1, 2 accepted, 3 rejected, 4 not tried
    trials, accepts = lengths.acceptance["s"]
    np.testing.assert_allclose(trials[:, 0], [1, 1, 1, 0])
    np.testing.assert_allclose(accepts[:, 0], [1, 1, 0, 0])
    rates = [0.75]
    for accepted, tried in ((1, 1), (0, 1), (0, 0)):  # each smoothed toward DEEPER times the one before
        rates.append((accepted + DEEPER * rates[-1]) / (tried + 1))
    np.testing.assert_allclose(lengths.chances("s"), np.cumprod(rates))
    lengths.record_outcome(Draft([5, 6], source="s"), [4])  # not sent: the token made anyway shows it was wrong
    np.testing.assert_allclose(lengths.acceptance["s"][0][:, 0], [2, 1, 1, 0])
    assert "other" not in lengths.acceptance and lengths.chances("other")[0] == 0.5  # sources are kept apart


def test_positions_not_tried_are_expected_to_do_nearly_as_well_as_the_one_before() -> None:
    lengths = Decisions(8, memory=1e9)
    for _ in range(20):  # not sent: only the first token of each draft is checked, and it is always right
        lengths.record_outcome(Draft([5, 6, 7], source="s"), [5])
    first = 20.5 / 21
    rates = first * DEEPER ** np.arange(8)
    np.testing.assert_allclose(lengths.chances("s"), np.cumprod(rates))  # so with costs known, long drafts pay
    for verified, seconds in ((1, 1.0), (2, 1.9), (4, 2.8), (8, 3.2)):
        lengths.record_pass(verified, seconds)
    assert lengths.best_length(8, "s") >= 7
    for _ in range(20):  # always wrong: nothing is worth sending
        lengths.record_outcome(Draft([5, 6, 7], source="wrong"), [4])
    assert lengths.chances("wrong")[0] < 0.05 and lengths.best_length(8, "wrong") == 0


def test_one_long_draft_accepted_whole_does_not_make_the_next_as_likely_whole_as_its_first_token() -> None:
    """A draft of 32 tokens accepted whole gives each position a record of one trial: the next draft's last token is
    expected far less often than its first (mutant: DEEPER = 1 takes the record at its word, and a long draft's whole
    run is then taken to be as likely as its first token; sent, such drafts lost batches their gain)."""
    lengths = RequestAcceptance(32, memory=1e9)
    lengths.record_outcome(Draft(list(range(3, 35)), source="s"), list(range(3, 36)))
    chances = lengths.chances("s")
    assert chances[0] == 0.75 and chances[31] < 0.5 * chances[0]


def test_a_switched_off_expensive_proposer_is_asked_rarely() -> None:
    lengths = lengths_with([1.0, 1.0], [0.01])
    lengths.record_draft_time(0.3)  # asking costs 30% of a step: at most one ask in 10 steps keeps it to 3%
    budgets = [lengths.budget(100) for _ in range(40)]
    assert budgets.count(1) == 4 and set(budgets) == {0, 1}
    cheap = lengths_with([1.0, 1.0], [0.01])
    cheap.record_draft_time(0.001)
    assert [cheap.budget(100) for _ in range(5)] == [1] * 5  # a cheap one is probed every step


def test_a_paying_draft_asks_one_token_more_than_it_sends() -> None:
    lengths = lengths_with([1.0] * 8, [0.9, 0.8, 0.7, 0.6, 0.5, 0.01, 0.001])
    assert lengths.best_length(7) == 5 and lengths.budget(100) == 6 and lengths.budget(3) == 3


def test_an_always_wrong_proposer_stops_being_sent() -> None:
    runs = {}
    for new_tokens in (100, 300):
        ref = reference("llama", new_tokens)
        out = specula.generate(
            model(), torch.tensor([PROMPT]), AlwaysWrong(ref, 8, VOCAB), max_new_tokens=new_tokens, eos_token_id=[]
        )
        assert out.sequences.tolist() == ref.tolist()
        runs[new_tokens] = out.stats
    # Exploration sends at most one draft token per step, and only while the prior still outweighs the evidence
    # (the first dozen steps): a few tokens in all, however long the output.
    assert runs[100].drafted < 20 and runs[300].drafted < 20
    assert runs[300].passes == 300


def test_drafting_resumes_when_the_proposer_becomes_right(drafts_cost_nothing) -> None:
    """(On the fake clock of drafts_cost_nothing: what the passes took on the CI machine does not hold drafts back.)"""
    ref = reference("llama", 200)
    switch = len(PROMPT) + 60

    class WrongThenRight(AlwaysWrong):
        def propose(self, context_ids, max_tokens):
            if len(context_ids) < switch:
                return super().propose(context_ids, max_tokens)
            return Oracle.propose(self, context_ids, max_tokens)

    out = specula.generate(
        model(), torch.tensor([PROMPT]), WrongThenRight(ref, 8, VOCAB), max_new_tokens=200, eos_token_id=[]
    )
    assert out.sequences.tolist() == ref.tolist()
    assert out.stats.passes < 60 + 140 / 3  # the last 140 tokens took few steps


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_adaptive_lengths_keep_greedy_output_identical(name: str) -> None:
    prompt = torch.tensor([PROMPT + PROMPT[:9]])
    expected = hf_greedy(model(name), prompt, 80, eos_token_id=[])
    for proposer in (specula.PromptLookup(), specula.NGramPredictor(min_count=1), Oracle(expected, 12)):
        out = specula.generate(model(name), prompt, proposer, max_new_tokens=80, eos_token_id=[])
        assert out.sequences.tolist() == expected.tolist(), repr(proposer)


def test_sampling_decisions_ignore_timings_so_a_seed_reproduces_the_output() -> None:
    untimed = RequestAcceptance(4, timed=False)
    untimed.record_draft_time(5.0)
    assert untimed.draft_seconds == 0.0
    runs, target = [], model()  # (built before the seed: how much of torch's RNG building a model takes may vary)
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(
            specula.generate(
                target,
                torch.tensor([PROMPT * 2]),
                specula.PromptLookup(),
                max_new_tokens=60,
                do_sample=True,
                temperature=1.5,
            ).sequences.tolist()
        )
    assert runs[0] == runs[1]


def test_step_costs_are_shared_per_model_and_setting() -> None:
    owner, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    table = shared_pass_costs(owner, ("cpu", torch.float32), 16)
    assert table is shared_pass_costs(owner, ("cpu", torch.float32), 16)
    assert table is not shared_pass_costs(owner, ("cpu", torch.bfloat16), 16)
    assert table is not shared_pass_costs(other, ("cpu", torch.float32), 16)
    first = Decisions(16, table=table)
    first.acceptance[None] = chain_record(16, 0.99)
    assert first.best_length(16) == 0  # nothing timed: a plain step first
    for verified in (1, 2, 4, 8):
        first.record_pass(verified, 1.0)
    later = Decisions(16, table=table)  # the next generation with the same model
    later.acceptance[None] = first.acceptance[None]
    np.testing.assert_allclose(later.costs(), first.costs())
    assert later.best_length(16) == 15  # no exploration again


def test_generate_reuses_the_costs_it_measured_with_the_same_model(monkeypatch, drafts_cost_nothing) -> None:
    """(On the fake clock of drafts_cost_nothing: the first run's timings say the oracle's drafts pay, whatever the
    CI machine's load.)"""
    target = tiny_model("llama", seed=3)
    tables = []
    loop = importlib.import_module("specula.decoding.loop")

    def recording(*args, **kwargs):
        tables.append(shared_pass_costs(*args, **kwargs))
        return tables[-1]

    monkeypatch.setattr(loop, "shared_pass_costs", recording)
    prompt = torch.tensor([PROMPT])
    expected = hf_greedy(target, prompt, 12, eos_token_id=[])
    runs, first = [], []  # tables asked for; the tokens of each run's first pass
    for _ in range(2):
        before = tables[0].passes if tables else 0
        out = specula.generate(target, prompt, Oracle(expected, 8), max_new_tokens=12, eos_token_id=[])
        assert torch.equal(out.sequences, expected)
        runs.append(len(tables))
        first += [
            tokens
            for (tokens, _), samples in tables[0].samples.items()
            if any(number == before + 1 for number, _ in samples)
        ]
    assert runs[0] > 0 and all(table is tables[0] for table in tables) and tables[0].samples
    assert first[0] == 1 and first[1] > 1  # the first run explores from a plain pass, the second does not again
    decided = []  # the pass costs each decision weighed (None: every length taken to cost the same)
    weigh = AdaptiveDrafts.costs_for
    monkeypatch.setattr(
        AdaptiveDrafts, "costs_for", lambda self, states: decided.append(weigh(self, states)) or decided[-1]
    )
    specula.generate(target, prompt, specula.PromptLookup(), max_new_tokens=4, do_sample=True)
    assert decided and all(costs is tables[0] for costs in decided)  # sampling with drafts not drawn at random
    decided.clear()  # decides by timings too
    specula.generate(target, prompt, NoisyModelDrafter(target, 2), max_new_tokens=4, do_sample=True)
    assert decided and not any(decided)  # drafts drawn at random: their lengths change the draws, so untimed


def test_a_new_process_starts_from_the_costs_a_run_kept(drafts_cost_nothing) -> None:
    """What a process's runs measured is kept with the calibrations, each width timed twice or more: a new process
    (the model's profile empty, the file read again) starts from it, with widths it may send before timing any pass,
    where a fresh start has none (mutant: nothing kept fails). (On the fake clock of drafts_cost_nothing: on a busy
    machine's clock the runs may send too few drafts to time any width twice.)"""
    target = tiny_model("llama", seed=3)
    prompt = torch.tensor([PROMPT])
    expected = hf_greedy(target, prompt, 12, eos_token_id=[])
    for _ in range(2):
        first = specula.generate(target, prompt, Oracle(expected, 8), max_new_tokens=12, eos_token_id=[])
    costs = shared_pass_costs(target, (target.device, target.dtype), MAX_DRAFT)
    measured = {tokens: ratio for tokens, ratio in costs.table().items() if len(costs.samples[tokens, False]) >= 2}
    store.forget()  # a new process
    primed = shared_pass_costs(target, (target.device, target.dtype), MAX_DRAFT)
    assert measured and primed.prior == measured
    assert len(PROMPT) <= primed.prior_keys <= len(PROMPT) + 12  # (the context it was measured at, kept with it)
    assert primed.explored_width() > 0 == PassCosts(1, primed.size).explored_width()
    second = specula.generate(target, prompt, Oracle(expected, 8), max_new_tokens=12, eos_token_id=[])
    assert torch.equal(first.sequences, expected) and torch.equal(second.sequences, expected)


def batch_table(rows: int, costs: dict[int, float], tree: bool = False, chains: PassCosts | None = None) -> PassCosts:
    """Pass costs for ``rows`` rows with ``costs[n]`` seconds for a pass over ``n`` tokens in all (with ``tree``:
    for tree passes, recorded after ``chains``'s)."""
    table = chains or PassCosts(rows, rows * 17 + 1)
    for tokens, seconds in costs.items():
        table.record(tokens, seconds, tree)
    return table


def test_the_batch_decision_of_the_docstring() -> None:
    rows = [lengths_with([1.0], [0.9, 0.5]), lengths_with([1.0], [0.6])]
    table = batch_table(2, {2: 1.0, 4: 1.3, 6: 2.0})
    assert choose_lengths(rows, [rows[0].chances()[:2], rows[1].chances()[:1]], table) == [1, 1]


def test_a_batch_pads_its_rows_to_the_widest_and_sends_none_where_passes_cost_by_the_token() -> None:
    sure, unsure = lengths_with([1.0], [0.95, 0.9, 0.85]), lengths_with([1.0], [0.3, 0.1, 0.05])
    hopeless = lengths_with([1.0], [0.01])
    flat = batch_table(2, {n: 1.0 for n in range(2, 9)})  # extra tokens are free: send all that have a chance
    assert choose_lengths([sure, unsure], [sure.chances()[:3], unsure.chances()[:3]], flat) == [3, 3]
    assert choose_lengths([sure, hopeless], [sure.chances()[:3], hopeless.chances()[:1]], flat) == [3, 0]
    step = batch_table(2, {2: 1.0, 4: 1.0, 6: 1.1, 8: 3.0})  # two tokens a row nearly free, then dear
    # the unsure row's second token would not pay alone, but its row is computed that wide anyway
    assert choose_lengths([sure, unsure], [sure.chances()[:3], unsure.chances()[:3]], step) == [2, 2]
    linear = batch_table(2, {n: n / 2 for n in range(2, 9)})  # each token costs as much as a row's pass
    assert choose_lengths([sure, unsure], [sure.chances()[:3], unsure.chances()[:3]], linear) == [0, 0]
    assert budgets([sure, unsure], [10, 10], linear)[0] == [1, 1]  # not sent, but probed while asking is cheap


def test_the_flat_decision_of_the_docstring() -> None:
    rows = [lengths_with([1.0], [0.9, 0.5]), lengths_with([1.0], [0.6])]
    table = batch_table(2, {2: 1.0, 3: 1.2, 4: 1.4, 5: 2.0})
    chances = [rows[0].chances()[:2], rows[1].chances()[:1]]
    assert choose_lengths(rows, chances, table, flat=True) == [1, 1]


def test_a_flat_pass_sends_the_rows_whose_drafts_pay_and_no_padding() -> None:
    """Eight rows, one with a sure draft: padded, its tokens would make every row as wide, which does not pay; flat,
    a pass costs the tokens it verifies in all, so that row sends its draft alone (mutant: flat passes costed as
    padded ones)."""
    sure, unsure = lengths_with([1.0], [0.95, 0.9, 0.85]), lengths_with([1.0], [0.2, 0.04])
    rows, chances = [sure] + [unsure] * 7, [sure.chances()[:3]] + [unsure.chances()[:2]] * 7
    table = batch_table(8, {tokens: 1.0 + 0.08 * (tokens - 8) for tokens in range(8, 33)})  # a token: 8% of a pass
    assert choose_lengths(rows, chances, table) == [0] * 8  # (every row 2 wide: 10.35 tokens for 1.64; plain 8 for 1)
    assert choose_lengths(rows, chances, table, flat=True) == [3] + [0] * 7  # 10.70 tokens for 1.24
    assert budgets(rows, [10] * 8, table, flat=True)[0][0] == 4  # (what it sends, and one more to learn from)


def test_a_draining_batch_sends_the_drafts_of_the_rows_furthest_from_their_end() -> None:
    """Four rows with equally good drafts, a draft token costing a tenth of a plain pass: each row's drafts pay while
    requests wait for the slots. Once none waits, the run ends with its last row: rows with 100 tokens of room left
    still send theirs, rows that will end long before them do not (worth 0.1 a token), flat; padded, every row sends
    what the widest pass verifies anyway (mutant: the worth ignored)."""
    rows = [lengths_with([1.0], [0.6, 0.5]) for _ in range(4)]
    chances = [row.chances()[:2] for row in rows]
    table = batch_table(4, {tokens: 1.0 + 0.1 * (tokens - 4) for tokens in range(4, 16)})
    worth = finishing_worth([100, 100, 60, 20])
    assert worth.tolist() == [1.0, 1.0, FLOOR, FLOOR]
    assert choose_lengths(rows, chances, table, flat=True) == [2, 2, 2, 2]
    assert choose_lengths(rows, chances, table, flat=True, worth=worth) == [2, 2, 0, 0]
    assert choose_lengths(rows, chances, table, worth=worth) == [2, 2, 2, 2]
    policy = AdaptiveDrafts(2, timed=True, costs=lambda count: table)
    policy.flat, policy.draining = True, [100, 100, 60, 20]
    states = [policy.start() for _ in rows]
    for state, row in zip(states, rows):
        state.acceptance = row.state.acceptance
    asks = policy.budgets(states, [100, 100, 60, 20])
    assert asks[2:] == [1, 1] and min(asks[:2]) >= 2  # (the rows ahead: a probe, never sent)


def test_untimed_passes_send_drafts_by_acceptance_alone() -> None:
    """Where no pass cost weighs (a batch with a row whose drafts are drawn at random, or pass costs unknown for its
    rows): each row asks for and sends what its acceptance gives a chance, nothing measured again."""
    policy = AdaptiveDrafts(8, timed=False, costs=lambda rows: None)
    states = [policy.start(), policy.start(drawn=True)]
    asks = policy.budgets(states, [10, 10])
    assert asks == [4, 4]  # (the prior: 3 tokens above min_chance, and one more to learn from)
    drafts = [Draft(list(range(3, 8))), Draft([3, 4])]
    assert [len(pick) for pick in policy.trim(states, drafts, [0.0, 0.0])] == [3, 2]


def test_a_batch_pass_is_timed_at_its_padded_size(monkeypatch, drafts_cost_nothing) -> None:
    """(Passes cost alike, on a fake clock: the first row's drafts are sent whatever the machine's load.)"""
    target = tiny_model("llama", seed=5)
    tables = {}
    loop = importlib.import_module("specula.decoding.loop")

    def recording(*args):
        tables[args[-1]] = shared_pass_costs(*args)  # (the loop passes the number of rows last)
        return tables[args[-1]]

    monkeypatch.setattr(loop, "shared_pass_costs", recording)
    generator = torch.Generator().manual_seed(0)
    rows = [
        torch.tensor(PROMPT),
        torch.randint(3, VOCAB, (13,), generator=generator),
        torch.randint(3, VOCAB, (18,), generator=generator),
    ]
    first = hf_greedy(target, rows[0][None], 24, eos_token_id=[])
    ids, mask = left_padded(rows, 0)

    class FirstRowOnly(Oracle):  # right for the first row, wrong for the others: rows send drafts of other lengths
        def propose(self, context_ids, max_tokens):
            reference, start = self.references[0], len(context_ids)
            draft = reference[start : start + min(self.num_draft, max_tokens)]
            return specula.Draft(draft if np.array_equal(reference[:start], context_ids) else (draft + 1) % VOCAB)

    out = specula.generate(target, ids, FirstRowOnly(first, 6), attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert out.stats.rows[0].accepted > 6 and max(row.accepted for row in out.stats.rows[1:]) < 4
    measured = [tokens for tokens, _ in tables[3].samples]
    assert len(measured) > 1 and all(tokens % 3 == 0 for tokens in measured)  # every row as wide as the widest


def test_a_tree_is_learnt_per_position_and_sibling_rank() -> None:
    lengths = RequestAcceptance(4, memory=1e9)
    tree = Draft([3, 1, 4, 5], source="s", parents=[-1, -1, 0, 1])  # 3 -> 4 or 1 -> 5
    lengths.record_outcome(tree, [1, 5, 9])  # the second child, then its child
    trials, accepts = lengths.acceptance["s"]
    np.testing.assert_allclose(trials[:2, :2], [[1, 1], [1, 0]])
    np.testing.assert_allclose(accepts[:2, :2], [[0, 1], [1, 0]])
    lengths.record_outcome(tree, [7])  # both first tokens tried, both wrong
    np.testing.assert_allclose(lengths.acceptance["s"][0][0, :2], [2, 2])


def test_a_trees_likeliest_tokens_are_sent() -> None:
    lengths = RequestAcceptance(4, memory=1e9)
    trials, accepts = chain_record(4, [0.5, 0.9, 0.9, 0.9])
    trials[0, 1], accepts[0, 1] = 1e6, 0.6e6  # a second first token is right 60% of the times the first is wrong
    lengths.acceptance["s"] = (trials, accepts)
    tree = Draft([3, 1, 4, 5, 6], source="s", parents=[-1, -1, 0, 1, 2])  # 3 -> 4 -> 6, 1 -> 5
    np.testing.assert_allclose(lengths.node_chances(tree), [0.5, 0.3, 0.45, 0.27, 0.405], rtol=1e-4)
    np.testing.assert_allclose(lengths.node_chances(tree.chain()), lengths.chances("s")[:3])
    costs = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 3.0}  # up to four draft tokens are free
    policy = AdaptiveDrafts(4, timed=True, costs=lambda rows: batch_table(rows, costs))
    assert policy.trim([lengths], [tree], [None]) == [[0, 1, 2, 4]]  # the likeliest four: 3 -> 4 -> 6, and 1


def test_a_tree_is_sent_only_where_it_beats_its_first_branch() -> None:
    lengths = RequestAcceptance(4, memory=1e9)
    trials, accepts = chain_record(4, [0.5, 0.9, 0.9, 0.9])
    trials[0, 1], accepts[0, 1] = 1e6, 0.6e6
    lengths.acceptance["s"] = (trials, accepts)
    tree = Draft([3, 1, 4, 5, 6], source="s", parents=[-1, -1, 0, 1, 2])  # first branch: 3 -> 4 -> 6
    chain_costs = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 3.0}
    for tree_costs, expected in (
        ({}, [0, 1, 2, 4]),  # not measured yet: as a chain's
        ({5: 1.05}, [0, 1, 2, 4]),  # a little dearer: 2.53 tokens a unit against 2.36
        ({2: 2.0, 3: 2.0, 4: 2.0, 5: 2.0}, [0, 2, 4]),
    ):  # twice as dear: the first branch
        costs = batch_table(1, tree_costs, tree=True, chains=batch_table(1, chain_costs))
        policy = AdaptiveDrafts(4, timed=True, costs=lambda rows: costs)
        assert policy.trim([lengths], [tree], [None]) == [expected], tree_costs


def test_trees_that_gain_less_than_their_chances_say_stop_being_sent() -> None:
    lengths = RequestAcceptance(4, memory=1e9)
    trials, accepts = chain_record(4, [0.5, 0.9, 0.9, 0.9])
    trials[0, 1], accepts[0, 1] = 1e6, 0.6e6  # the second first token: 60% when the first is wrong, say the rates
    lengths.acceptance["s"] = (trials, accepts)
    tree = Draft([3, 1, 4, 5, 6], source="s", parents=[-1, -1, 0, 1, 2])  # first branch: 3 -> 4 -> 6
    costs = batch_table(
        1, {5: 1.05}, tree=True, chains=batch_table(1, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 3.0})
    )
    policy = AdaptiveDrafts(4, timed=True, costs=lambda rows: costs)
    assert policy.trim([lengths], [tree], [None]) == [[0, 1, 2, 4]] and lengths.sibling_factor() == 1.0
    sent = tree.select([0, 1, 2, 4])
    for _ in range(10):  # sent ten times, the first branch right and the 1 (expected: 0.3) never
        policy.learn(Pass([lengths], [tree], [sent], [[3, 4, 6, 9]], 5, 1.05))  # (timed as measured)
    assert lengths.sibling_factor() == pytest.approx(1 / 4, rel=1e-4)  # no token off the first branch for 3 expected
    np.testing.assert_allclose(lengths.node_chances(sent)[1], 0.3 * lengths.sibling_factor(), rtol=0.05)
    assert policy.trim([lengths], [tree], [None]) == [[0, 2, 4]]  # the first branch alone now


def test_sampling_sends_no_drafts_where_passes_cost_more_than_they_gain() -> None:
    """Sampling with drafts not drawn at random is timed as greedy decoding is: where a pass over more than one
    token costs ten times a one-token pass, it sends nothing (never slower than plain sampling), and the seeded
    tokens are model.generate's either way. (The mutant that leaves sampling untimed sends drafts here.)"""
    target = tiny_model("llama", seed=4)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(6.0)  # (peaked: drafts of its own samples get accepted)
    prompt = torch.tensor([[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    torch.manual_seed(0)
    expected = target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        max_new_tokens=24,
        eos_token_id=[],
        pad_token_id=0,
        temperature=0.7,
    )
    table = shared_pass_costs(target, (target.device, target.dtype), MAX_DRAFT)
    for tokens in range(1, 10):  # (the passes drafts of 8 make, each timed just now: none stale)
        table.record(tokens, 1.0 if tokens == 1 else 10.0)
    torch.manual_seed(0)
    out = specula.generate(
        target, prompt, Oracle(expected, 8), do_sample=True, max_new_tokens=24, eos_token_id=[], temperature=0.7
    )
    assert out.stats.drafted == 0 and torch.equal(out.sequences, expected)
    store.forget()  # nothing measured yet (nor kept): the passes it times show that the drafts pay
    store.shared().drop(KEPT)
    torch.manual_seed(0)
    out = specula.generate(
        target, prompt, Oracle(expected, 8), do_sample=True, max_new_tokens=24, eos_token_id=[], temperature=0.7
    )
    assert out.stats.accepted > 0 and torch.equal(out.sequences, expected)


def test_fixed_drafts_ask_for_the_room_up_to_the_longest_draft() -> None:
    """adaptive_draft=False asks a proposer without a limit of its own (PromptLookup) for no more than it sends."""
    assert FixedDrafts(8).budgets([None, None, None], [100, 3, 0]) == [8, 3, 0]


def test_a_plain_pass_leaves_the_policy_alone() -> None:
    """A pass that asks no proposer (plain decoding, a due plain pass) sizes nothing: the policy is not consulted,
    and each row verifies nothing but its last token (host work per row and pass: what a GPU's batches wait on)."""

    class Untouchable(FixedDrafts):
        def budgets(self, states, room):
            raise AssertionError("a plain pass asked the policy for budgets")

        def trim(self, states, drafts, draft_seconds):
            raise AssertionError("a plain pass asked the policy to trim")

    from specula.decoding.loop import propose

    proposed, sent = propose(Untouchable(MAX_DRAFT), None, [object()] * 3, VOCAB, True, True, asks=False)
    assert [len(draft) for draft in proposed + sent] == [0] * 6
