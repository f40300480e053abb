"""Recurrent state (Mamba, gated delta nets ...) rolled back within a pass, by feeding the kept tokens again or from the
states a step-by-step pass kept; what cannot be done is refused clearly. (Identity with model.generate over every
recurrent architecture: tests/e2e/test_architectures.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from architectures import sweep_prompts, tiny_causal_lm
from helpers import Oracle, PartlyRight, TreeOracle

import specula
from specula.verifier.runner import OneSequence


# qwen3_next: fed again; mamba and recurrent_gemma (states on its modules): step by step
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba", "recurrent_gemma"])
def test_a_rollback_leaves_the_state_of_the_tokens_kept(model_type: str) -> None:
    model, prompt = tiny_causal_lm(model_type), sweep_prompts()[0][0]
    block = torch.tensor([7, 9, 11, 13])
    target = OneSequence(model, rollback=True)
    target.forward(prompt, 1)
    target.forward(block, 4)
    target.rollback(2)  # keeps 7, 9
    after = target.forward(torch.tensor([5]), 1)
    alone = OneSequence(model, rollback=True)
    alone.forward(torch.cat([prompt, block[:2]]), 1)
    expected = alone.forward(torch.tensor([5]), 1)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert target.cached_tokens == len(prompt) + 3


@pytest.mark.parametrize("model_type", ["mamba2", "zamba"])
def test_a_rollback_past_the_last_pass_is_refused(model_type: str) -> None:
    target = OneSequence(tiny_causal_lm(model_type), rollback=True)
    target.forward(sweep_prompts()[0][0], 1)
    target.forward(torch.tensor([7, 9]), 2)
    with pytest.raises(specula.UnsupportedModelError, match="rolls back only within the last pass"):
        target.rollback(3)


def test_half_precision_recurrent_layers_are_verified_as_one_token_steps_compute_them() -> None:
    """bf16: Mamba-2's chunked scan over several tokens rounds otherwise than its one-token step, which changes greedy
    output on these tiny models unless row-exact verification computes the recurrent layers step by step."""
    ordinary_differs = False
    for model_type in ("mamba2", "granitemoehybrid", "bamba"):
        model = tiny_causal_lm(model_type).to(torch.bfloat16)
        for prompt in sweep_prompts():
            expected = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=40
            ).tolist()
            for proposer in (Oracle(torch.tensor(expected), 6), PartlyRight(torch.tensor(expected), 6)):
                run = lambda exact: specula.generate(  # noqa: E731
                    model, prompt, proposer, max_new_tokens=40, adaptive_draft=False, pad_token_id=0, exact=exact
                ).sequences.tolist()
                assert run(True) == expected
                ordinary_differs |= run(False) != expected
    assert ordinary_differs  # (else this test could not fail)


def test_half_precision_with_row_exact_verification_is_refused_where_layers_cannot_be_stepped() -> None:
    model, prompt = tiny_causal_lm("zaya").to(torch.bfloat16), sweep_prompts()[0]
    with pytest.raises(specula.UnsupportedModelError, match="exact=False"):
        specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0, exact=True)
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0, exact=False)
    assert out.sequences.shape[1] > prompt.shape[1]
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=8, pad_token_id=0)
    assert not out.stats.exactness.exact  # by default: ordinary, since exact is not supported here


def _rows() -> list[torch.Tensor]:
    prompts = [prompt[0] for prompt in sweep_prompts()]
    return [*prompts, prompts[0][5:], torch.randint(3, 90, (17,), generator=torch.Generator().manual_seed(0))]


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :], mask[b, width - len(row) :] = row, 1
    return ids, mask


# Mamba-1 alone, Mamba-2 with attention (Bamba), gated delta nets with attention (Qwen3-Next), Mamba-1 with attention
# (Jamba), Nemotron-H (layers that keep nothing), attention and Mamba-2 in one cache layer (Falcon-H1), and Mamba-1 in
# Zamba's hybrid layers; each row its own recurrent state, rows accepting different lengths
@pytest.mark.parametrize("model_type", ["mamba", "bamba", "qwen3_next", "jamba", "nemotron_h", "falcon_h1", "zamba"])
def test_rows_of_a_batch_keep_their_own_state_and_each_is_model_generate_alone(model_type: str) -> None:
    model, rows = tiny_causal_lm(model_type), _rows()
    references = [
        model.generate(
            row[None],
            attention_mask=torch.ones_like(row[None]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=[],
            pad_token_id=0,
        )[0]
        for row in rows
    ]
    ids, mask = _left_padded(rows)
    for proposer in (Oracle(references, 6), PartlyRight(references, 6), specula.PromptLookup(), None):
        out = specula.generate(
            model,
            ids,
            proposer,
            attention_mask=mask,
            max_new_tokens=24,
            eos_token_id=[],
            adaptive_draft=False,
            pad_token_id=0,
        )
        assert [row[ids.shape[1] :] for row in out.sequences.tolist()] == [
            reference[len(row) :].tolist() for reference, row in zip(references, rows)
        ]
        if isinstance(proposer, PartlyRight):
            assert len({row.accepted for row in out.stats.rows}) > 1  # (ragged acceptance)


@pytest.mark.parametrize(
    "model_type, why",
    [("zaya", "cannot be computed one token at a time"), ("recurrent_gemma", "keep their states on the modules")],
)
def test_models_whose_states_cannot_be_batch_rows_are_refused_in_a_batch(model_type: str, why: str) -> None:
    ids, mask = _left_padded(_rows())
    with pytest.raises(specula.UnsupportedModelError, match=why):
        specula.generate(
            tiny_causal_lm(model_type),
            ids,
            specula.PromptLookup(),
            attention_mask=mask,
            max_new_tokens=8,
            pad_token_id=0,
        )


# qwen3_next: fed again alone; mamba: step by step
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba"])
def test_eos_inside_an_accepted_block_stops_each_row_where_model_generate_does(model_type: str) -> None:
    """EOS is a token the first row makes mid-block: alone, and in a batch whose other rows go on."""
    model, rows = tiny_causal_lm(model_type), _rows()
    first = model.generate(
        rows[0][None],
        attention_mask=torch.ones_like(rows[0][None]),
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=[],
        pad_token_id=0,
    )[0, len(rows[0]) :].tolist()
    eos = next(token for i, token in enumerate(first) if first.index(token) == i and i >= 3 and i % 7 != 0)
    references = [
        model.generate(
            row[None],
            attention_mask=torch.ones_like(row[None]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=eos,
            pad_token_id=0,
        )[0]
        for row in rows
    ]
    assert len(references[0]) < len(rows[0]) + 24 and max(map(len, references)) > len(references[0])
    alone = specula.generate(
        model,
        rows[0][None],
        Oracle(references[:1], 6),
        max_new_tokens=24,
        eos_token_id=eos,
        adaptive_draft=False,
        pad_token_id=0,
    )
    assert alone.sequences[0].tolist() == references[0].tolist() and alone.stats.accepted > 0
    ids, mask = _left_padded(rows)
    out = specula.generate(
        model,
        ids,
        Oracle(references, 6),
        attention_mask=mask,
        max_new_tokens=24,
        eos_token_id=eos,
        adaptive_draft=False,
        pad_token_id=0,
    )
    for row, reference, prompt in zip(out.sequences.tolist(), references, rows):
        made = row[ids.shape[1] :]
        assert made[: len(reference) - len(prompt)] == reference[len(prompt) :].tolist()
        assert set(made[len(reference) - len(prompt) :]) <= {0}  # (padded after its end)


# Mamba-1 alone; gated delta nets with attention; attention and Mamba-2 in one cache layer
@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next", "falcon_h1"])
@pytest.mark.parametrize("batch", [False, True])
def test_trees_verify_each_branch_from_its_own_state(model_type: str, batch: bool) -> None:
    """Trees whose right tokens lie off their first branch ("second", "detour"): accepted there only if each branch
    was computed from the state after its own parent."""
    model, rows = tiny_causal_lm(model_type), _rows()[: 3 if batch else 1]
    references = [
        model.generate(
            row[None],
            attention_mask=torch.ones_like(row[None]),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=[],
            pad_token_id=0,
        )[0]
        for row in rows
    ]
    ids, mask = _left_padded(rows)
    for shape in ("second", "detour", "late"):
        out = specula.generate(
            model,
            ids,
            TreeOracle(references, shape, 96),
            attention_mask=mask,
            max_new_tokens=24,
            eos_token_id=[],
            adaptive_draft=False,
            pad_token_id=0,
        )
        assert [row[ids.shape[1] :] for row in out.sequences.tolist()] == [
            reference[len(row) :].tolist() for reference, row in zip(references, rows)
        ]
        assert out.stats.tree_passes > 0 and (shape == "late" or out.stats.tree_gain > 0)


def test_trees_are_cut_to_their_first_branch_where_states_cannot_be_rows() -> None:
    model, prompt = tiny_causal_lm("recurrent_gemma"), sweep_prompts()[0]
    reference = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=[],
        pad_token_id=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = specula.generate(
            model,
            prompt,
            TreeOracle([reference[0]], "late", 96),
            max_new_tokens=24,
            eos_token_id=[],
            adaptive_draft=False,
            pad_token_id=0,
        )
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.accepted > 0 and out.stats.tree_passes == 0
    assert any("cut to their first branch" in str(warning.message) for warning in caught)
