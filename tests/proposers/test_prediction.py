"""Predicted outputs: drafts from the text a request expects back. Output identical to model.generate whatever the
prediction (right, wrong everywhere, edited in the middle, a block moved), alone and in batches, sampled too; the
output rejoins the prediction after an edit; the prediction's tokens counted as OpenAI counts them; bad input
refused before the model runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy
from tiny_models import VOCAB, tiny_model

import specula
from specula.core.draft import Draft
from specula.proposers import prediction as prediction_module
from specula.proposers.kernels import prediction_lookup
from specula.proposers.prediction import Prediction, with_prediction

NEW = 60
PROMPT = torch.tensor([[1, 40, 3, 77, 12, 55, 23, 9, 60, 14, 30, 41, 33, 70, 4, 8]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")  # (its greedy output varies; most tiny models soon repeat a few tokens)


@pytest.fixture(scope="module")
def output(model) -> list[int]:
    """model.generate's greedy output: what every prediction below is made from."""
    out = hf_greedy(model, PROMPT, NEW, eos_token_id=[])[0, PROMPT.shape[1] :].tolist()
    assert len(set(out)) > 20  # (text that varies, so that matches place the output)
    return out


def edited(output: list[int]) -> list[int]:
    """The output with 5 tokens in the middle replaced: a one-place edit."""
    return output[:25] + [(token + 7) % VOCAB for token in output[25:30]] + output[30:]


def moved(output: list[int]) -> list[int]:
    """The output with its last 20 tokens moved to the front."""
    return output[40:] + output[:40]


def run(model, prediction, proposer=None, **kwargs):
    return specula.generate(
        model, PROMPT, proposer, max_new_tokens=NEW, eos_token_id=[], prediction=prediction, **kwargs
    )


@pytest.mark.parametrize("kind", ["right", "wrong", "edited", "moved"])
def test_output_is_model_generate_whatever_the_prediction(model, output, kind) -> None:
    wrong = [(token * 5 + 11) % VOCAB for token in output]
    prediction = {"right": output, "wrong": wrong, "edited": edited(output), "moved": moved(output)}[kind]
    for proposer in (None, specula.PromptLookup()):
        out = run(model, prediction, proposer)
        assert out.sequences[0, PROMPT.shape[1] :].tolist() == output
        stats = out.stats
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens <= stats.drafted
    if kind == "right":  # (every draft sent: what the cost model sends depends on the clock)
        stats = run(model, prediction, specula.PromptLookup(), adaptive_draft=False).stats
        # the prefill, then passes of the longest drafts sent (64 tokens; a first one led by prompt lookup's draft,
        # the prediction matching the output's first token only), each accepted but for the pass's own token
        assert stats.passes <= 3 and stats.accepted_prediction_tokens == NEW - stats.passes
        stats = run(model, prediction, adaptive_draft=False).stats
        assert stats.passes == 2  # the prefill and one pass over NEW - 1 drafts (drafts of up to 32: 3 steps)


@pytest.mark.parametrize("exact", [True, False])
def test_drafts_wider_than_the_calibrated_passes_are_model_generate_in_bf16(exact) -> None:
    """A prediction's draft of 59 tokens in one pass, wider than the 33 rows row-exact verification calibrates
    (every linear layer then computed row-exactly in chunks): greedy bf16 output is model.generate's (row-exact:
    bit for bit; ordinary: the same here, where no logits are near a tie)."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    expected = hf_greedy(model, PROMPT, NEW, eos_token_id=[])[0, PROMPT.shape[1] :].tolist()
    out = run(model, expected, adaptive_draft=False, exact=exact)
    assert out.sequences[0, PROMPT.shape[1] :].tolist() == expected
    assert out.stats.passes == 2 and out.stats.exactness.exact is exact


def test_counts_add_up_to_what_was_sent_from_the_prediction(model, output) -> None:
    """Alone (no other proposer), every draft token comes from the prediction."""
    for prediction in (output, edited(output), moved(output)):
        stats = run(model, prediction).stats
        assert stats.accepted_prediction_tokens == stats.accepted
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == stats.drafted > 0


def test_the_output_rejoins_the_prediction_after_an_edit(model, output) -> None:
    """Sending every draft (no cost model), a one-place edit of 5 tokens costs a step for the text before it (the
    prefill and one pass), one per edited token and one for the rest: 7 passes; a loop that never finds the
    prediction again after the edit needs one per token after it (37)."""
    stats = run(model, edited(output), adaptive_draft=False).stats
    assert stats.passes <= 9, stats
    stats = run(model, moved(output), adaptive_draft=False).stats
    assert stats.passes <= 8, stats  # the moved block first, then a jump back to the start of the prediction


def test_batches_and_rows_without_a_prediction(model, output) -> None:
    prompts = torch.cat([PROMPT, PROMPT.flip(1)])
    expected = hf_greedy(model, prompts, NEW, eos_token_id=[])
    out = specula.generate(
        model,
        prompts,
        specula.PromptLookup(),
        max_new_tokens=NEW,
        eos_token_id=[],
        prediction=[edited(output), None],
        adaptive_draft=False,
    )
    assert out.sequences.tolist() == expected.tolist()
    first, second = out.stats.rows
    assert first.accepted_prediction_tokens > 30 and second.accepted_prediction_tokens == 0
    assert second.rejected_prediction_tokens == 0


def test_seeded_sampling_draws_model_generate_tokens(model, output) -> None:
    def sampled(**kwargs):
        return model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            do_sample=True,
            temperature=0.7,
            max_new_tokens=NEW,
            eos_token_id=[],
            pad_token_id=0,
            generator=torch.Generator().manual_seed(5),
            **kwargs,
        )

    expected = specula.generate(
        model,
        PROMPT,
        None,
        max_new_tokens=NEW,
        eos_token_id=[],
        do_sample=True,
        temperature=0.7,
        generator=torch.Generator().manual_seed(5),
    ).sequences
    got = specula.generate(
        model,
        PROMPT,
        None,
        max_new_tokens=NEW,
        eos_token_id=[],
        do_sample=True,
        temperature=0.7,
        generator=torch.Generator().manual_seed(5),
        prediction=expected[0, PROMPT.shape[1] :],
    ).sequences
    assert got.tolist() == expected.tolist()
    via_hf = sampled(
        custom_generate=specula.custom_generate, proposer=None, prediction=output, return_dict_in_generate=True
    )
    assert via_hf.sequences.tolist() == expected.tolist()


def test_text_predictions_and_openai_shape(model, output) -> None:
    class Tokens:  # a tokenizer of space-separated ids
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(word) for word in text.split()]}

    text = " ".join(map(str, output))
    for prediction in (
        text,
        {"type": "content", "content": text},
        {"type": "content", "content": [{"type": "text", "text": text}]},
    ):
        stats = run(model, prediction, tokenizer=Tokens(), adaptive_draft=False).stats
        assert (
            stats.passes == 2 and stats.accepted_prediction_tokens == NEW - 2 and not stats.rejected_prediction_tokens
        )


@pytest.mark.parametrize(
    "prediction, message",
    [
        ("some text", "pass tokenizer="),
        ([1, 2, VOCAB + 5], "outside the model's vocabulary"),
        ([[1, 2], [3, 4]], "2 predictions for a batch of 1"),
        ([0.5, 1.5], "text or a 1-D sequence of token ids"),
        ({"content": "x"}, "OpenAI's"),
        (list(range(1, 90)) * 10, "more than the model's context"),
    ],
)
def test_bad_predictions_are_refused_before_the_model_runs(model, prediction, message, monkeypatch) -> None:
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: pytest.fail("the model ran"))
    with pytest.raises(ValueError, match=message):
        run(model, prediction)


def test_an_empty_prediction_is_ignored_with_a_warning(model, output) -> None:
    with pytest.warns(UserWarning, match="empty"):
        out = run(model, [])
    assert out.sequences[0, PROMPT.shape[1] :].tolist() == output and out.stats.drafted == 0


def test_a_batch_needs_one_prediction_per_row(model) -> None:
    with pytest.raises(ValueError, match="needs a list of 2 predictions"):
        specula.generate(model, torch.cat([PROMPT, PROMPT]), None, max_new_tokens=4, prediction=[5, 6, 7])


def test_lookup_prefers_the_longest_match_then_the_cursor() -> None:
    prediction = np.array([5, 6, 7, 5, 6, 8, 9, 1, 2, 3])
    assert prediction_lookup(prediction, np.array([1, 5, 6]), 4, 8) == (5, 2)  # nearest of two [5, 6]
    assert prediction_lookup(prediction, np.array([1, 5, 6]), 1, 8) == (2, 2)
    assert prediction_lookup(prediction, np.array([9, 1, 2]), 0, 8) == (9, 3)  # far, but longer
    assert prediction_lookup(prediction, np.array([4]), 6, 8) == (6, 0)  # nothing matches: the cursor
    assert prediction_lookup(prediction, np.array([4]), 10, 8) == (-1, 0)  # ... unless at the end


def test_counting_follows_the_sent_tree() -> None:
    state = Prediction(np.array([4, 5, 6, 7]))
    draft = with_prediction(state.propose(np.array([], dtype=np.int64), 4), Draft([4, 9], source=2))
    assert draft.tokens.tolist() == [4, 9, 5, 6, 7]  # (the other first: the prediction matched nothing)
    state.advance(draft.select([0, 1, 2]), [4, 9, 11])  # sent 4 -> 9 and 4 -> 5; kept 4, 9
    assert (state.accepted, state.rejected) == (1, 1) and state.cursor == 3


def test_the_prediction_leads_only_with_a_match(monkeypatch) -> None:
    other = Draft([8, 8], source=3)
    assert with_prediction(Draft([4, 5], source=("prediction", 1)), other).tokens.tolist()[:2] == [8, 8]
    assert with_prediction(Draft([4, 5], source=("prediction", 2)), other).tokens.tolist()[:2] == [4, 5]
    monkeypatch.setattr(prediction_module, "LEAD", 3)
    assert with_prediction(Draft([4, 5], source=("prediction", 2)), other).tokens.tolist()[:2] == [8, 8]
