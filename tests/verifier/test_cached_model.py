"""The verifier's KV cache: preallocated full-attention layers give exactly DynamicCache's logits."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import arena_on_cpu, written_with_room
from tiny_models import ARCHITECTURES, VOCAB, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specula.machine.memory import resident_bytes
from specula.verifier import cache_layers, runner
from specula.verifier.cache_layers import PreallocatedLayer
from specula.verifier.runner import OneSequence, RaggedRows


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_preallocated_cache_matches_dynamic_cache(name, monkeypatch):
    """Blocks of varied length with rollbacks, past a capacity chosen too small (so the buffer grows twice): every
    logit equals the one a plain DynamicCache gives (both passes with torch's thread count, which the thread choice
    would alternate between them at first)."""
    monkeypatch.setattr(runner, "thread_choice", lambda model: None)
    model = tiny_model(name)
    generator = torch.Generator().manual_seed(1)
    blocks = [torch.randint(3, VOCAB, (length,), generator=generator) for length in (9, 1, 4, 6, 1, 3, 5, 2)]
    preallocated = OneSequence(model, rollback=True, capacity=5)
    dynamic = OneSequence(model, rollback=True)
    dynamic.cache = DynamicCache(config=model.config)
    dynamic.cache.activate_past_recording()
    for block in blocks:
        for cached in (preallocated, dynamic):
            cached.logits = cached.forward(block, num_logits=len(block))
            cached.rollback(len(block) // 2)
        torch.testing.assert_close(preallocated.logits, dynamic.logits, rtol=0, atol=0)
    for ours, theirs in zip(preallocated.cache.layers, dynamic.cache.layers):  # sliding-window layers stay as they are
        assert type(ours) is (PreallocatedLayer if type(theirs) is DynamicLayer else type(theirs))
        if isinstance(ours, PreallocatedLayer):
            assert ours.capacity >= ours.get_seq_length() == preallocated.cached_tokens > 5


def test_crop_takes_a_negative_count():
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="minus the number of tokens"):
        layer.crop(2)
    layer.crop(-2)
    assert layer.get_seq_length() == 1


def held(target) -> int:
    """The bytes of keys and values ``target``'s cache holds (paged: written and not given back)."""
    return sum(layer.held_bytes() for layer in target.cache.layers if isinstance(layer, PreallocatedLayer))


@pytest.fixture(params=["paged", "rectangle", "arena"])
def paged(request, monkeypatch) -> bool:
    """Every kind of buffers: paged (the CPU's), rectangles of the rows in use (devices without either), and one
    arena for all layers' rows (a GPU's, here over the CPU's pages)."""
    if request.param == "rectangle":
        monkeypatch.setattr(cache_layers, "PAGED", ())
    if request.param == "arena":
        arena_on_cpu(monkeypatch)
    return request.param != "rectangle"


def test_the_room_a_long_request_took_is_given_back_when_it_leaves(paged) -> None:
    """Two rows, one of 400 tokens: the cache grows to hold it; once it left (and when another request takes its
    slot), it holds what the short row alone holds (paged), or buffers as short as the rows in use need, and the
    short row goes on computing what it would have without it (up to fp32 rounding: views of other lengths).
    Mutants: pages not given back; rectangles not trimmed."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(0))
    target = RaggedRows(model, rollback=True, capacity=16, slots=2)
    alone = RaggedRows(model, rollback=True, capacity=16, slots=2)  # (no long row)
    for cached in (target, alone):
        cached.start_row(0, ids[:10])
    target.start_row(1, ids)
    layer = target.cache.layers[0]
    assert layer.capacity >= 400 and held(target) > 4 * held(alone)
    target.select_rows([0])  # (the long request ended)
    assert held(target) == held(alone) if paged else layer.capacity <= 32
    step = [ids[10:13]]
    torch.testing.assert_close(target.forward_rows(step, [3])[0], alone.forward_rows(step, [3])[0])  # (fp32 rounding)
    target.start_row(1, ids)  # (the slot taken by another long one, then by a short one)
    target.start_row(1, ids[:12])
    alone.start_row(1, ids[:12])
    assert held(target) == held(alone) if paged else layer.capacity <= 32


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_prompt_is_written_straight_into_its_row(name, paged) -> None:
    """A request's prompt, computed alone as ``model.generate`` computes it, writes its full-attention keys and
    values into its row of the batch as they are computed: during the prefill no cache layer holds them apart
    (mutant: computed into a DynamicCache, then copied); its logits are a DynamicCache's bit for bit, and the next
    pass's too up to fp32 rounding (a batch's pass: other shapes). Sliding-window layers are computed apart and
    copied, as before."""
    model = tiny_model(name)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    target = RaggedRows(model, rollback=True, capacity=16, slots=2)
    target.start_row(0, ids[:7])
    seen = []

    def held_apart(module, args, kwargs, output) -> None:  # (the cache the prefill's last layer was given)
        seen.extend(
            layer.keys.untyped_storage().data_ptr() != batch._key_buffer.untyped_storage().data_ptr()
            for cache in (*args, *kwargs.values())
            if isinstance(cache, DynamicCache)
            for layer, batch in zip(cache.layers, target.cache.layers)
            if type(layer) is not DynamicSlidingWindowLayer and isinstance(batch, PreallocatedLayer)
        )

    last = model.base_model.layers[-1] if hasattr(model.base_model, "layers") else model.base_model.h[-1]
    hook = last.register_forward_hook(held_apart, with_kwargs=True)
    logits = target.start_row(1, ids[:30])
    hook.remove()
    full = [layer for layer in target.cache.layers if type(layer) is PreallocatedLayer and not layer.sliding_window]
    assert len(seen) == len(full) and not any(seen)  # (Mistral's layers all slide: none)
    alone = {target.cache_argument: DynamicCache(config=model.config), "use_cache": True}
    with torch.no_grad():
        expected = model(ids[None, :30], logits_to_keep=1, **alone).logits[0]
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        step = model(ids[None, 30:33], **alone).logits[0]
    torch.testing.assert_close(target.forward_rows([ids[7:9], ids[30:33]], [2, 3])[1], step)  # (fp32: other shapes)


@pytest.mark.parametrize("order", [[0, 2], [2, 0]])
def test_the_last_row_takes_the_slot_of_one_that_left(paged, order) -> None:
    """Row 1 of 3 left and row 2 took its slot (``select_rows([0, 2])``, as the loop asks), or rows moved where
    others moved from (``[2, 0]``): each row goes on as it would alone (up to fp32 rounding: other shapes), paged or
    rectangle (mutants: the row's cache not moved; a chain's rows not copied first)."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    prompts, step = [ids[:10], ids[10:40], ids[40:52]], [ids[:2], ids[5:8]]
    target = RaggedRows(model, rollback=True, capacity=16, slots=3)
    for row, prompt in enumerate(prompts):
        target.start_row(row, prompt)
    target.select_rows(order)
    for row, (prompt, block) in enumerate(zip([prompts[i] for i in order], step)):
        alone = RaggedRows(model, rollback=True, capacity=16, slots=1)
        alone.start_row(0, prompt)
        torch.testing.assert_close(target.forward_rows(step, [2, 3])[row], alone.forward_rows([block], [len(block)])[0])
        target.keep_rows([0, 0])  # (the pass forgotten: the next row's turn)
        assert target.arena is None or written_with_room(target.arena)


def test_a_short_row_beside_a_long_one_holds_its_own_tokens() -> None:
    """Paged buffers: rows of 400 and 10 tokens hold what each would alone, not twice the long one (mutant:
    buffers of zeros taken whole, as a rectangle's)."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(0))
    both, long, short = (RaggedRows(model, rollback=True, capacity=16, slots=2) for _ in range(3))
    both.start_row(0, ids)
    both.start_row(1, ids[:10])
    long.start_row(0, ids)
    short.start_row(0, ids[:10])
    both.forward_rows([ids[:3], ids[:3]], [3, 3])  # (attention reads the short row's unwritten tokens: no memory)
    long.forward_rows([ids[:3]], [3])
    short.forward_rows([ids[:3]], [3])
    assert held(both) == held(long) + held(short) < 1.3 * held(long)  # (rows of whole pages; a rectangle: 2x)


def test_buffers_hold_the_rows_in_use_not_every_slot(paged) -> None:
    """Eight slots: one request's cache holds one row, five requests' five, and once four left, one again; the rows
    that stay compute what they would have alone (up to fp32 rounding: views of other shapes)."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    target = RaggedRows(model, rollback=True, capacity=64, slots=8)
    alone = RaggedRows(model, rollback=True, capacity=64, slots=8)
    alone.start_row(0, ids[:10])
    target.start_row(0, ids[:10])
    layer = target.cache.layers[0]
    assert held(target) == held(alone)
    for row in range(1, 5):
        target.start_row(row, ids[: 10 + row])
    assert 5 * held(alone) <= held(target) <= 8 * held(alone) and len(layer.keys) == 5
    target.select_rows([0])
    assert held(target) <= 2 * held(alone) and len(layer.keys) == 1
    step = [ids[10:13]]
    torch.testing.assert_close(target.forward_rows(step, [3])[0], alone.forward_rows(step, [3])[0])
    target.start_row(1, ids[:20])  # (a new request takes the next slot: room again)
    assert len(layer.keys) == 2


def test_a_budgets_ceiling_bounds_growth_and_trims_at_once(monkeypatch) -> None:
    """A layer held to 2 rows of 100 tokens grows to 100, not by doubling to 120, and its rows to 2, not 4; a
    ceiling under what it holds trims it at once, never under the rows' own tokens (mutant: no ceiling, 120).
    Rectangles (paged buffers hold what rows wrote, whatever their shape)."""
    monkeypatch.setattr(cache_layers, "PAGED", ())
    layer = PreallocatedLayer(capacity=60)
    layer.put_row(0, torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), slots=8, end=10)
    layer.ceiling = (2, 100)
    layer.put_row(1, torch.zeros(1, 2, 70, 8), torch.zeros(1, 2, 70, 8), slots=8, end=70)
    assert layer.capacity == 100 and layer._key_buffer.shape[:3] == (2, 2, 100)
    layer.length, layer.ceiling = 70, (2, 80)
    layer.fit(70)
    assert layer.capacity == 80 and layer._key_buffer.shape[2] == 80
    layer.ceiling = (2, 50)
    layer.fit(70)
    assert layer.capacity == 70


@pytest.mark.skipif(resident_bytes() is None, reason="reads the resident set from /proc/self/statm (Linux)")
def test_a_grown_cache_holds_its_new_buffers_not_the_old_ones_too(paged) -> None:
    """Ten layers of a batch's cache double their rows' room, each buffer of 24 MB becoming 48 MB: the resident set
    grows by the new buffers less the old ones, not by the new ones (C's heap keeping what the old ones freed:
    mutant, no trim, twice that), and paged buffers by nothing (they hold the rows' tokens only). A freed 24 MB block
    first sets glibc's mmap threshold over the old buffers' size, as a server's passes do, so that they come from the
    heap; small blocks that stay between them (a server's other tensors) keep the heap from shrinking by itself."""
    freed = torch.ones(6 << 20)
    del freed
    layers, block, between = [PreallocatedLayer(capacity=6144) for _ in range(10)], torch.ones(1, 4, 6144, 64), []
    for layer in layers:
        for row in range(4):
            layer.put_row(row, block, block, slots=4, end=6144)
        layer.row_starts, layer.length = torch.full((4,), 6144), 6144
        between.append(torch.ones(1024))
    old = sum(layer._key_buffer.nbytes + layer._value_buffer.nbytes for layer in layers)
    gc.collect()  # (what earlier tests left in cycles freed before, not during, the measurement)
    before = resident_bytes()
    for layer in layers:
        layer._grow(6145)
    new = sum(layer._key_buffer.nbytes + layer._value_buffer.nbytes for layer in layers)
    assert new == 2 * old and all(bool((layer.keys == 1).all()) for layer in layers)
    gc.collect()
    # (paged: a fifth of the old buffers' size, for the process's other threads; the mutant adds all of them)
    assert resident_bytes() - before < (0.2 * old if paged else (new - old) * 1.3)


def test_an_arenas_rows_are_given_room_before_each_write(monkeypatch) -> None:
    """A batch's arena (a GPU's, here over the CPU's pages): prompts and passes that cross into pages their rows had
    not held yet write only where the arena gave them room first (mutant: a pass's writes without room, which on a
    GPU land in the chunk of zeros every unwritten token reads), and each row computes what it would alone."""
    arena_on_cpu(monkeypatch)
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    target = RaggedRows(model, rollback=True, capacity=16, slots=2)
    prompts = [ids[:14], ids[14:44]]
    for row, prompt in enumerate(prompts):
        target.start_row(row, prompt)
    page_tokens = target.arena.pages.granule // (target.arena.token * 4)  # (fp32)
    assert target.arena is not None and 14 < page_tokens < 30 + 4 < 2 * page_tokens + 4
    for width in (4, 8, 8):  # (rows cross into their next pages)
        blocks = [ids[44 : 44 + width], ids[50 : 50 + width]]
        logits = target.forward_rows(blocks, [width, width])
        target.keep_rows([width, width])
        assert written_with_room(target.arena)
    for row, prompt in enumerate(prompts):
        alone = RaggedRows(model, rollback=True, capacity=16, slots=1)
        alone.start_row(0, prompt)
        for width in (4, 8):
            alone.forward_rows([ids[44 + 6 * row : 44 + 6 * row + width]], [width])
            alone.keep_rows([width])
        expected = alone.forward_rows([ids[44 + 6 * row : 52 + 6 * row]], [8])[0]
        torch.testing.assert_close(logits[row], expected)


def test_a_pass_that_loaded_a_kernels_code_is_no_measure_of_its_cost(monkeypatch) -> None:
    """A kernel's first call in a process reads its machine code from disk (tens of milliseconds): the pass that made
    it is not timed, the next one is (mutant: the kernels' code not looked at fails)."""

    class Kernel:  # (a numba dispatcher's signatures: one more once a call loaded its code)
        signatures: list = []

    model = tiny_model("llama")
    monkeypatch.setattr(runner, "KERNELS", (Kernel,))
    target = RaggedRows(model, rollback=True, capacity=16, slots=2)
    with torch.inference_mode():
        for row in range(2):
            target.start_row(row, torch.tensor([1, 2, 3 + row]))
        target.forward_rows([torch.tensor([4]), torch.tensor([5])], [1, 1])  # (its measurements made)
        loads = model.model.layers[0].register_forward_hook(lambda *_: Kernel.signatures.append("loaded"))
        target.forward_rows([torch.tensor([6]), torch.tensor([7])], [1, 1])
        assert not target.timed
        loads.remove()
        target.forward_rows([torch.tensor([8]), torch.tensor([9])], [1, 1])
        assert target.timed
