"""Compiled passes of static shapes (specula.verifier.static): the same tokens as model.generate, a handful of graphs
for every pass, and the choice to compile under fake clocks."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from helpers import Oracle, arena_on_cpu, hf_greedy, written_with_room
from tiny_models import VOCAB, tiny_model

import specula
from specula.hf.inputs import left_padded
from specula.verifier import cache_layers, static
from specula.verifier.runner import CachedModel, RaggedRows
from specula.verifier.support import UnsupportedModelError


def graphs() -> int:
    """Graphs dynamo made so far in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def traced(monkeypatch):
    """Passes traced by dynamo into graphs run as they are (backend "eager"): the shapes and guards of compiled
    passes, without the time inductor takes to compile each."""
    monkeypatch.setattr(static, "BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["rectangle", "arena"])
def arena(request, monkeypatch) -> bool:
    """Compiled passes over buffers of their own, and over a batch's arena (a GPU's where turned on, here over the
    CPU's pages)."""
    if request.param == "arena":
        arena_on_cpu(monkeypatch, compiled=True)
    return request.param == "arena"


def prompts(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def test_inductor_passes_decode_as_model_generate():
    """fp32 greedy through inductor's compiled passes (this CPU's code): model.generate's tokens, and a second run
    compiles nothing more. (41 new tokens: after the prefill's, every pass verifies 3 drafts, so one graph serves
    them all and CI compiles one.)"""
    torch._dynamo.reset()
    model = tiny_model("llama")
    prompt = prompts(40)[0][None]
    reference = hf_greedy(model, prompt, 41)
    out = specula.generate(model, prompt, Oracle(reference, 3), max_new_tokens=41, compile=True, adaptive_draft=False)
    assert torch.equal(out.sequences, reference)
    assert out.stats.tokens_per_pass > 3 and static._PASSES[model].shapes == {(1, 4, 256)}
    before = graphs()
    again = specula.generate(model, prompt, Oracle(reference, 3), max_new_tokens=41, compile=True, adaptive_draft=False)
    assert torch.equal(again.sequences, reference) and graphs() == before


def test_inductor_passes_over_an_arena_decode_as_model_generate(monkeypatch):
    """A batch of two through inductor's compiled passes over the batch's arena (one buffer for every layer's rows,
    here the CPU's pages kept as strictly as a GPU's chunks): model.generate's tokens, the arena written where it is.
    (Mutants: the layers' views of the arena written by ``index_put``: inductor's code copies the whole arena at every
    pass and reads pages no row made readable, which crashes here as it would be an illegal address on a GPU.)"""
    arena_on_cpu(monkeypatch, compiled=True)
    torch._dynamo.reset()
    model = tiny_model("llama")
    rows = prompts(30, 17)
    references = [hf_greedy(model, row[None], 20)[0] for row in rows]
    ids, mask = left_padded(rows, 0)
    out = specula.generate(
        model, ids, Oracle(references, 3), attention_mask=mask, max_new_tokens=20, compile=True, adaptive_draft=False
    )
    assert torch.equal(out.sequences, hf_greedy(model, ids, 20, attention_mask=mask))
    assert out.stats.tokens_per_pass > 3


@pytest.mark.parametrize("proposer", ["oracle", "tree"])
def test_compiled_batches_decode_each_row_as_model_generate(traced, proposer, arena):
    """A left-padded batch of three (chains from a replayed reference, or prompt-lookup trees): each row
    model.generate's tokens alone."""
    model = tiny_model("llama")
    rows = prompts(30, 17, 41)
    references = [hf_greedy(model, row[None], 30)[0] for row in rows]
    ids, mask = left_padded(rows, 0)
    drafts = Oracle(references, 5) if proposer == "oracle" else specula.PromptLookup(branches=4)
    out = specula.generate(model, ids, drafts, attention_mask=mask, max_new_tokens=30, compile=True)
    assert torch.equal(out.sequences, hf_greedy(model, ids, 30, attention_mask=mask))
    assert out.stats.tokens_per_pass > 1


def test_compiled_sampling_draws_model_generates_tokens(traced):
    """Seeded sampling through compiled passes: the very tokens seeded model.generate draws."""
    model = tiny_model("llama")
    prompt = prompts(25)[0][None]
    settings = dict(do_sample=True, temperature=0.8, max_new_tokens=30)
    torch.manual_seed(5)
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    torch.manual_seed(5)
    out = specula.generate(model, prompt, specula.PromptLookup(), compile=True, **settings)
    assert torch.equal(out.sequences, reference)


def passes(target: CachedModel, widths: list[int], rows: int = 1) -> None:
    """Passes over ``widths`` tokens a row (``rows`` rows), each keeping its first token."""
    for width in widths:
        blocks = [torch.randint(3, VOCAB, (width,)) for _ in range(rows)]
        target.forward_rows(blocks, [width] * rows)
        target.keep_rows([1] * rows)


@pytest.mark.parametrize("padded", [True, False])
def test_no_pass_compiles_again_within_its_bucket(traced, monkeypatch, padded, arena):
    """After one pass of each bucket, passes of every width and number of rows inside the buckets make no new
    graph. The mutant, passes at their own widths (no padding), makes one per width: the count sees it."""
    if not padded:
        monkeypatch.setattr("specula.verifier.runner.bucket_of", lambda size, sizes: size)
    model = tiny_model("llama")
    target = RaggedRows(model, rollback=True, capacity=100, slots=4, compiled=static.ALWAYS, max_width=9)
    for row, prompt in enumerate(prompts(20, 12, 30, 7)):
        target.start_row(row, prompt)
    assert (target.arena is not None) is arena
    passes(target, [8, 2, 4], rows=4)  # the buckets of 4 rows x 8, 2 and 4 tokens
    assert not arena or written_with_room(target.arena)
    warmed = graphs()
    passes(target, [5, 6, 7, 3], rows=4)
    target.select_rows([0, 2, 3])  # (a request left: 3 rows, in the bucket of 4)
    passes(target, [4, 6, 2], rows=3)
    assert (graphs() == warmed) is padded
    assert target.compiled.shapes >= {(4, 8, 128), (4, 2, 128), (4, 4, 128)}


def test_a_full_cache_grows_between_passes(traced):
    """A row that outgrows the cache's capacity doubles it (a new shape, compiled once) and decodes on."""
    model = tiny_model("llama")
    target = RaggedRows(model, rollback=True, capacity=30, compiled=static.ALWAYS, max_width=4)
    target.start_row(0, prompts(28)[0])
    passes(target, [4] * 6)
    assert {shape[2] for shape in target.compiled.shapes} == {32, 64}


def test_over_an_arena_a_bucket_grows_without_a_copy(traced, arena):
    """Compiled passes over a batch's arena: a row that outgrows the bucket's capacity reads more of the arena (a new
    shape, compiled once; its keys where they were: no copy), every row's logits are those of compiled passes over
    buffers of their own, and every write had room first (mutant: the padding row's first tokens, 3 rows in a
    bucket of 4, written without)."""
    model = tiny_model("llama")
    logits = {}
    for kind in ("arena", "rectangle") if arena else ("rectangle",):
        if kind == "rectangle":
            cache_layers.ARENA, static.ON_ARENA = (), ()
        target = RaggedRows(model, rollback=True, capacity=30, slots=4, compiled=static.ALWAYS, max_width=4)
        for row, prompt in enumerate(prompts(28, 9, 14)):
            target.start_row(row, prompt)
        keys = target.cache.layers[0]._key_buffer
        logits[kind] = []
        for width in [4] * 6:
            blocks = [torch.arange(3, 3 + width) + row for row in range(3)]
            logits[kind] += target.forward_rows(blocks, [width] * 3)
            target.keep_rows([2, 2, 2])
            assert kind == "rectangle" or written_with_room(target.arena)
        moved = target.cache.layers[0]._key_buffer.data_ptr() != keys.data_ptr()
        assert {shape[2] for shape in target.compiled.shapes} >= {32, 64} and moved is (kind == "rectangle")
    if arena:
        for ours, theirs in zip(logits["arena"], logits["rectangle"]):
            torch.testing.assert_close(ours, theirs)


def test_models_with_recurrent_state_are_refused_clearly():
    model = tiny_model("llama")
    with pytest.raises(UnsupportedModelError, match="compiled passes.*compile=False"):
        RaggedRows(model, rollback=True, row_exact=True, compiled=static.ALWAYS)
    with pytest.raises(ValueError, match="cannot be combined with exact=True"):
        specula.generate(
            model, prompts(10)[0][None], specula.PromptLookup(), max_new_tokens=4, compile=True, exact=True
        )


class FakeGPU:
    """A pass whose kernels take ``host`` seconds to launch and are done ``device`` seconds after the first (the
    two overlap): its clock, and the synchronisation that waits for the device."""

    def __init__(self, host: float, device: float) -> None:
        self.host, self.device, self.now, self.launched = host, device, 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def forward_hook(self, *args) -> None:
        self.launched, self.now = self.now, self.now + self.host

    def synchronize(self, device) -> None:
        self.now = max(self.now, self.launched + self.device)


@pytest.mark.parametrize(
    "host, device, compiled",
    [
        (0.021, 0.004, True),  # a 135M model on an H100 (BENCHMARKS.md): launching is most of a pass
        (0.005, 0.060, False),  # a large model: the device is the bottleneck
    ],
)
def test_passes_compile_by_default_where_the_host_launching_kernels_is_most_of_a_pass(
    fresh_store, monkeypatch, host, device, compiled
):
    model = tiny_model("llama")
    gpu = FakeGPU(host, device)
    monkeypatch.setattr(static, "CLOCK", gpu.clock)
    monkeypatch.setattr(static, "synchronize", gpu.synchronize)
    model.register_forward_hook(gpu.forward_hook)
    assert static.pays_to_compile(*static._host_share(model)) is compiled
    # on a CPU the host computes the pass itself: nothing measured, nothing compiled unless asked
    monkeypatch.setattr(static, "_host_share", lambda model: pytest.fail("measured on a CPU"))
    assert static.compiles(model, None, exact=False) is None
    assert static.compiles(model, True, exact=False) == static.ALWAYS


def test_the_choice_is_measured_once_and_kept(fresh_store, monkeypatch):
    """On a (pretended) GPU the share is measured once per machine and model; a row-exact run never compiles."""
    model = tiny_model("llama")
    measured = []
    monkeypatch.setattr(static, "_host_share", lambda model: measured.append(1) or [0.02, 0.025])
    monkeypatch.setattr(static, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(static.store, "device_name", lambda device: "a fake GPU")
    first, second = static.compiles(model, None, exact=False), static.compiles(model, None, exact=False)
    assert first == second == static.WHERE_CHEAPER
    assert static.compiles(model, None, exact=True) is None
    assert measured == [1]


def test_by_default_each_bucket_runs_compiled_where_that_measured_cheaper(traced, fresh_store, monkeypatch):
    """Under a fake clock where compiled passes cost less than eager ones over 8 tokens and more over 1 (as on some
    CPUs): wide passes run compiled, one-token passes eagerly; each bucket is timed once (a second cache of the
    model reads the kept choice), and what the timing passes wrote is not kept."""
    import specula.verifier.runner as runner

    costs = {("compiled", 1): 2.0, ("eager", 1): 1.0, ("compiled", 8): 1.0, ("eager", 8): 3.0}
    ran, timed, width = [], [], 0

    def fake_time_pass(run, device=None):
        run()
        timed.append(ran[-1])
        return costs[(ran[-1], width)]

    monkeypatch.setattr(runner, "time_pass", fake_time_pass)
    static_pass, eager_pass = RaggedRows._forward_static, RaggedRows._forward_eager
    monkeypatch.setattr(RaggedRows, "_forward_static", lambda *a, **k: ran.append("compiled") or static_pass(*a, **k))
    monkeypatch.setattr(RaggedRows, "_forward_eager", lambda *a, **k: ran.append("eager") or eager_pass(*a, **k))
    model = tiny_model("llama")
    for _ in range(2):
        target = RaggedRows(model, rollback=True, capacity=60, compiled=static.WHERE_CHEAPER, max_width=8)
        target.start_row(0, prompts(20)[0])
        for tokens in (8, 1, 6, 1):
            width = 8 if tokens > 1 else 1
            target.forward_rows([torch.randint(3, VOCAB, (tokens,))], [tokens])
            target.keep_rows([1])
            assert ran[-1] == ("compiled" if tokens > 1 else "eager")
        assert target.cached_tokens == 24  # (a token kept a pass: the timing passes kept nothing)
    assert timed.count("compiled") == timed.count("eager") == 2 * runner.REPEATS  # (two buckets, timed once each)


def test_kept_pass_costs_are_measured_through_compiled_passes_where_the_run_compiles(traced, fresh_store):
    """Ordinary bf16/fp16 sizes drafts from kept pass costs: a run with compiled passes keeps a table of its own,
    timed through the same buckets its passes take."""
    from specula.policy import kept_costs

    model = tiny_model("llama")
    eager = kept_costs._kept_table(model, 1)
    compiled = kept_costs._kept_table(model, 1, static.ALWAYS)
    assert len(eager) == len(compiled) == len(kept_costs.WIDTHS)
    tables = [key for key in static.store.shared().known if '"pass costs"' in key]
    assert len(tables) == 2
    shapes = static._PASSES[model].shapes
    assert {
        (1, static.bucket_of(width, static.buckets_up_to(kept_costs.MAX_WIDTH))) for width in kept_costs.WIDTHS
    } == {shape[:2] for shape in shapes}


def test_a_model_that_ran_compiled_passes_is_freed_with_its_last_reference(traced):
    import gc
    import weakref

    model = tiny_model("llama")
    target = RaggedRows(model, rollback=True, capacity=40, compiled=static.ALWAYS, max_width=4)
    target.start_row(0, prompts(10)[0])
    passes(target, [3])
    gone = weakref.ref(model)
    del model, target
    torch._dynamo.reset()  # (dynamo's compiled code keeps what it guards on until reset)
    gc.collect()
    assert gone() is None
