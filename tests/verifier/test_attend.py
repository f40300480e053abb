"""specula's attention kernel for invariant passes on a CPU (:mod:`specula.verifier.attend`): torch's attention to
within rounding, and each query's result bit for bit the same whatever the call it is in (its batch, the other
queries of its pass, the keys the call covers beyond its own)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specula.verifier.attend import LANES, _largest, applies, attend, exp_below_zero, visibility


def _call(batch: int, n: int, keys: int, dim: int, dtype: torch.dtype, seed: int, group: int = 3):
    """Queries (``[B, heads, n, dim]``, as transformers passes them), keys and values as views of longer buffers (as
    the cache holds them), and a mask whose rows end at different keys, with holes (trees, windows)."""
    generator = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(batch, 2, keys + 40, dim, generator=generator).to(dtype) for _ in range(2)]
    query = torch.randn(batch, n, 2 * group, dim, generator=generator).to(dtype).transpose(1, 2)
    mask = torch.rand(batch, 1, n, keys, generator=generator) < 0.8
    for b in range(batch):
        for i in range(n):
            end = keys - n + i + 1 - 7 * b
            mask[b, 0, i, end:] = False
            mask[b, 0, i, end - 1] = True  # (a token sees itself)
    return query, buffers, mask


@pytest.mark.parametrize(
    ("dtype", "dim", "n", "tolerance"),
    [
        (torch.float32, 64, 1, 1e-5),
        (torch.float32, 32, 5, 1e-5),
        (torch.bfloat16, 64, 4, 1e-2),
        (torch.bfloat16, 128, 1, 1e-2),
    ],
)
def test_it_is_torchs_attention_within_rounding(dtype, dim, n, tolerance) -> None:
    query, (keys, values), mask = _call(3, n, 150, dim, dtype, seed=dim + n)
    key, value = keys[:, :, :150], values[:, :, :150]
    assert applies(query, key, value)
    got = attend(query, key, value, visibility(mask, 3, n, 150), 0.125)  # [B, n, heads, dim]
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(states.float() for states in (query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1))),
        attn_mask=mask,
        scale=0.125,
    ).transpose(1, 2)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_rounds_alike_whatever_its_call(dtype) -> None:
    """Each token of row 1, in a pass of 4 tokens of 3 rows, against the same query alone in a call of one token,
    one row, and 40 more keys masked (mutant: the largest score taken over every key the call covers)."""
    query, (keys, values), mask = _call(3, 4, 150, 64, dtype, seed=7)
    together = attend(query, keys[:, :, :150], values[:, :, :150], visibility(mask, 3, 4, 150), None)
    for token in range(4):
        wider = torch.cat([mask[1:2, :, token : token + 1], torch.zeros(1, 1, 1, 40, dtype=torch.bool)], dim=-1)
        alone = attend(query[1:2, :, token : token + 1], keys[1:2], values[1:2], visibility(wider, 1, 1, 190), None)
        assert torch.equal(alone[0, 0], together[1, token]), token


def test_bf16_is_the_fp32_of_its_values_rounded_as_torch_rounds() -> None:
    """A bf16 call computes in fp32 what an fp32 call over the same values computes, and rounds it to nearest even
    as torch does (mutants: the result's bits cut short; a bf16 key read as another number)."""
    query, (keys, values), mask = _call(3, 4, 150, 64, torch.bfloat16, seed=11)
    seen = visibility(mask, 3, 4, 150)
    got = attend(query, keys[:, :, :150], values[:, :, :150], seen, None)
    wide = attend(query.float(), keys.float()[:, :, :150], values.float()[:, :, :150], seen, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.to(torch.bfloat16))


def test_the_worked_example_and_a_query_that_sees_no_key() -> None:
    def head(*numbers: float) -> list[float]:  # (the example's numbers, a head of 8 dims: the rest 0)
        return [*numbers, *[0.0] * (8 - len(numbers))]

    query = torch.tensor([[[head(1.0, 0.0)]]])  # [B, heads, n, dim]
    key, value = (torch.tensor([[[head(*a), head(*b)]]]) for a, b in (((1, 0), (0, 1)), ((1, 2), (3, 4))))
    got = attend(query, key, value, visibility(None, 1, 1, 2), 1.0)
    assert torch.allclose(got[0, 0, 0], torch.tensor(head(1.538, 2.538)), atol=1e-3)
    nothing = attend(query, key, value, visibility(torch.zeros(1, 1, 1, 2, dtype=torch.bool), 1, 1, 2), 1.0)
    assert torch.equal(nothing, torch.zeros_like(nothing))  # (zeros, never NaN: it would reach the cache)


def test_its_exponential_is_within_two_ulp_down_to_underflow() -> None:
    x = np.concatenate([-np.geomspace(1e-6, 86.99, 5000), [0.0, -1.0, -87.0, -np.inf]]).astype(np.float32)
    out, bits = np.empty_like(x), np.empty(len(x), np.int32)
    exp_below_zero(x, len(x), out, bits)
    assert math.isclose(out[-3], 0.36787944, rel_tol=1e-7) and out[-4] == 1.0 and out[-2] == out[-1] == 0.0
    exact = np.exp(x[:-4].astype(np.float64))
    assert np.all(np.abs(out[:-4] - exact) <= 2 * np.spacing(exact.astype(np.float32)))


def test_a_querys_largest_score_in_running_maxima_is_its_largest() -> None:
    generator = np.random.default_rng(0)
    part = np.empty(LANES, np.float32)
    for n in [*range(1, 3 * LANES + 2), 700]:  # (a tail past the last whole vector, and none)
        x = np.minimum(generator.standard_normal(n), 4.0).astype(np.float32)
        x[generator.random(n) < 0.3] = -np.inf  # (masked keys)
        x[generator.integers(n)] = 5.0  # (the largest anywhere: in a vector or in the tail)
        assert _largest(x, n, part) == 5.0
        assert _largest(np.full(n, -np.inf, np.float32), n, part) == -np.inf


def test_only_a_cpus_bf16_and_fp32_rows_read_as_the_cache_holds_them() -> None:
    query, (keys, values), _ = _call(1, 1, 10, 16, torch.bfloat16, seed=0)
    assert applies(query, keys, values)
    assert not applies(query.half(), keys.half(), values.half())
    assert not applies(query, keys.transpose(2, 3).contiguous().transpose(2, 3), values)  # (keys not rows)
    odd = _call(1, 1, 10, 12, torch.bfloat16, seed=0)  # (a head of 12: a length it is not compiled for)
    assert not applies(odd[0], *odd[1])


def test_in_parallel_or_in_turn_the_same_bits(monkeypatch) -> None:
    """A call's heads read in parallel (much work) or on one thread (little) give every query the same bits."""
    from specula.verifier import attend as attend_module

    query, (keys, values), mask = _call(3, 4, 150, 64, torch.bfloat16, seed=3)
    runs = []
    for work in (0, 10**9):  # (every call in parallel; none)
        monkeypatch.setattr(attend_module, "PARALLEL_WORK", work)
        runs.append(attend(query, keys[:, :, :150], values[:, :, :150], visibility(mask, 3, 4, 150), None))
    assert torch.equal(runs[0], runs[1])
