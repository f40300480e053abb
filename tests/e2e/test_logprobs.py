"""Log probabilities a job asks for (``Job.logprobs``, OpenAI's ``logprobs``): each new token's is the model's own at
its position, ``model.generate``'s raw logits there (fp32), whether the target chose it in a plain pass, accepted it as
a draft of a chain or along a tree's path, in a batch or sampled; its alternatives are that position's likeliest."""

from __future__ import annotations

import pytest
import torch
from helpers import Oracle, TreeOracle
from tiny_models import VOCAB, tiny_model

import specula
from specula.decoding.driver import decode_all
from specula.decoding.loop import Decoder

NEW = 20
TOP = 3


def reference(model, prompt: torch.Tensor, seed: int | None = None) -> tuple[list[int], torch.Tensor]:
    """``model.generate``'s new tokens for ``prompt`` and its log probabilities at each (``[NEW, vocab]``)."""
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt[None]),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=seed is not None,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


@pytest.mark.parametrize("how", ["plain", "chain", "batch", "tree", "sampled"])
def test_each_tokens_log_probability_is_the_models_own(how: str) -> None:
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator) for n in ((17, 9, 25) if how == "batch" else (17,))]
    seed = 11 if how == "sampled" else None
    expected = [reference(model, prompt, seed) for prompt in prompts]
    outputs = [torch.tensor(prompt.tolist() + tokens) for prompt, (tokens, _) in zip(prompts, expected)]
    proposer = {
        "plain": None,
        "chain": Oracle(outputs, 4),
        "batch": Oracle(outputs, 4),
        "tree": TreeOracle(outputs, "second", VOCAB),
        "sampled": None,
    }[how]
    jobs = []
    for key, prompt in enumerate(prompts):
        (job,) = specula.prepare_jobs(
            model,
            prompt[None],
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=seed is not None,
            **({"generator": [torch.Generator().manual_seed(0)]} if seed is None else {}),
        )
        job.key, job.logprobs = key, TOP
        jobs.append(job)
    if seed is not None:
        torch.manual_seed(seed)  # (model.generate's draws, from the global generator)
    rows = decode_all(Decoder(model, proposer, slots=len(prompts), adaptive_draft=False), jobs)
    for key, (tokens, logprobs) in enumerate(expected):
        row = rows[key]
        assert row.output.tolist() == tokens
        if how in ("chain", "batch", "tree"):
            assert row.stats.accepted > NEW // 2  # (most tokens were drafts the pass accepted)
        assert [t.token for t in row.logprobs] == tokens
        got = torch.tensor([t.logprob for t in row.logprobs])
        torch.testing.assert_close(got, logprobs[torch.arange(NEW), torch.tensor(tokens)], rtol=0, atol=1e-5)
        top_values, top_ids = logprobs.topk(TOP, dim=-1)
        assert [[token for token, _ in t.top] for t in row.logprobs] == top_ids.tolist()
        torch.testing.assert_close(
            torch.tensor([[value for _, value in t.top] for t in row.logprobs]), top_values, rtol=0, atol=1e-5
        )


def test_a_job_that_does_not_ask_gets_none_and_asking_for_too_many_is_refused() -> None:
    model = tiny_model("llama")
    (job,) = specula.prepare_jobs(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    job.key = 0
    assert decode_all(Decoder(model, None), [job])[0].logprobs == []
    with pytest.raises(ValueError, match="logprobs must be None or 0-20"):
        specula.Job(job.prompt, 4, logprobs=21)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("new", [0, 5])
def test_a_prompts_log_probabilities_are_the_models_own(slots: int, new: int) -> None:
    """``Job.prompt_logprobs`` (OpenAI's ``echo`` with ``logprobs``): each prompt token's after the first, from its
    prefill's logits, alone and in a batch; none new is a prefill alone (what scoring a text asks)."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator) for n in (13, 21)[:slots]]
    jobs = []
    for key, prompt in enumerate(prompts):
        (job,) = specula.prepare_jobs(model, prompt[None], max_new_tokens=max(new, 1), do_sample=False)
        job.key, job.max_new_tokens, job.prompt_logprobs = key, new, TOP
        jobs.append(job)
    rows = decode_all(Decoder(model, None, slots=slots), jobs)
    for key, prompt in enumerate(prompts):
        logprobs = torch.log_softmax(model(prompt[None]).logits[0, :-1].float(), dim=-1)  # [len - 1, vocab]
        row = rows[key]
        assert len(row.output) == new and row.stats.new_tokens == new
        first, *rest = row.prompt_logprobs
        assert first.token == int(prompt[0]) and first.logprob is None and first.top == ()
        assert [t.token for t in rest] == prompt[1:].tolist()
        expected = logprobs[torch.arange(len(prompt) - 1), prompt[1:]]
        torch.testing.assert_close(torch.tensor([t.logprob for t in rest]), expected, rtol=0, atol=1e-5)
        assert [[token for token, _ in t.top] for t in rest] == logprobs.topk(TOP, dim=-1).indices.tolist()
