"""specula inside HF's own model.generate (custom_generate), and HF's processors, stopping criteria and streamers
in specula.generate."""

from __future__ import annotations

import collections
import copy
import functools
import itertools

import pytest
import torch
import transformers
from helpers import Oracle, chi_square_p_value
from sampling_cases import TRUNCATED, copyable_prompt, hf_warped_probs, sharp_model
from sampling_cases import VOCAB as SHARP_VOCAB
from tiny_models import tiny_model, tiny_tokenizer

import specula

PROMPT = torch.tensor([[1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
NEW_TOKENS = 40


@functools.cache
def model(name: str = "llama") -> torch.nn.Module:
    model = tiny_model(name)
    model.generation_config.eos_token_id = None  # run to max_new_tokens unless a test says otherwise
    return model


def hf_generate(model, **kwargs) -> torch.Tensor:
    return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), pad_token_id=0, **kwargs)


def specula_hf_generate(model, proposer=None, **kwargs):
    return hf_generate(model, custom_generate=specula.custom_generate, proposer=proposer, **kwargs)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("make_proposer", [specula.PromptLookup, specula.NGramPredictor, lambda: None])
def test_custom_generate_greedy_is_identical(name, make_proposer) -> None:
    expected = hf_generate(model(name), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert specula_hf_generate(model(name), make_proposer(), max_new_tokens=NEW_TOKENS).tolist() == expected.tolist()


def test_return_dict_in_generate_carries_the_stats() -> None:
    out = specula_hf_generate(
        model(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, adaptive_draft=False
    )
    assert isinstance(out, specula.GenerateOutput)
    assert out.sequences.shape == (1, PROMPT.shape[1] + NEW_TOKENS)
    assert out.stats.new_tokens == NEW_TOKENS and out.stats.accepted > 0


def stop_inside_an_accepted_block() -> tuple[str, int]:
    """A stop string that the reference output reaches in the middle of a step whose drafts were accepted."""
    tokenizer = tiny_tokenizer()
    recorded = []

    class Steps(specula.PromptLookup):
        def observe(self, new_ids, num_accepted):
            recorded.append((list(new_ids), num_accepted))

    specula.generate(model(), PROMPT, Steps(), max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False)
    position = 0
    for new_ids, accepted in recorded:
        if accepted >= 2:
            token = tokenizer.convert_ids_to_tokens(new_ids[0]).replace("▁", " ")
            if len(token.strip()) >= 2:
                return token.strip(), position
        position += len(new_ids)
    raise AssertionError("no accepted block with a usable token")


def test_stop_strings_end_the_output_where_model_generate_ends_it() -> None:
    stop, position = stop_inside_an_accepted_block()
    kwargs = dict(max_new_tokens=NEW_TOKENS, stop_strings=[stop], tokenizer=tiny_tokenizer())
    expected = hf_generate(model(), **kwargs)
    # Drafts as proposed (not as the timed cost model would cut them), so the stop falls inside the same block.
    out = specula_hf_generate(
        model(), specula.PromptLookup(), return_dict_in_generate=True, adaptive_draft=False, **kwargs
    )
    assert out.sequences.tolist() == expected.tolist()
    assert out.sequences.shape[1] - PROMPT.shape[1] <= position + 1 < NEW_TOKENS
    # The same through specula.generate with HF's criterion object.
    criteria = transformers.StoppingCriteriaList([transformers.StopStringCriteria(tiny_tokenizer(), [stop])])
    direct = specula.generate(
        model(),
        PROMPT,
        specula.PromptLookup(),
        max_new_tokens=NEW_TOKENS,
        stopping_criteria=criteria,
        eos_token_id=[],
        adaptive_draft=False,
    )
    assert direct.sequences.tolist() == expected.tolist()


def test_rows_check_only_the_criteria_their_sequence_does_not_keep_itself() -> None:
    """``generate``'s own length limit and EOS criteria are what a row's sequence checks itself (at no cost, after
    every token): a row's job keeps the others (stop strings, a caller's), and an EOS criterion of other ids."""
    stop = transformers.StopStringCriteria(tiny_tokenizer(), ["zz"])
    (job,) = specula.prepare_jobs(model(), PROMPT, max_new_tokens=4, eos_token_id=[5], stopping_criteria=[stop])
    assert list(job.stopping_criteria) == [stop]
    other_eos = transformers.EosTokenCriteria(eos_token_id=[7])  # (generate's own replaced by it)
    (job,) = specula.prepare_jobs(model(), PROMPT, max_new_tokens=4, eos_token_id=[5], stopping_criteria=[other_eos])
    assert list(job.stopping_criteria) == [other_eos]
    (job,) = specula.prepare_jobs(model(), PROMPT, max_new_tokens=4, eos_token_id=[5])
    assert job.stopping_criteria is None and job.eos_token_ids == {5}


class RecordingStreamer(transformers.generation.BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        assert not self.ended
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("through", ["model.generate", "specula.generate"])
def test_streamers_get_every_step_as_it_is_accepted(through) -> None:
    streamer = RecordingStreamer()
    if through == "model.generate":
        out = specula_hf_generate(
            model(),
            specula.PromptLookup(),
            max_new_tokens=NEW_TOKENS,
            streamer=streamer,
            return_dict_in_generate=True,
            adaptive_draft=False,
        )
    else:
        out = specula.generate(
            model(), PROMPT, specula.PromptLookup(), max_new_tokens=NEW_TOKENS, streamer=streamer, adaptive_draft=False
        )
    assert streamer.ended and streamer.puts[0] == PROMPT[0].tolist()
    steps = streamer.puts[1:]
    assert len(steps) == out.stats.passes and max(map(len, steps)) > 1  # whole accepted blocks, one put per step
    assert list(itertools.chain(*steps)) == out.sequences[0, PROMPT.shape[1] :].tolist()


def test_text_streamer_prints_the_text(capsys) -> None:
    tokenizer = tiny_tokenizer()
    streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
    out = specula_hf_generate(model(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS, streamer=streamer)
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0, PROMPT.shape[1] :]).strip()


def test_logits_processors_are_applied_at_every_verified_position() -> None:
    """repetition_penalty reads the tokens so far: each verified position must see exactly its own prefix."""
    expected = hf_generate(model(), max_new_tokens=NEW_TOKENS, repetition_penalty=1.5, no_repeat_ngram_size=4)
    processors = transformers.LogitsProcessorList(
        [
            transformers.RepetitionPenaltyLogitsProcessor(1.5),
            transformers.NoRepeatNGramLogitsProcessor(4),
        ]
    )
    # The oracle drafts tokens the sequence has not had yet: a position that saw later drafts would penalise them.
    for proposer in (specula.PromptLookup(), Oracle(expected, 7)):
        out = specula_hf_generate(
            model(),
            proposer,
            max_new_tokens=NEW_TOKENS,
            repetition_penalty=1.5,
            no_repeat_ngram_size=4,
            return_dict_in_generate=True,
            adaptive_draft=False,
        )
        assert out.sequences.tolist() == expected.tolist()
        direct = specula.generate(
            model(),
            PROMPT,
            proposer,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            logits_processor=processors,
            adaptive_draft=False,
        )
        assert direct.sequences.tolist() == expected.tolist()
    assert direct.stats.acceptance_rate == 1.0 and direct.stats.drafted > NEW_TOKENS // 2


def test_sampling_through_model_generate_keeps_the_distribution() -> None:
    """Temperature, top-k, top-p and a repetition penalty (a processor that reads the tokens), sampled through
    model.generate(custom_generate=...), against the exact joint distribution of the first two tokens."""
    target, prompt = sharp_model(), copyable_prompt(tuple(TRUNCATED.items()))
    penalty = transformers.RepetitionPenaltyLogitsProcessor(1.5)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = hf_warped_probs(penalty(ids, target(ids).logits[0, -1:].clone()), **TRUNCATED)[0]
        expected = {}
        for x1 in range(SHARP_VOCAB):
            ids = torch.tensor([[*prompt, x1]])
            second = hf_warped_probs(penalty(ids, target(ids).logits[0, -1:].clone()), **TRUNCATED)[0]
            for x2 in range(SHARP_VOCAB):
                expected[(x1, x2)] = float(first[x1] * second[x2])
    torch.manual_seed(5)
    counts, stats = collections.Counter(), specula.SpecStats()
    ids = torch.tensor([prompt])
    for _ in range(2000):
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            custom_generate=specula.custom_generate,
            proposer=specula.PromptLookup(),
            do_sample=True,
            max_new_tokens=3,
            repetition_penalty=1.5,
            return_dict_in_generate=True,
            **TRUNCATED,
        )
        counts[tuple(out.sequences[0, len(prompt) : len(prompt) + 2].tolist())] += 1
        stats.drafted += out.stats.drafted
        stats.accepted += out.stats.accepted
    assert stats.accepted > 0.1 * stats.drafted > 0
    assert chi_square_p_value(counts, expected) > 0.001


def test_sampling_through_model_generate_is_reproducible() -> None:
    runs, target = [], model()  # (built before the seed: building it takes from torch's RNG)
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(specula_hf_generate(target, specula.PromptLookup(), max_new_tokens=NEW_TOKENS, do_sample=True))
    assert runs[0].tolist() == runs[1].tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "ask for beam search"),
        (dict(prompt_lookup_num_tokens=3), "ask for assisted generation"),
        (dict(guidance_scale=1.5), "UnbatchedClassifierFreeGuidanceLogitsProcessor keeps state"),
        (dict(output_attentions=True, return_dict_in_generate=True), "cannot return output_attentions"),
        (dict(num_return_sequences=2, do_sample=True), "one sequence per prompt"),
    ],
)
def test_what_custom_generate_cannot_do_is_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        specula_hf_generate(model(), specula.PromptLookup(), max_new_tokens=4, **kwargs)
    kwargs.pop("return_dict_in_generate", None)  # (specula.generate always asks for it)
    with pytest.raises(ValueError, match=message):
        specula.generate(model(), PROMPT, specula.PromptLookup(), max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_made_under_inference_mode_decodes_as_its_own_generate(dtype) -> None:
    """Its weights are inference tensors, which keep no version (the copies specula keeps follow sampled values):
    before, torch's error at the first pass."""
    with torch.inference_mode():
        made = copy.deepcopy(model()).to(dtype)
    assert made.lm_head.weight.is_inference()
    mask = torch.ones_like(PROMPT)
    expected = made.generate(PROMPT, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    for exact in (True, False) if dtype == torch.float32 else (True,):
        drafts = Oracle(expected, 6)  # (every pass verifies drafts, whatever the clock says)
        out = specula.generate(made, PROMPT, drafts, max_new_tokens=NEW_TOKENS, exact=exact, adaptive_draft=False)
        assert out.sequences.tolist() == expected.tolist() and out.stats.accepted > 0
