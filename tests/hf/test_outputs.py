"""``output_logits`` and ``output_scores`` (with ``return_dict_in_generate``): each step's logits and processed
scores are ``model.generate``'s (fp32), whether the target chose the token in a plain pass or accepted it as a draft,
greedy, with logits processors, or sampled; in a batch, a row that ended earlier has zeros at the later steps."""

from __future__ import annotations

import pytest
import torch
from helpers import Oracle
from tiny_models import VOCAB, tiny_model

import specula

NEW = 12


def reference(model, ids: torch.Tensor, seed: int, **settings):
    torch.manual_seed(seed)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **settings,
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": False},
        {"do_sample": False, "repetition_penalty": 1.3, "min_new_tokens": NEW},
        {"do_sample": True, "temperature": 0.7, "top_k": 10},
    ],
)
@pytest.mark.parametrize("entry", ["specula.generate", "custom_generate"])
def test_each_steps_logits_and_scores_are_model_generates(settings: dict, entry: str) -> None:
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 15), generator=torch.Generator().manual_seed(1))
    expected = reference(model, ids, 3, **settings)
    drafts = Oracle(expected.sequences[0], 4)  # (model.generate's own tokens: most are accepted as drafts)
    torch.manual_seed(3)
    if entry == "specula.generate":
        out = specula.generate(
            model,
            ids,
            drafts,
            max_new_tokens=NEW,
            output_scores=True,
            output_logits=True,
            pad_token_id=0,
            adaptive_draft=False,
            **settings,
        )
        assert out.stats.accepted > NEW // 2
    else:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            custom_generate=specula.custom_generate,
            proposer=drafts,
            max_new_tokens=NEW,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            adaptive_draft=False,
            **settings,
        )
    assert torch.equal(out.sequences, expected.sequences)
    for kind in ("logits", "scores"):
        got, want = getattr(out, kind), getattr(expected, kind)
        assert len(got) == len(want) == NEW
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=1e-5)


def test_a_row_that_ended_earlier_has_zeros_after_its_end() -> None:
    model = tiny_model("llama")
    rows = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    alone = [reference(model, row[None], 0, do_sample=False) for row in rows]
    eos = int(alone[0].sequences[0, 9 + 4])  # (row 0's fifth new token ends it, as row 1 goes on)
    assert eos not in alone[1].sequences[0, 9:].tolist()
    ended = reference(model, rows[:1], 0, do_sample=False, eos_token_id=eos)
    out = specula.generate(model, rows, None, max_new_tokens=NEW, eos_token_id=eos, output_logits=True, pad_token_id=0)
    assert len(out.logits) == NEW and all(step.shape == (2, VOCAB) for step in out.logits)
    torch.testing.assert_close(torch.stack(out.logits[:5])[:, 0], torch.stack(ended.logits)[:, 0], rtol=0, atol=1e-5)
    assert all(not step[0].any() for step in out.logits[5:])
    torch.testing.assert_close(torch.stack(out.logits)[:, 1], torch.stack(alone[1].logits)[:, 0], rtol=0, atol=1e-5)
    assert out.scores is None
