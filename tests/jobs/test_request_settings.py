"""Every request decodes with its own settings, in any batch: requests of different prompt lengths and settings
(greedy beside sampled, penalties, stop strings, lengths, a minimum length from the generation config) share passes,
and each answer is ``model.generate``'s for that request alone, through :class:`specula.Decoder` and through
``specula generate``."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import VOCAB, tiny_model, tiny_tokenizer
from transformers import LogitsProcessorList

import specula
from specula import cli
from specula.hf.penalties import PresenceFrequencyPenalty, word_token_ids
from specula.tools import bench

NEW = 12
SHORT, LONG = (
    "stop here please",
    (
        "the quick brown fox jumps over the lazy dog print hello world "
        "def foo(bar, baz): return bar + baz the quick brown fox jumps over"
    ),
)


def generate(requests, output, folder, *more) -> None:
    """``specula generate`` over ``requests`` with the model saved in ``folder`` (fp32, ``NEW`` new tokens at most),
    ``more`` options after."""
    cli.main(
        [
            str(arg)
            for arg in ["generate", "--input", requests, "--output", output, "--model", folder, "--dtype", "fp32"]
            + ["--max-new-tokens", NEW, *more]
        ]
    )


def reference(model, ids: torch.Tensor, seed: int | None = None, **kwargs) -> list[int]:
    """``model.generate`` on this request alone (seeded with ``torch.manual_seed(seed)`` where given)."""
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def eager_to_end():
    """A tiny Llama whose end-of-sequence token is the long prompt's second greedy token, with a generation config
    that asks for at least 6 new tokens: a request decoded with another prompt's processors ends after 2."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    ids = tokenizer(LONG, return_tensors="pt").input_ids
    greedy = reference(model, ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    model.generation_config.eos_token_id = greedy[1] if greedy[1] != greedy[0] else greedy[2]
    model.generation_config.min_new_tokens = 6
    return model, tokenizer


def test_requests_with_their_own_settings_share_passes_each_as_alone(eager_to_end) -> None:
    model, tokenizer = eager_to_end
    requests = [  # (prompt, settings, seed)
        (SHORT, {"do_sample": False}, None),
        (LONG, {"do_sample": False}, None),  # after a shorter prompt: its minimum length counts from its own
        (LONG, {"do_sample": True, "temperature": 0.9, "top_k": 20}, 7),
        (SHORT + " " + LONG, {"do_sample": False, "repetition_penalty": 1.5}, None),
        (LONG, {"do_sample": False, "min_new_tokens": 0}, None),
        (LONG, {"do_sample": False, "stop_strings": ["o"], "tokenizer": tokenizer}, None),
        (SHORT, {"do_sample": True, "top_p": 0.8, "max_new_tokens": 5}, 3),
    ]
    jobs, expected = [], []
    for key, (prompt, settings, seed) in enumerate(requests):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        settings = {"max_new_tokens": NEW, **settings}
        generator = None if seed is None else [torch.Generator().manual_seed(seed)]
        (job,) = specula.prepare_jobs(model, ids, generator=generator, **settings)
        job.key = key
        jobs.append(job)
        expected.append(reference(model, ids, seed, **settings))
    assert len(expected[1]) >= 6 and len(expected[4]) == 2  # (the minimum length matters here)
    decoder = specula.Decoder(model, specula.PromptLookup(), slots=3)
    got = {row.job.key: row.output.tolist() for row, _ in decoder.run(jobs) if row.finished}
    assert [got[key] for key in range(len(requests))] == expected


def test_request_lines_decode_with_their_own_settings(eager_to_end, tmp_path) -> None:
    """Through the command line, in batches of 3, with the run's defaults (--max-new-tokens, --seed) under each
    line's own: each answer is model.generate's with that line's settings."""
    model, tokenizer = eager_to_end
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    eos = model.generation_config.eos_token_id
    short = reference(model, tokenizer(SHORT, return_tensors="pt").input_ids, max_new_tokens=NEW, do_sample=False)
    stop = short[6]  # (a token its greedy answer makes after the 6 the generation config asks for: it ends there)
    assert stop != eos and stop not in short[:6]
    long = reference(model, tokenizer(LONG, return_tensors="pt").input_ids, max_new_tokens=NEW, do_sample=False)
    allowed = sorted({*long[2:4], eos})  # (vLLM's allowed_token_ids: the greedy answer's first two not among them)
    assert not {*long[:2]} & {*allowed}
    # (vLLM's bad_words: a word its greedy answer holds, a token of its own)
    words = [tokenizer.decode([token]).strip() for token in long]
    word = next(word for token, word in zip(long, words) if [token] in word_token_ids(tokenizer, [word]))
    word_ids = word_token_ids(tokenizer, [word])
    lines = [
        ({"prompt": SHORT}, {"do_sample": False}, None),
        ({"prompt": LONG}, {"do_sample": False}, None),
        (
            {"prompt": LONG, "temperature": 0.9, "top_k": 20, "seed": 11},
            {"do_sample": True, "temperature": 0.9, "top_k": 20},
            11,
        ),
        ({"prompt": LONG, "temperature": 1.0, "top_p": 0.9}, {"do_sample": True, "top_p": 0.9}, 100 + 4),
        (
            {"prompt": LONG, "max_tokens": 5, "repetition_penalty": 1.5},
            {"do_sample": False, "max_new_tokens": 5, "repetition_penalty": 1.5},
            None,
        ),
        ({"prompt": LONG, "min_tokens": 0}, {"do_sample": False, "min_new_tokens": 0}, None),
        (  # (OpenAI's penalties over the output: model.generate with the processor that applies them)
            {"prompt": LONG, "frequency_penalty": 2, "presence_penalty": 1.5},
            {"do_sample": False, "penalties": (2.0, 1.5)},
            None,
        ),
        (  # (OpenAI's logit bias: transformers' sequence bias of one-token sequences)
            {"prompt": LONG, "logit_bias": {"7": 100, "8": -0.5}},
            {"do_sample": False, "sequence_bias": {(7,): 100.0, (8,): -0.5}},
            None,
        ),
        (
            {"prompt": SHORT, "max_completion_tokens": 3, "top_k": -1, "temperature": 0.5, "seed": 5},
            {"do_sample": True, "max_new_tokens": 3, "temperature": 0.5, "top_k": 0},
            5,
        ),
        # vLLM's: the only tokens allowed; words refused; the prompt's last tokens
        (
            {"prompt": LONG, "allowed_token_ids": allowed},
            {"do_sample": False, "suppress_tokens": [token for token in range(VOCAB) if token not in allowed]},
            None,
        ),
        ({"prompt": LONG, "bad_words": [word]}, {"do_sample": False, "bad_words_ids": word_ids}, None),
        ({"prompt": LONG, "truncate_prompt_tokens": 9}, {"do_sample": False, "last": 9}, None),
        # vLLM's: min_p; more tokens that end the answer; on past the end of sequence
        (
            {"prompt": LONG, "temperature": 1.5, "min_p": 0.9, "seed": 9},
            {"do_sample": True, "temperature": 1.5, "min_p": 0.9},
            9,
        ),
        ({"prompt": SHORT, "stop_token_ids": [stop]}, {"do_sample": False, "eos_token_id": [eos, stop]}, None),
        ({"prompt": LONG, "ignore_eos": True}, {"do_sample": False, "eos_token_id": []}, None),
    ]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": n, **line}) + "\n" for n, (line, _, _) in enumerate(lines))
    )
    generate(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", folder, "--seed", 100, "--temperature", 0, "--batch-size", 3
    )
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [answer["id"] for answer in answers] == list(range(len(lines)))
    for (line, settings, seed), answer in zip(lines, answers):
        ids = tokenizer(line["prompt"], return_tensors="pt").input_ids
        if {"penalties", "sequence_bias", "suppress_tokens", "bad_words_ids", "last"} & set(settings):
            assert answer["text"] != answers[1]["text"]  # (they change this answer)
        if "last" in settings:
            ids = ids[:, -settings.pop("last") :]
        if "penalties" in settings:
            settings = dict(settings)
            processor = PresenceFrequencyPenalty(ids.shape[1], *settings.pop("penalties"))
            settings["logits_processor"] = LogitsProcessorList([processor])
        tokens = reference(model, ids, seed, **{"max_new_tokens": NEW, **settings})
        assert answer["text"] == tokenizer.decode(tokens, skip_special_tokens=True), line
        assert answer["stats"]["new_tokens"] == len(tokens)
        ends = settings.get("eos_token_id", [model.generation_config.eos_token_id])
        assert answer["finish_reason"] == ("stop" if tokens[-1] in ends else "length")
    assert answers[-1]["finish_reason"] == "length" and answers[-2]["finish_reason"] == "stop"  # (they mattered)


def test_a_stop_string_ends_the_answer_before_it(eager_to_end, tmp_path) -> None:
    """OpenAI's "stop": generation stops at the first stop string, and the answer's text ends just before it (after
    it with vLLM's ``include_stop_str_in_output``)."""
    model, tokenizer = eager_to_end
    ids = tokenizer(LONG, return_tensors="pt").input_ids
    greedy = reference(model, ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=0, eos_token_id=None)
    whole = tokenizer.decode(greedy, skip_special_tokens=True)
    start = next(i for i in range(3, len(whole)) if whole.index(whole[i : i + 3]) == i)
    stop = whole[start : start + 3]  # (first found after a token or more)
    ends = [len(tokenizer.decode(greedy[:count])) for count in range(NEW + 1)]  # (the text of the first tokens)
    first = next(k for k in range(2, NEW - 3) if whole.index(whole[ends[k] : ends[k + 3]]) == ends[k])
    spanning = whole[ends[first] : ends[first + 3]]  # (a stop string of three whole tokens, first found there)
    folder, eos = tmp_path / "model", model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # (saved without one: the stop string ends it)
    try:
        model.save_pretrained(folder)
    finally:
        model.generation_config.eos_token_id = eos
    tokenizer.save_pretrained(folder)
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "a", "prompt": LONG, "stop": stop, "min_tokens": 0, "logprobs": True})
        + "\n"
        + json.dumps({"id": "b", "prompt": LONG, "stop": ["0123456789"], "min_tokens": 0, "logprobs": True})
        + "\n"
        + json.dumps({"id": "c", "prompt": LONG, "stop": spanning, "min_tokens": 0, "logprobs": True})
        + "\n"
        + json.dumps({"id": "d", "prompt": LONG, "stop": stop, "min_tokens": 0, "include_stop_str_in_output": True})
        + "\n"
    )
    generate(tmp_path / "in.jsonl", tmp_path / "out.jsonl", folder, "--temperature", 0)
    a, b, c, d = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert d["text"] == a["text"] + stop and d["finish_reason"] == "stop"  # (vLLM's: the stop string kept)
    assert a["text"] == whole[: whole.index(stop)] and a["finish_reason"] == "stop"
    assert b["text"] == whole and b["finish_reason"] == "length"
    # log probabilities: of every token of b's answer; of a's, only the tokens its text is made of (its text ends
    # within the last one listed, before the stop string)
    assert [entry["token"] for entry in b["logprobs"]] == [tokenizer.decode([token]) for token in greedy]
    listed = len(a["logprobs"])
    assert a["logprobs"] == b["logprobs"][:listed] and listed < NEW
    assert len(tokenizer.decode(greedy[: listed - 1])) < len(a["text"]) <= len(tokenizer.decode(greedy[:listed]))
    assert c["text"] == whole[: ends[first]] and c["logprobs"] == b["logprobs"][:first]  # (the stop's tokens left out)


def test_bench_batch_rows_decode_each_prompt_with_its_own_processors(eager_to_end) -> None:
    """specula bench's batch rows: a longer prompt after a shorter one keeps the minimum length of its own."""
    model, tokenizer = eager_to_end
    prompts = [tokenizer(text, return_tensors="pt").input_ids[0] for text in (SHORT, LONG, SHORT + " " + LONG)]
    outputs, _, _ = bench.specula_batch_method(model, specula.PromptLookup, do_sample=False)(prompts, NEW, 3)
    assert outputs == [reference(model, prompt[None], max_new_tokens=NEW, do_sample=False) for prompt in prompts]


def test_several_choices_are_each_model_generates_with_its_own_seed(eager_to_end, tmp_path) -> None:
    """OpenAI's ``n``: a sampled request's choice i is ``model.generate``'s after ``torch.manual_seed(seed + i)``,
    the choices sharing passes; a greedy one's n choices are one decode; usage counts every choice's tokens."""
    model, tokenizer = eager_to_end
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    lines = [
        {"id": "drawn", "prompt": LONG, "n": 3, "temperature": 0.9, "seed": 21, "min_tokens": 0},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": LONG, "n": 2, "seed": 4}},
        {"id": "greedy", "prompt": SHORT, "n": 2, "temperature": 0, "logprobs": True},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[::2]))
    (tmp_path / "batch.jsonl").write_text(json.dumps(lines[1]) + "\n")
    for name in ("in", "batch"):
        generate(
            tmp_path / f"{name}.jsonl", tmp_path / f"{name}_out.jsonl", folder, "--temperature", 1.0, "--batch-size", 4
        )
    drawn, greedy = [json.loads(line) for line in (tmp_path / "in_out.jsonl").read_text().splitlines()]
    ids = tokenizer(LONG, return_tensors="pt").input_ids
    expected = [
        tokenizer.decode(
            reference(model, ids, 21 + i, max_new_tokens=NEW, do_sample=True, temperature=0.9, min_new_tokens=0),
            skip_special_tokens=True,
        )
        for i in range(3)
    ]
    assert [choice["text"] for choice in drawn["choices"]] == expected and len(set(expected)) == 3
    assert [choice["index"] for choice in drawn["choices"]] == [0, 1, 2] and "text" not in drawn
    assert greedy["choices"][0] == greedy["choices"][1] | {"index": 0} and greedy["choices"][0]["logprobs"]
    (answer,) = [json.loads(line) for line in (tmp_path / "batch_out.jsonl").read_text().splitlines()]
    body = answer["response"]["body"]
    made = [reference(model, ids, 4 + i, max_new_tokens=NEW, do_sample=True) for i in range(2)]
    assert [choice["text"] for choice in body["choices"]] == [
        tokenizer.decode(t, skip_special_tokens=True) for t in made
    ]
    assert body["usage"]["completion_tokens"] == body["specula"]["new_tokens"] == sum(map(len, made))
    assert greedy["stats"]["new_tokens"] == len(greedy["choices"][0]["logprobs"])  # (one decode for both)
