"""Batches: several requests verified in one pass, each row keeping the drafts it accepts, each row's tokens exactly
model.generate's on that row alone (fp32)."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import AlwaysWrong, NoisyModelDrafter, Oracle, chi_square_p_value, hf_greedy
from tiny_models import VOCAB, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import specula
from specula.decoding import estimate
from specula.policy.adaptive import AdaptiveDrafts
from specula.policy.guard import DraftGuard
from specula.verifier.runner import RaggedRows

NEW_TOKENS = 24
PAD = 0  # the tiny models' pad_token_id
# gpt2: absolute positions; mistral: every layer a sliding window; gemma3: sliding-window and full layers (windows
# of 12 and 8 tokens, shorter than the prompts)
BATCHED = ["gemma3", "gpt2", "gpt_neox", "llama", "mistral", "qwen2"]


def prompts() -> list[torch.Tensor]:
    """Rows of different lengths: two repetitive (PromptLookup finds drafts), two not."""
    generator = torch.Generator().manual_seed(3)
    words = torch.randint(3, VOCAB, (12,), generator=generator)
    repetitive = torch.cat([words[:6], words[:6], words[:6], words[2:5]])
    return [
        repetitive,
        torch.randint(3, VOCAB, (9,), generator=generator),
        repetitive[3:],
        torch.randint(3, VOCAB, (30,), generator=generator),
    ]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :], mask[b, width - len(row) :] = row, 1
    return ids, mask


@functools.cache
def model(name: str) -> torch.nn.Module:
    return tiny_model(name)


def alone(name: str, row: torch.Tensor, **kwargs) -> list[int]:
    """The new tokens model.generate makes for this row alone."""
    return hf_greedy(model(name), row[None], NEW_TOKENS, **kwargs)[0, len(row) :].tolist()


def new_tokens(out: specula.GenerateOutput, width: int) -> list[list[int]]:
    """Each row's new tokens, padding after its end dropped."""
    return [row[width : width + stats.new_tokens] for row, stats in zip(out.sequences.tolist(), out.stats.rows)]


@pytest.mark.parametrize("name", BATCHED)
@pytest.mark.parametrize("proposer", ["prompt-lookup", "ngram", "oracle", "always-wrong", "none"])
def test_each_row_is_its_own_model_generate(name: str, proposer: str) -> None:
    rows = prompts()
    expected = [alone(name, row, eos_token_id=[]) for row in rows]
    references = [torch.tensor(row.tolist() + out) for row, out in zip(rows, expected)]
    proposers = {
        "prompt-lookup": specula.PromptLookup(),
        "ngram": specula.NGramPredictor(),
        "none": None,
        "oracle": Oracle(references, 5),
        "always-wrong": AlwaysWrong(references, 5, VOCAB),
    }
    ids, mask = left_padded(rows)
    out = specula.generate(
        model(name),
        ids,
        proposers[proposer],
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        adaptive_draft=False,
    )
    assert new_tokens(out, ids.shape[1]) == expected
    assert out.sequences[:, : ids.shape[1]].tolist() == ids.tolist()
    assert len(out.stats.rows) == len(rows) and out.stats.new_tokens == NEW_TOKENS * len(rows)
    if proposer == "oracle":  # every row accepted drafts, each its own
        assert all(row.accepted > NEW_TOKENS // 2 for row in out.stats.rows)
        assert out.stats.passes < NEW_TOKENS // 2
    if proposer == "always-wrong":
        assert out.stats.accepted == 0 and out.stats.drafted > 0


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_rows_stop_on_their_own_eos_inside_accepted_blocks(name: str) -> None:
    """EOS is a token row 0 makes early: rows end where model.generate alone ends them, padded after, while the
    others go on; the oracle makes EOS arrive inside an accepted block."""
    rows = prompts()
    eos = alone(name, rows[0], eos_token_id=[])[5]
    expected = [alone(name, row, eos_token_id=eos) for row in rows]
    assert len(expected[0]) <= 6 and max(map(len, expected)) > len(expected[0])
    references = [torch.tensor(row.tolist() + out) for row, out in zip(rows, expected)]
    ids, mask = left_padded(rows)
    out = specula.generate(
        model(name),
        ids,
        Oracle(references, 8),
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        adaptive_draft=False,
    )
    assert new_tokens(out, ids.shape[1]) == expected
    width = ids.shape[1] + max(map(len, expected))
    assert out.sequences.shape == (len(rows), width)
    for row, tokens in zip(out.sequences.tolist(), expected):
        assert row[ids.shape[1] + len(tokens) :] == [PAD] * (width - ids.shape[1] - len(tokens))


class StopOnToken(StoppingCriteria):
    """Ends a row once it made ``token``, as a stop string would."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] == self.token


def test_stopping_criteria_end_rows_on_their_own(monkeypatch) -> None:
    """Row 1 of 4 ends first, on its stopping criterion: every row makes model.generate's tokens, and row 3 takes
    row 1's slot, so only its cache moves, not row 2's and row 3's (mutant: the rows after the slot shifted down,
    [0, 2, 3])."""
    rows = prompts()
    stop = alone("llama", rows[1], eos_token_id=[])[3]
    criteria = StoppingCriteriaList([StopOnToken(stop)])
    expected = [alone("llama", row, eos_token_id=[], stopping_criteria=criteria) for row in rows]
    assert len(expected[1]) == 4 and max(map(len, expected)) == NEW_TOKENS
    orders = []
    select_rows = RaggedRows.select_rows
    monkeypatch.setattr(RaggedRows, "select_rows", lambda self, order: orders.append(order) or select_rows(self, order))
    ids, mask = left_padded(rows)
    out = specula.generate(
        model("llama"),
        ids,
        specula.PromptLookup(),
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        stopping_criteria=criteria,
    )
    assert new_tokens(out, ids.shape[1]) == expected and orders[0] == [0, 3, 2]


def test_a_streamer_takes_one_row() -> None:
    from transformers.generation.streamers import BaseStreamer

    ids, mask = left_padded(prompts()[:2])
    with pytest.raises(ValueError, match="streamer takes one sequence"):
        specula.generate(model("llama"), ids, attention_mask=mask, max_new_tokens=4, streamer=BaseStreamer())


class FailsOnRow(specula.Proposer):
    """Drafts nothing, but fails on the context of one prompt."""

    def __init__(self, bad_prompt: torch.Tensor) -> None:
        self.bad = bad_prompt.tolist()

    def propose(self, context_ids, max_tokens):
        if context_ids[: len(self.bad)].tolist() == self.bad:
            raise KeyError("no table for this context")
        return specula.Draft([])


def test_a_proposer_failing_for_one_row_is_named() -> None:
    rows = prompts()
    ids, mask = left_padded(rows)
    with pytest.raises(RuntimeError, match=r"failed for request 1 of the batch: 'no table"):
        specula.generate(model("llama"), ids, FailsOnRow(rows[1]), attention_mask=mask, max_new_tokens=4)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_seeded_request_samples_the_same_alone_and_in_any_batch() -> None:
    rows = prompts()
    settings = dict(do_sample=True, temperature=1.5, max_new_tokens=16, eos_token_id=[])
    alone_out = (
        specula.generate(model("llama"), rows[0][None], specula.PromptLookup(), generator=seeded(5), **settings)
        .sequences[0, len(rows[0]) :]
        .tolist()
    )
    outputs = []
    for members, seeds in (([0, 1], [5, 7]), ([2, 0, 3], [9, 5, 11])):
        ids, mask = left_padded([rows[i] for i in members])
        out = specula.generate(
            model("llama"),
            ids,
            specula.PromptLookup(),
            attention_mask=mask,
            generator=[seeded(s) for s in seeds],
            **settings,
        )
        outputs.append(new_tokens(out, ids.shape[1])[members.index(0)])
    assert outputs[0] == outputs[1] == alone_out
    with pytest.raises(ValueError, match="one per row"):
        specula.generate(model("llama"), ids, attention_mask=mask, generator=[seeded(1)], **settings)


class GreedyGuess(specula.Proposer):
    """Drafts, for each prompt, the target's likeliest next token: accepted with probability p(token)."""

    def __init__(self, guesses: dict[tuple, int]) -> None:
        self.guesses = guesses

    def propose(self, context_ids, max_tokens):
        guess = self.guesses.get(tuple(context_ids.tolist()))
        return specula.Draft([] if guess is None else [guess])


@functools.cache
def sharp() -> torch.nn.Module:
    """The tiny Llama with its logits scaled up: peaked distributions that differ from row to row (the random
    model's own are nearly flat, which no test of distributions could tell apart)."""
    sharpened = tiny_model("llama")
    with torch.no_grad():
        sharpened.lm_head.weight.mul_(40.0)
    return sharpened


@pytest.mark.distribution
def test_sampling_in_a_batch_keeps_each_rows_distribution() -> None:
    """Chi-square per row: the second new token of each row of a mixed batch (different lengths; verified against a
    draft that the rejection rule accepts or rejects) follows that row's own sum over t1 of p(t1) p(t2|t1)."""
    rows = prompts()[:3]
    expected, guesses = [], {}
    with torch.no_grad():
        for row in rows:
            first = torch.softmax(sharp()(row[None]).logits[0, -1].double(), -1)
            contexts = torch.cat([row.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [VOCAB, len + 1]
            second = torch.softmax(sharp()(contexts).logits[:, -1].double(), -1)  # [t1, t2]
            expected.append(dict(enumerate((first[:, None] * second).sum(0).tolist())))
            guesses.update({tuple(context.tolist()): int(second[t1].argmax()) for t1, context in enumerate(contexts)})
    ids, mask = left_padded(rows)
    counts = [dict() for _ in rows]
    generator, drafted = seeded(0), 0
    for _ in range(500):
        out = specula.generate(
            sharp(),
            ids,
            GreedyGuess(guesses),
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=3,
            eos_token_id=[],
            generator=generator,
            adaptive_draft=False,
        )
        drafted += sum(row.accepted_per_position[:1] == [1] or row.drafted > 0 for row in out.stats.rows)
        for b, token in enumerate(out.sequences[:, ids.shape[1] + 1].tolist()):
            counts[b][token] = counts[b].get(token, 0) + 1
    assert drafted == 500 * len(rows)  # every row's second token was verified against a draft
    for b in range(len(rows)):
        assert chi_square_p_value(counts[b], expected[b]) > 0.001, b


def test_the_decoder_estimates_its_speedup_over_plain_decoding(monkeypatch, drafts_cost_nothing) -> None:
    """From the plain passes it timed: well above 1 with drafts that are always right (and always sent: the fake
    clock of drafts_cost_nothing, so that the passes the run takes do not follow the CI machine's load)."""
    monkeypatch.setattr(estimate, "PLAIN_FIRST", 2)  # (short requests)
    rows = prompts()
    expected = [alone("llama", row, eos_token_id=[]) for row in rows]
    references = [torch.tensor(row.tolist() + out) for row, out in zip(rows, expected)]
    jobs = [specula.Job(row.numpy(), NEW_TOKENS, key=b) for b, row in enumerate(rows)]
    decoder = specula.Decoder(model("llama"), Oracle(references, 6), slots=2)
    outputs = {row.job.key: row.sequence.ids[len(row.job.prompt) :].tolist() for row, _ in decoder.run(jobs)}
    assert [outputs[b] for b in range(len(rows))] == expected  # (two slots for four requests: continuous)
    assert decoder.plain_speedup() is not None and 2 in decoder.estimate.plain  # (a plain pass of two rows was timed)
    # Were every pass to cost a second whatever its rows and tokens, the estimate would be plain decoding's passes
    # (a token a row a pass, two rows at a time) over the passes the run took.
    timed_plain_passes(decoder, {2: [(1.0, 0)]})
    decoder.prefill_seconds, decoder.pass_seconds = 0.0, float(decoder.passes - len(rows))
    plain_passes = sum(len(out) - 1 for out in expected) / 2
    assert decoder.plain_speedup() == pytest.approx(plain_passes / (decoder.passes - len(rows)))
    assert decoder.plain_speedup() > 3
    sampled = specula.Decoder(model("llama"), Oracle(references, 6), slots=2)
    list(
        sampled.run(
            [
                specula.Job(row.numpy(), 8, sampling=specula.Sampling(do_sample=True), key=b)
                for b, row in enumerate(rows)
            ]
        )
    )
    assert sampled.plain_speedup() is not None  # (under sampling too)


def test_no_estimate_where_other_programs_took_the_cpus_meanwhile(monkeypatch, drafts_cost_nothing) -> None:
    """A run during which other programs took the CPUs estimates nothing (its plain passes priced the load of their
    moments), and says why; a quiet one does (mutant: estimated whatever the load)."""
    from specula.machine import load

    monkeypatch.setattr(estimate, "PLAIN_FIRST", 2)  # (short requests)
    rows = prompts()
    expected = [alone("llama", row, eos_token_id=[]) for row in rows]
    references = [torch.tensor(row.tolist() + out) for row, out in zip(rows, expected)]
    for busy in (True, False):
        monkeypatch.setattr(load.LoadMeter, "disturbed", lambda self, busy=busy: busy)
        decoder = specula.Decoder(model("llama"), Oracle(references, 6), slots=2)
        list(decoder.run([specula.Job(row.numpy(), NEW_TOKENS, key=b) for b, row in enumerate(rows)]))
        assert decoder.disturbed is busy and (decoder.plain_speedup() is None) is busy


def timed_plain_passes(decoder: specula.Decoder, passes: dict[int, list[tuple[float, int]]]) -> None:
    """The run's plain passes, by rows: (seconds, tokens the longest row held)."""
    decoder.estimate.plain, decoder.estimate.plain_keys = {}, {}
    for rows, timed in passes.items():
        for seconds, keys in timed:
            decoder.estimate.record(rows, 1, seconds, keys)


def test_the_estimate_replays_plain_decoding_of_the_same_requests() -> None:
    """Known stats: requests needing 4, 1, 4 and 2 passes after their prefills, two slots. Plain decoding takes
    passes of 2 rows (4|1, then 3|4 ... ) and a last one of 1 row; a pass of 2 rows is priced at 2 s (the mean of
    the run's plain passes of 2 rows, all after about as many tokens), of 1 row at 1 s. Where under half of those
    passes are priced by plain passes of their own rows, there is no estimate."""
    decoder = specula.Decoder(model("llama"), None, slots=2)
    decoder.estimate.needs = {0: (4, 10), 1: (1, 12), 2: (4, 9), 3: (2, 10)}
    passes = estimate.plain_passes(list(decoder.estimate.needs.values()), 2)
    assert {rows: sum(n for (r, _), n in passes.items() if r == rows) for rows, _ in passes} == {2: 5, 1: 1}
    timed_plain_passes(decoder, {1: [(1.0, 10), (0.5, 11), (1.5, 12)], 2: [(2.0, 10), (3.5, 11), (0.5, 12)]})
    decoder.prefill_seconds, decoder.pass_seconds = 2.0, 4.0
    assert decoder.plain_comparison() == pytest.approx((2.0 + 5 * 2.0 + 1 * 1.0, 2.0 + 4.0))
    assert decoder.plain_speedup() == pytest.approx(13 / 6)
    timed_plain_passes(decoder, {2: [(2.0, 10)]})  # (the pass of 1 row priced as the nearest rows timed)
    assert decoder.plain_comparison() == pytest.approx((2.0 + 6 * 2.0, 2.0 + 4.0))
    timed_plain_passes(decoder, {1: [(1.0, 10)], 3: [(3.0, 10)]})  # (none of the 5 passes of 2 rows by their own)
    assert decoder.plain_comparison() is None


def test_plain_passes_are_priced_by_the_tokens_their_rows_hold() -> None:
    """A plain pass costs more as its rows hold more (1 s + 10 ms a token here), and a run's plain passes cluster
    where drafts did not pay (five of six late): each replayed pass is priced on the line through them at its own
    tokens, not at their mean (2.75 s, 10% over plain decoding's 249.5 s)."""
    decoder = specula.Decoder(model("llama"), None, slots=1)
    decoder.estimate.needs = {0: (100, 100)}  # (passes after 100, 101, ... 199 tokens)
    cost = lambda keys: 1.0 + keys / 100  # noqa: E731
    timed_plain_passes(decoder, {1: [(cost(keys), keys) for keys in (100, 180, 185, 190, 195, 199)]})
    decoder.prefill_seconds, decoder.pass_seconds = 0.0, 100.0
    plain, _ = decoder.plain_comparison()
    assert plain == pytest.approx(sum(cost(keys) for keys in range(100, 200)))
    timed_plain_passes(decoder, {1: [(cost(keys), keys) for keys in (180, 190, 199)]})  # (a span too short for a line)
    assert decoder.plain_comparison()[0] == pytest.approx(100 * (cost(180) + cost(190) + cost(199)) / 3)


def test_a_pass_with_a_row_whose_drafts_are_drawn_at_random_is_sized_without_measured_costs(monkeypatch) -> None:
    """A sampled row of a drafter that draws its drafts (how many it sends changes its random draws) beside a greedy
    row: every pass it is in weighs no measured cost, so that its seed reproduces it; once it ended, the greedy
    row's passes follow the measured costs again."""
    rows = prompts()
    decoder = specula.Decoder(model("llama"), NoisyModelDrafter(model("llama"), 2), slots=2).prepare()
    weighed = []  # (a row of the pass draws its drafts, the pass was weighed by measured costs)
    decide = AdaptiveDrafts.costs_for

    def recording(self, states):
        costs = decide(self, states)
        weighed.append((any(state.drawn for state in states), costs is not None))
        return costs

    monkeypatch.setattr(AdaptiveDrafts, "costs_for", recording)
    jobs = [
        specula.Job(rows[0].numpy(), 6, sampling=specula.Sampling(do_sample=True), key="sampled"),
        specula.Job(rows[1].numpy(), NEW_TOKENS, key="greedy"),
    ]
    list(decoder.run(jobs))
    assert (True, True) not in weighed
    assert (True, False) in weighed and (False, True) in weighed


@pytest.mark.parametrize("makespan", [True, False])
def test_a_run_drains_once_no_request_waits_for_a_slot(monkeypatch, makespan) -> None:
    """Three requests in two slots: while the third waits, every row's tokens count alike; once it has a slot and
    the stream is empty, the policy is told the run drains (its time is its last row's), unless the decoder serves
    requests whose own times count (``makespan=False``: a server)."""
    told = []
    budgets = AdaptiveDrafts.budgets

    def recording(self, states, room):
        if len(states) == 2:  # (a row alone: nothing to weigh)
            told.append(self.draining is not None)
        return budgets(self, states, room)

    monkeypatch.setattr(AdaptiveDrafts, "budgets", recording)
    weighed = []  # (what the guard is told the rows' tokens were worth, in all: fp32 passes are timed)
    record = DraftGuard.record
    monkeypatch.setattr(
        DraftGuard, "record", lambda self, *args: weighed.append(args[-1] / args[0]) or record(self, *args)
    )
    jobs = [specula.Job(p.numpy(), n, key=k) for k, (p, n) in enumerate(zip(prompts(), (3, 16, 16)))]
    decoder = specula.Decoder(tiny_model("llama"), specula.PromptLookup(), slots=2, makespan=makespan)
    assert len([row for row, _ in decoder.run(jobs) if row.finished]) == 3
    assert told[0] is False
    assert (True in told) is makespan and told == sorted(told)  # (never back: no request comes after)
    assert (min(weighed) < 1.0) is makespan  # (the row started later, further from its end, is worth more)


def test_rows_bound_by_the_context_alone_are_taken_to_end_last(monkeypatch) -> None:
    """Three requests in three slots (draining from the first pass): one with a bound of its own, two whose bound is
    the context's end (``open_ended``: their room falls with their prompts' lengths, which say nothing of when their
    answers end). The policy is told each row's tokens left: the bounded one's room, the open-ended ones the most of
    the batch's (mutant: their rooms taken as bounds)."""
    told = []
    budgets = AdaptiveDrafts.budgets

    def recording(self, states, room):
        if self.draining is not None:
            told.append((list(room), list(self.draining)))
        return budgets(self, states, room)

    monkeypatch.setattr(AdaptiveDrafts, "budgets", recording)
    jobs = [specula.Job(p.numpy(), n, key=k) for k, (p, n) in enumerate(zip(prompts(), (12, 30, 20)))]
    jobs[1].open_ended = jobs[2].open_ended = True
    decoder = specula.Decoder(tiny_model("llama"), specula.PromptLookup(), slots=3)
    assert len([row for row, _ in decoder.run(jobs) if row.finished]) == 3
    full = [(room, left) for room, left in told if len(room) == 3]
    assert full and all(left == [room[0], max(room), max(room)] for room, left in full)
    assert any(room[2] < max(room) for room, _ in full)  # (the mutant's rooms differ)
