"""Row-exact strategies: only exact ones are ever chosen, the cheapest of them by the clock, and calibrations are
kept on disk per machine, torch, shape and dtype (specula.machine.store, specula.verifier.row_exact)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import transformers
from helpers import TickingClock
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import specula
from specula.decoding.loop import MAX_DRAFT
from specula.machine import store, timing
from specula.policy.costs import shared_pass_costs
from specula.verifier.row_exact import attention, grouping, linear

HEADS, KV_HEADS, DIM = 4, 2, 16


class _Module:  # what HF's attention functions read off an attention module
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _kernel(block_sums: bool):
    """An attention kernel with the signature of torch's ``scaled_dot_product_attention``: exact math but for its
    weighted sum over keys, taken key after key, or (``block_sums``) as MKL's bf16 gemm does on a 2-core EPYC:
    full blocks of 4 keys first, each summed on its own, then the ``K % 4`` last keys one by one, so that padding a
    query's keys past a multiple of 4 (zero weights) changes the order its last keys are added in."""

    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, scale=None, enable_gqa=False, is_causal=False):
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], 1).double() for t in (key, value))
        scores = query.double() @ key.transpose(-1, -2) * (scale or DIM**-0.5)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        # unnormalised weights in bf16, as the flash kernel keeps them; sums of them in float64 (no order effects)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True)).to(query.dtype).float()  # [B, heads, q, keys]
        terms = weights[..., None] * value.float()[:, :, None]  # [B, heads, q, keys, dim]
        keys = terms.shape[3]
        total = torch.zeros_like(terms[:, :, :, 0])
        step = 4 if block_sums else 1
        for start in range(0, keys - keys % step, step):
            block = terms[:, :, :, start]
            for j in range(start + 1, start + step):
                block = block + terms[:, :, :, j]
            total = total + block
        for j in range(keys - keys % step, keys):
            total = total + terms[:, :, :, j]
        return (total.double() / weights.double().sum(-1, keepdim=True)).to(query.dtype)  # [B, heads, q, dim]

    return kernel


def _exact_widths(monkeypatch, block_sums: bool) -> list[int]:
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _kernel(block_sums))
    return grouping._exact_widths(
        _Module(), sdpa_attention_forward, HEADS, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"), {}
    )


def test_grouping_is_exact_only_where_the_kernels_order_allows(monkeypatch) -> None:
    """A kernel that adds keys in order allows every grouping; one that orders a query's last keys by blocks of 4
    allows groups of 2 and 4 only (the mutant check on Gaussian data alone lets 8 and 16 through: see below)."""
    assert _exact_widths(monkeypatch, block_sums=False) == [1, 2, 4, 8, 16]
    assert _exact_widths(monkeypatch, block_sums=True) == [1, 2, 4]


def test_gaussian_data_alone_would_miss_the_block_order(monkeypatch) -> None:
    """The mutant: without the rows built to show a changed order, the blocked kernel passes for every width, which
    is how groups of 16 came to be used on the EPYC and changed an output after 706 keys."""

    def without_cancellation(heads, kv_heads, dim, dtype, device, width, rows, generator):
        q, k, v, ends, targets = cancelling(heads, kv_heads, dim, dtype, device, width, rows, generator)
        return q, k, torch.randn(v.shape, generator=generator).to(dtype), ends, targets

    cancelling = grouping._cancelling_rows
    monkeypatch.setattr(grouping, "_cancelling_rows", without_cancellation)
    assert _exact_widths(monkeypatch, block_sums=True) == [1, 2, 4, 8, 16]


class _FakeClock:
    """A clock that advances by ``costs[width]`` for every grouped attention call of that width."""

    def __init__(self, costs: dict[int, float]) -> None:
        self.now, self.costs = 0.0, costs

    def __call__(self) -> float:
        return self.now


def _calibrate_with_costs(monkeypatch, block_sums: bool, costs: dict[int, float]) -> dict:
    clock = _FakeClock(costs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _kernel(block_sums))
    grouped = grouping._grouped_sdpa

    def timed(module, query, key, value, ends, width, **kwargs):
        clock.now += costs[width]
        return grouped(module, query, key, value, ends, width, **kwargs)

    monkeypatch.setattr(timing, "CLOCK", clock)
    monkeypatch.setattr(grouping, "_grouped_sdpa", timed)
    return grouping._calibrate_attention(
        _Module(), sdpa_attention_forward, HEADS, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"), {}
    )


def test_the_cheapest_exact_grouping_is_chosen_and_an_inexact_fast_one_never(monkeypatch) -> None:
    costs = {1: 9.0, 2: 5.0, 4: 7.0, 8: 1.0, 16: 0.5}
    assert _calibrate_with_costs(monkeypatch, False, costs)["width"] == 16
    assert _calibrate_with_costs(monkeypatch, True, costs)["width"] == 2
    found = _calibrate_with_costs(monkeypatch, True, {**costs, 1: 0.1})
    assert found["width"] == 1 and found["exact_ms"] == pytest.approx(0.1 * 1e3)


def test_linear_layers_take_the_cheaper_exact_strategy(monkeypatch) -> None:
    """By columns where it is exact and the clock says it is cheaper; as the layer is where that is cheaper."""
    clock = _FakeClock({})

    class Timed(torch.nn.Linear):
        def forward(self, x):  # 10 a call: as the layer is, a pass of 9 rows takes 9 calls (exact for 1 row)
            clock.now += 10.0
            return super().forward(x)

    layer = Timed(1536, 64, bias=False).to(torch.bfloat16)
    monkeypatch.setattr(timing, "CLOCK", clock)
    monkeypatch.setattr(linear, "exact_rows", lambda layer, compute=None: 1 if compute is None else 33)
    monkeypatch.setattr(linear, "_packed", lambda layer: False)  # (its forward only counts: nn.Linear's product)
    for by_columns_cost, expected in ((1.0, True), (100.0, False)):

        def by_columns(weight_t, bias, x, cost=by_columns_cost):
            clock.now += cost
            return x @ weight_t

        monkeypatch.setattr(linear, "_by_columns", by_columns)
        found = linear._calibrate(layer)
        assert found["by_columns"] is expected and (found["rows"], found["columns"]) == (1, 33)


def test_calibrations_are_kept_and_made_again_when_what_they_depend_on_changes(
    fresh_store, monkeypatch, tmp_path
) -> None:
    made = []
    key = store.key(torch.device("cpu"), "attention", 4, 2, 16, torch.bfloat16, None)
    assert store.shared().get(key, lambda: made.append(1) or {"width": 4}) == {"width": 4}
    store.forget()  # a new process: read from the file, not made again
    assert store.shared().get(key, lambda: made.append(1) or {"width": 8}) == {"width": 4}
    assert len(made) == 1 and key in json.loads(fresh_store.read_text())
    changed = [
        store.key(torch.device("cpu"), "attention", 4, 2, 16, torch.float16, None),  # dtype
        store.key(torch.device("cpu"), "attention", 8, 2, 16, torch.bfloat16, None),  # shape
    ]
    monkeypatch.setattr(torch, "__version__", "99.0")
    changed.append(store.key(torch.device("cpu"), "attention", 4, 2, 16, torch.bfloat16, None))
    monkeypatch.setattr(store, "PASSES", store.PASSES + 1)  # specula computes its passes otherwise
    changed.append(store.key(torch.device("cpu"), "attention", 4, 2, 16, torch.bfloat16, None))
    monkeypatch.setattr(store, "device_name", lambda device: "another CPU")
    changed.append(store.key(torch.device("cpu"), "attention", 4, 2, 16, torch.bfloat16, None))
    for other in changed:
        assert other != key and store.shared().get(other, lambda: made.append(1) or {"width": 1}) == {"width": 1}
    assert len(made) == 1 + len(changed)
    store.forget()


def test_a_pass_that_calibrates_is_not_taken_for_what_passes_cost(fresh_store, monkeypatch, tmp_path) -> None:
    """The first row-exact pass calibrates attention, which takes seconds on a real model. Timed, that pass made
    the cost model take drafts for ruinous and never send one again (Qwen2.5-Coder-1.5B on a 2-core EPYC: 0.99x
    HF greedy on the first run, 2.05x on later ones). Here calibrating takes 1000 s longer on a fake clock: no pass
    cost the cost model keeps may include it (the mutant that times every pass keeps a cost over 1000 s)."""
    calibrate, clock = grouping._calibrate_attention, TickingClock()

    def slow(*args, **kwargs):
        clock.jump(1000.0)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(attention, "_calibrate_attention", slow)
    monkeypatch.setattr(time, "perf_counter", clock)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompt = torch.arange(3, 35).repeat(4)[None]
    out = specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=24, eos_token_id=[], exact=True)
    assert store.shared().made > 0 and out.stats.passes > 1
    costs = shared_pass_costs(model, (model.device, model.dtype), MAX_DRAFT)
    assert costs.samples and max(seconds for samples in costs.samples.values() for _, seconds in samples) < 1000.0
    store.forget()


def test_calibrating_draws_none_of_torchs_global_random_numbers() -> None:
    """Seeded sampling draws from torch's global generator, as model.generate does: a first run that calibrates
    must leave it alone, or that run would not draw model.generate's tokens."""
    layer = torch.nn.Linear(1536, 64, bias=False).to(torch.bfloat16)  # (making it draws: before)
    state = torch.get_rng_state()
    linear._calibrate(layer)
    grouping._calibrate_attention(
        _Module(), sdpa_attention_forward, HEADS, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"), {}
    )
    assert torch.equal(torch.get_rng_state(), state)
