"""Requests of the same prompt in one batch (OpenAI's ``n``, a file's repeated prompt): the first computes it, the
others take its states and first logits (the very ones a prefill computes), and each decodes as ``model.generate``
decodes it alone, greedy or sampled with its own seed, with or without drafts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import specula
from specula.decoding.driver import decode_all
from specula.decoding.loop import Decoder
from specula.verifier.runner import RaggedRows

NEW = 16


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral"])  # (mistral: sliding windows, each prompt its own)
@pytest.mark.parametrize("proposer", [None, "prompt-lookup"])
def test_a_prompt_in_the_batch_is_computed_once(name: str, proposer: str | None, monkeypatch) -> None:
    model = tiny_model(name)
    generator = torch.Generator().manual_seed(4)
    prompt, other = (torch.randint(3, VOCAB, (n,), generator=generator) for n in (19, 11))
    requests = [(prompt, None), (prompt, 5), (other, None), (prompt, 6), (prompt, None)]  # (prompt, seed)
    jobs, expected = [], []
    for key, (ids, seed) in enumerate(requests):
        longer = 8 if key == 0 else 0  # (the first outlives the others: the fifth finds it when it takes a slot)
        settings = {"max_new_tokens": NEW + longer, "do_sample": seed is not None, "pad_token_id": 0}
        generator = [torch.Generator().manual_seed(seed if seed is not None else 0)]
        (job,) = specula.prepare_jobs(model, ids[None], generator=generator, **settings)
        job.key = key
        jobs.append(job)
        if seed is not None:
            torch.manual_seed(seed)
        expected.append(model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), **settings)[0, len(ids) :])
    prefills, start_row = [], RaggedRows.start_row
    monkeypatch.setattr(
        RaggedRows,
        "start_row",
        lambda self, index, ids, *rest: prefills.append(len(ids)) or start_row(self, index, ids, *rest),
    )
    decoder = Decoder(model, specula.PromptLookup() if proposer else None, slots=4)
    rows = decode_all(decoder, jobs)
    assert [rows[key].output.tolist() for key in range(len(jobs))] == [tokens.tolist() for tokens in expected]
    # the fifth waits for a slot, and takes the first's states then (mistral: every prompt computed)
    assert prefills == ([19, 11] if name != "mistral" else [19, 19, 11, 19, 19])
