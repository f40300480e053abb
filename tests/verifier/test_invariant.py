"""Invariant ordinary passes (bf16; the default on a CPU where verification is not exact, or ``exact="invariant"``):
where the live check finds that every row of a pass rounds as its one-token steps do, whatever the pass's width and
batch mates, output follows neither the draft lengths nor the batch, and draft lengths may follow the clock."""

from __future__ import annotations

import pytest
import torch
from bf16_cases import CONFIGS, NEW_TOKENS, model, prompt, reference
from helpers import Oracle

import specula
from specula.machine import store
from specula.verifier import invariant


def _decode(name: str, draft: int, adaptive: bool = False) -> specula.GenerateOutput:
    return specula.generate(
        model(name),
        prompt(),
        Oracle(reference(name), draft),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        exact="invariant",
        adaptive_draft=adaptive,
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_where_the_check_holds_output_follows_no_draft_length(fresh_store, name) -> None:
    """Drafts of 1, 5 and 16 tokens every pass, and as the cost model sizes them: the same tokens where the check
    holds (on the AVX512_BF16 EPYC it holds for all four models); where it does not, the loop does not claim it."""
    runs = [_decode(name, draft) for draft in (1, 5, 16)] + [_decode(name, 8, adaptive=True)]
    holds = invariant.holds(model(name))
    assert all(run.stats.exactness.invariant is holds for run in runs)
    assert all(run.stats.drafted for run in runs)
    if holds:
        assert all(run.sequences.tolist() == runs[0].sequences.tolist() for run in runs)
        assert "invariant to drafts and batches" in str(runs[0].stats.exactness)
    default, ordinary = (
        specula.generate(model(name), prompt(), Oracle(reference(name), 5), max_new_tokens=8, eos_token_id=[], **how)
        for how in ({}, {"exact": False})
    )
    assert default.stats.exactness.invariant is (holds and not default.stats.exactness.exact)  # (where not exact)
    assert not ordinary.stats.exactness.invariant  # (exact=False: the cheapest passes)


def test_seeded_sampling_follows_no_draft_length(fresh_store) -> None:
    """Sampled with a seed, drafts of 1, 5 and 16 tokens every pass draw the same tokens where the check holds (each
    token drawn from the same logits, as model.generate draws it)."""
    model_, prompt_, reference_ = model("llama"), prompt(), reference("llama")  # (built before the seed: not drawn)
    runs = []
    for draft in (1, 5, 16):
        torch.manual_seed(3)
        runs.append(
            specula.generate(
                model_,
                prompt_,
                Oracle(reference_, draft),
                max_new_tokens=NEW_TOKENS,
                eos_token_id=[],
                do_sample=True,
                temperature=1.5,
                exact="invariant",
                adaptive_draft=False,
            ).sequences.tolist()
        )
    if invariant.holds(model_):
        assert runs[1] == runs[0] and runs[2] == runs[0]


def test_where_the_check_holds_a_row_decodes_as_alone_whatever_its_batch(fresh_store) -> None:
    """Three requests of different lengths in one batch, each also alone: the same tokens, where the check holds."""
    model_ = model("llama")
    prompts = [prompt()[0, :length] for length in (300, 217, 120)]
    decoder = specula.Decoder(model_, Oracle([reference("llama")] * 3, 6), slots=3, exact="invariant")
    together = {
        row.job.key: row.output.tolist()
        for row, _ in decoder.run([specula.Job(p.numpy(), NEW_TOKENS, key=k) for k, p in enumerate(prompts)])
        if row.finished
    }
    alone = [
        specula.generate(
            model_,
            p[None],
            Oracle(reference("llama"), 3),
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            exact="invariant",
        )
        for p in prompts
    ]
    if invariant.holds(model_):
        assert decoder.policy.timed  # (draft lengths may follow the clock: output does not depend on them)
        assert [together[k] for k in range(3)] == [
            run.sequences[0, len(p) :].tolist() for run, p in zip(alone, prompts)
        ]


@pytest.mark.parametrize("kernel", [True, False])
def test_a_pass_whose_rows_follow_its_width_fails_the_check(fresh_store, monkeypatch, kernel) -> None:
    """A stand-in attention whose result for a query depends on how many queries share its call (as unpadded kernels'
    may), specula's kernel (a CPU's) or the padded blocks (a GPU's): the check finds it (mutant: the check compares
    nothing)."""
    if kernel:
        real = invariant.attend
        wider = invariant.STEP_WIDTH  # (a call of more queries than a step's: another rounding)
        monkeypatch.setattr(invariant, "attend", lambda q, *rest: real(q, *rest) * (1.0 + 0.01 * (q.shape[2] > wider)))
    else:
        real = torch.nn.functional.scaled_dot_product_attention

        def width_dependent(query, key, value, *args, **kwargs):
            return real(query, key, value, *args, **kwargs) * (1.0 + 0.01 * (query.shape[2] % 3 == 0))

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", width_dependent)
        monkeypatch.setattr(invariant, "applies", lambda *states: False)
    assert not invariant.holds(model("qwen2"))


def test_the_padding_and_the_two_token_step_remove_what_kernels_round_by(fresh_store, monkeypatch) -> None:
    """Stand-ins for the kernels traced on the AVX512_BF16 EPYC: attention whose result depends on its call's keys
    modulo 512 and queries modulo 4, and linear layers whose one-row products round otherwise than several rows'. The
    invariant passes give every row its steps' bits anyway (mutants: keys or queries not padded, a single row's step
    computed over one token)."""
    from specula.verifier import runner

    real_attention, real_linear = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.linear

    def blocked_attention(query, key, value, *args, **kwargs):
        skew = key.shape[2] % 512 + query.shape[2] % 4
        return real_attention(query, key, value, *args, **kwargs) * (1.0 + 0.01 * skew)

    def matrix_vector(x, weight, bias=None):
        return real_linear(x, weight, bias) * (1.0 + 0.01 * (x.dim() > 1 and x.shape[-2] * x[..., 0, 0].numel() == 1))

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", blocked_attention)
    monkeypatch.setattr(invariant, "applies", lambda *states: False)  # (the padded blocks: a GPU's way)
    monkeypatch.setattr(torch.nn.functional, "linear", matrix_vector)
    monkeypatch.setattr(runner, "packed_for", lambda model, **_: None)  # (every product through the stand-in)
    assert invariant.holds(model("llama"))


def test_products_past_the_rows_a_kernel_rounds_alike_for_are_computed_in_chunks(fresh_store, monkeypatch) -> None:
    """A stand-in for oneDNN's bf16 products on the AMX Xeon, whose rows round otherwise past 32 rows (here 16): the
    rows they round alike for are found, passes of 41 tokens compute their products in chunks, and drafts of 5 and 40
    tokens decode alike, the check holding; without the chunks, the check fails (mutant: passes not chunked)."""
    import contextlib

    from specula.verifier import runner

    reference("llama")  # (model.generate's output is cached for other tests: computed before the stand-in)
    real_linear = torch.nn.functional.linear

    def blocked(x, weight, bias=None):
        return real_linear(x, weight, bias) * (1.0 + 0.01 * (x.numel() // x.shape[-1] > 16))

    monkeypatch.setattr(torch.nn.functional, "linear", blocked)
    monkeypatch.setattr(runner, "packed_for", lambda model, **_: None)  # (every product through the stand-in)
    model_ = model("llama")
    target = runner.RaggedRows(model_, rollback=True, capacity=400, invariant=True, cheap_steps=True)
    assert target.product_rows == 16
    assert invariant.holds(model_)
    runs = [_decode("llama", draft) for draft in (5, 40)]
    assert all(run.stats.exactness.invariant for run in runs)
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()
    monkeypatch.setenv("SPECULA_CALIBRATIONS", str(fresh_store.with_name("unchunked.json")))
    store.forget()
    monkeypatch.setattr(runner, "chunked_products", lambda model, rows: contextlib.nullcontext())
    assert not invariant.holds(model_)


def test_padded_keys_are_read_from_the_cache_buffer_as_they_are(monkeypatch) -> None:
    """Keys and values that are a view of a longer buffer (the cache's) are padded by reading further in it, not by a
    copy, and give the bits of zero padding whatever lies there (finite states a rollback forgot; mutant: always
    copied)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    torch.manual_seed(0)
    buffers = [torch.randn(2, 3, 2 * invariant.KEY_BLOCK, 16, dtype=torch.bfloat16) * 4 for _ in range(2)]
    key, value = (buffer[:, :, :600] for buffer in buffers)  # [B, kv_heads, keys, dim]: rows of 600 keys
    query = torch.randn(2, 6, 5, 16, dtype=torch.bfloat16)  # [B, heads, n, dim]: two query heads a kv head
    mask = torch.ones(2, 1, 5, 600, dtype=torch.bool)
    mask[1, :, :, 590:] = False  # (a shorter row)
    real, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, *args, **kwargs):
        seen.append(key.data_ptr())
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(invariant, "applies", lambda *states: False)  # (the padded blocks: a GPU's way)
    with invariant.invariant_attention():
        attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        in_place = attention(None, query, key, value, mask)[0]
        copied = attention(None, query, key.clone(), value.clone(), mask)[0]
    assert seen[0] == buffers[0].data_ptr() and seen[1] != seen[0]
    assert torch.equal(in_place, copied)


def test_by_default_only_a_cpu_takes_them(fresh_store, monkeypatch) -> None:
    """The default takes invariant passes on a CPU only (a GPU's attention kernels are not traced); asked for, any
    device where the check holds (mutant: the device not looked at)."""
    from specula.decoding import loop

    model_ = model("llama")
    if not invariant.holds(model_):
        pytest.skip("the check does not hold for this model on this machine")
    monkeypatch.setattr(loop, "model_device", lambda model: torch.device("cuda"))  # (as a GPU's model says)
    default, asked = (
        specula.Decoder(model_, specula.PromptLookup(), slots=2, exact=e).prepare() for e in (None, "invariant")
    )
    assert not default.exactness.invariant and asked.exactness.invariant


def test_a_flat_pass_is_a_padded_pass_bit_for_bit(fresh_store) -> None:
    """Three rows of different lengths send 1 to 4 tokens a pass: flat (each row's tokens only, one row of queries)
    and padded to the widest, the same logits bit for bit, pass after pass (what each keeps moves its rows on)
    (mutants: a token's position counted from the pass's start, a row's keys written into the next row's)."""
    from specula.verifier.runner import RaggedRows

    model_ = model("llama")
    prompts = [prompt()[0, :length] for length in (90, 61, 120)]
    runs = []
    for flat in (True, False):
        target = RaggedRows(model_, rollback=True, capacity=160, slots=3, cheap_steps=True, invariant=True)
        target.flat_passes = flat
        for row, tokens in enumerate(prompts):
            target.start_row(row, tokens)
        got = []
        for step in range(4):
            lengths = [1 + (step + row) % 4 for row in range(3)]
            blocks = [prompt()[0, 130 + 5 * step + row : 130 + 5 * step + row + n] for row, n in enumerate(lengths)]
            assert target.flat(blocks, None) is flat
            got.append(target.forward_rows(blocks, lengths))
            target.keep_rows([max(1, n - 1) for n in lengths])
        runs.append(got)
    assert all(torch.equal(a, b) for flat, padded in zip(*runs) for a, b in zip(flat, padded))
