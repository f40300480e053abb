"""Half precision: verification passes compute every position as a one-token step does, so greedy output is
model.generate's in bf16 and fp16 too, whatever the drafts and draft lengths (specula.verifier.row_exact)."""

from __future__ import annotations

import copy
import time
import warnings

import numpy as np
import pytest
import torch
import transformers
from bf16_cases import CONFIGS, NEW_TOKENS, VOCAB, WIDE, model, prompt, reference
from helpers import AlwaysWrong, Oracle, TickingClock, TreeOracle, exact_generate, hf_greedy

import specula
import specula.verifier.row_exact as row_exact_module
from specula.decoding.loop import MAX_DRAFT
from specula.machine import store
from specula.policy.costs import shared_pass_costs
from specula.tools.probe import probe
from specula.verifier.calibration import spread
from specula.verifier.row_exact import head as head_module
from specula.verifier.row_exact import linear as linear_module
from specula.verifier.row_exact.attention import RowAttention, _PassAttention


def forget_row_exact() -> None:
    """Row-exact kernels are built again for every model (after a test patched how they are built)."""
    store.forget()


def speculate(name: str, proposer, dtype: torch.dtype = torch.bfloat16, **kwargs) -> specula.GenerateOutput:
    """Row-exact unless ``exact=False`` is given (whether the default would choose it depends on the machine)."""
    return exact_generate(model(name, dtype), prompt(), proposer, max_new_tokens=NEW_TOKENS, eos_token_id=[], **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("adaptive_draft", [True, False])
def test_bf16_identical_to_model_generate(name: str, adaptive_draft: bool) -> None:
    ref = reference(name).tolist()
    for proposer in (
        specula.PromptLookup(),
        Oracle(reference(name), WIDE - 1),
        AlwaysWrong(reference(name), WIDE - 1, VOCAB),
    ):
        out = speculate(name, proposer, adaptive_draft=adaptive_draft)
        assert out.sequences.tolist() == ref, type(proposer).__name__
        if type(proposer) is Oracle and not adaptive_draft:  # (the cost model may find drafts do not pay here)
            assert out.stats.accepted > NEW_TOKENS // 2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_probe_finds_what_rounds_differently_and_row_exact_removes_it(name: str) -> None:
    """The mutant is the ordinary pass: the probe sees its logits differ from one-token steps and names the first
    module, whose inputs agreed; row-exact passes agree at every module."""
    ordinary = probe(model(name), prompt(), width=WIDE, exact=False)
    assert not ordinary.logits_identical and ordinary.modules_differing > 0
    assert ordinary.culprit is not None and ordinary.differing_positions
    exact = probe(model(name), prompt(), width=WIDE, exact=True)
    assert exact.logits_identical and exact.culprit is None and exact.modules_differing == 0, str(exact)


def test_verifying_attention_the_old_way_is_caught(monkeypatch) -> None:
    """A mutant RowExact that leaves attention to the ordinary multi-query call: the probe names attention."""
    monkeypatch.setattr(_PassAttention, "__call__", lambda self, m, *args, **kw: self.inner_of(m)(m, *args, **kw))
    forget_row_exact()
    report = probe(model("llama"), prompt(), width=WIDE, exact=True)
    assert not report.logits_identical
    assert report.culprit == "model.layers.0.self_attn" and report.culprit_op.startswith("attention (sdpa)")
    forget_row_exact()


def test_without_row_exact_greedy_output_is_still_reproducible() -> None:
    """Ordinary passes in bf16: draft lengths follow acceptance only, so two runs agree whatever was timed before."""
    cold = speculate("qwen2", specula.PromptLookup(), exact=False)
    costs = shared_pass_costs(model("qwen2"), ("cpu", torch.bfloat16), MAX_DRAFT)
    for tokens, seconds in enumerate(np.linspace(1.0, 0.01, MAX_DRAFT + 1), start=1):
        costs.record(tokens, seconds)
    warm = speculate("qwen2", specula.PromptLookup(), exact=False)
    assert cold.sequences.tolist() == warm.sequences.tolist()


def test_fp16_identical_to_model_generate() -> None:
    ref = reference("llama", torch.float16)
    out = speculate("llama", Oracle(ref, WIDE - 1), dtype=torch.float16, adaptive_draft=False)
    assert out.sequences.tolist() == ref.tolist()


def test_grouping_rows_past_the_kernels_vector_tail_is_caught(monkeypatch) -> None:
    """A mutant that groups rows by 32 keys, so that some rows' tail keys land in the kernel's vectors."""
    monkeypatch.setattr(RowAttention, "_group_width", lambda self, *args: 32)
    forget_row_exact()
    report = probe(model("llama"), prompt(), width=WIDE, exact=True)
    forget_row_exact()
    assert not report.logits_identical and report.culprit == "model.layers.0.self_attn"


def test_row_by_row_where_column_major_copies_do_not_fit(monkeypatch) -> None:
    """With no memory to spare, row-major weights are not copied: their layers compute row by row, still exact."""
    monkeypatch.setattr(linear_module, "spare_bytes", lambda device: 0)
    forget_row_exact()
    ref = reference("llama")
    with warnings.catch_warnings(record=True):
        exact = row_exact_module.row_exact_for(model("llama"))
        out = speculate("llama", Oracle(ref, WIDE - 1), adaptive_draft=False)
    forget_row_exact()
    assert exact.copied_bytes == 0 and all(linear.weight_t is None for linear in exact.linears)
    assert out.sequences.tolist() == ref.tolist()


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "made-under-inference-mode"])
def test_weights_changed_in_place_are_copied_again(inference) -> None:
    """Column-major copies follow the weights: after an in-place change, output is the changed model's (also of a
    model made under ``torch.inference_mode``, whose weights keep no version)."""
    with torch.inference_mode(inference):
        changed = copy.deepcopy(model("llama"))
    ref = hf_greedy(changed, prompt(), NEW_TOKENS, eos_token_id=[])

    def speculate_with(m):
        return exact_generate(
            m,
            prompt(),
            Oracle(ref, WIDE - 1),
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            adaptive_draft=False,
        )

    assert speculate_with(changed).sequences.tolist() == ref.tolist()
    with torch.inference_mode() if inference else torch.no_grad():
        for layer in changed.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
    ref = hf_greedy(changed, prompt(), NEW_TOKENS, eos_token_id=[])
    assert speculate_with(changed).sequences.tolist() == ref.tolist()


def _batch(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, L]`` ids and mask."""
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    return ids, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_rows_of_a_batch_do_not_depend_on_their_batch_mates(name: str) -> None:
    """bf16: a request gives model.generate's tokens for it alone, alone and inside two different batches (rows of
    other lengths, accepting other numbers of drafts)."""
    text = prompt()[0]
    prompts = [text, text[:217], text[41:], torch.flip(text[:180], [0])]
    expected = [hf_greedy(model(name), p[None], NEW_TOKENS, eos_token_id=[])[0, len(p) :].tolist() for p in prompts]
    for members in ([0], [0, 1], [2, 0, 3], [3, 2, 1, 0]):
        ids, mask = _batch([prompts[i] for i in members])
        out = exact_generate(
            model(name), ids, specula.PromptLookup(), attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[]
        )
        got = [row[ids.shape[1] :] for row in out.sequences.tolist()]
        assert got == [expected[i] for i in members], members


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_trees_give_model_generates_tokens(name: str) -> None:
    """bf16: tree drafts whose accepted path is never the first child (its tokens not contiguous in the pass) or
    comes before shallower tokens, alone and in a batch with a chain row, and PromptLookup's own trees:
    model.generate's tokens."""
    text = prompt()[0]
    prompts = [text, text[41:]]
    expected = [hf_greedy(model(name), p[None], NEW_TOKENS, eos_token_id=[])[0, len(p) :].tolist() for p in prompts]
    references = [torch.cat([p, torch.tensor(e)]) for p, e in zip(prompts, expected)]
    for members in ([0], [1, 0]):
        ids, mask = _batch([prompts[i] for i in members])
        trees = [TreeOracle(references, shape, VOCAB, depth=6) for shape in ("second", "late")]
        for proposer in (*trees, specula.PromptLookup(branches=4)):
            out = exact_generate(
                model(name),
                ids,
                proposer,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=[],
                adaptive_draft=False,
            )
            got = [row[ids.shape[1] :] for row in out.sequences.tolist()]
            assert got == [expected[i] for i in members], (members, proposer)
            if isinstance(proposer, TreeOracle):  # (the trees were verified)
                assert out.stats.accepted > NEW_TOKENS * len(members) // 2


def _rounds_by_rows(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A forward hook that makes an LM head's own product round a row otherwise in a pass of several rows than
    alone, by a unit in the last place (within the bound a changed summation order keeps to): where a row's maximum
    is shared, the later ones come out a unit higher, so that the ordinary multi-row head flips every tie. (Where
    row-exact verification computes the head row by row, its replacement ``forward`` is what ran: left alone.)"""
    if args[0].shape[-2] == 1 or "forward" in module.__dict__:
        return out
    later = out == out.amax(-1, keepdim=True)
    later.scatter_(-1, out.argmax(-1, keepdim=True), False)
    bits = out.view(torch.int16)
    up = torch.where(out > 0, bits + 1, torch.where(out < 0, bits - 1, torch.ones_like(bits))).view(out.dtype)
    return torch.where(later, up, out)


def _tied_head_model() -> torch.nn.Module:
    """A bf16 Llama whose head gives tokens 2k and 2k + 1 (k < 64) the same row: where one of them is the argmax,
    the other ties with it (model.generate takes 2k), and the head rounds by rows (_rounds_by_rows)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight[1:128:2] = model.lm_head.weight[0:128:2]
        model.lm_head.weight.mul_(8.0)  # (so that the argmax falls on the tied tokens often)
    model.lm_head.register_forward_hook(_rounds_by_rows)
    return model


def test_the_lm_head_is_computed_again_only_where_the_argmax_could_change(monkeypatch) -> None:
    """Greedy passes run a head that needs row-exactness the ordinary way and compute again the rows whose argmax
    the rounding bound cannot certify: every tie here. Output stays model.generate's; some rows keep the ordinary
    head's logits. The mutant that certifies every row leaves model.generate at the first tie."""
    model = _tied_head_model()
    linear_calibration = linear_module._linear_calibration
    monkeypatch.setattr(
        linear_module,
        "_linear_calibration",
        lambda layer: (
            {"rows": 1, "by_columns": False, "exact_ms": 1.0, "ordinary_ms": 1.0}
            if layer is model.lm_head
            else linear_calibration(layer)
        ),
    )
    passes = []
    logits = head_module._HeadPass.logits
    monkeypatch.setattr(
        head_module._HeadPass,
        "logits",
        lambda self, out: (logits(self, out), passes.append((self.shortcut, self.recomputed, out.shape[1])))[0],
    )
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (1, 12), generator=generator).repeat(1, 6)
    ref = hf_greedy(model, prompt, 40, eos_token_id=[])
    assert (ref[0, 72:] < 128).sum() > 4  # ties were to break
    forget_row_exact()
    out = exact_generate(model, prompt, Oracle(ref, 8), max_new_tokens=40, eos_token_id=[], adaptive_draft=False)
    assert out.sequences.tolist() == ref.tolist()
    shortcut = [(recomputed, rows) for used, recomputed, rows in passes if used]
    assert shortcut and sum(r for r, _ in shortcut) > 0 and sum(rows - r for r, rows in shortcut) > 0
    monkeypatch.setattr(
        head_module._Head, "certain", lambda self, logits, hidden: torch.ones(len(logits), dtype=torch.bool)
    )
    forget_row_exact()
    mutant = exact_generate(model, prompt, Oracle(ref, 8), max_new_tokens=40, eos_token_id=[], adaptive_draft=False)
    assert mutant.sequences.tolist() != ref.tolist()
    forget_row_exact()


def test_no_timed_pass_computes_the_head_norms(monkeypatch) -> None:
    """The shortcut's |W_j| take a second for a 151936-token head. Computed in the first pass that used them, that
    pass was timed, and the cost model sent no drafts for the rest of the run (Qwen2.5-Coder-1.5B bf16 on the EPYC,
    a first run: 1.05x model.generate instead of 1.84x). They are computed while the model is set up; here that
    takes 1000 s longer on a fake clock, and no pass cost the cost model keeps may include it."""
    model = _tied_head_model()
    linear_calibration = linear_module._linear_calibration
    monkeypatch.setattr(
        linear_module,
        "_linear_calibration",
        lambda layer: (
            {"rows": 1, "by_columns": False, "exact_ms": 1.0, "ordinary_ms": 1.0}
            if layer is model.lm_head
            else linear_calibration(layer)
        ),
    )
    norms = head_module._Head.norms

    clock = TickingClock()

    def slow(self):
        if self._norms is None:
            clock.jump(1000.0)
        return norms(self)

    monkeypatch.setattr(head_module._Head, "norms", slow)
    monkeypatch.setattr(time, "perf_counter", clock)
    prompt = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(3)).repeat(1, 6)
    ref = hf_greedy(model, prompt, 40, eos_token_id=[])
    forget_row_exact()
    out = exact_generate(model, prompt, Oracle(ref, 8), max_new_tokens=40, eos_token_id=[])
    costs = shared_pass_costs(model, (model.device, model.dtype), MAX_DRAFT)
    forget_row_exact()
    assert out.sequences.tolist() == ref.tolist() and out.stats.accepted > 0
    assert costs.samples and max(seconds for samples in costs.samples.values() for _, seconds in samples) < 1000.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_lm_head_bound_holds_between_a_real_multi_row_product_and_one_row_ones(dtype) -> None:
    """The bound the head shortcut certifies with (row_exact.head._Head) against this machine's kernels: logits of a
    wide head with an inner dimension of 1536, 33 rows in one product against each alone, never differ by more than
    the bound. Where the kernels give identical products the test skips: it would check nothing there."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 4096, bias=False).to(dtype)
    head = head_module._Head(linear_module._ExactLinear(layer, 1, False))
    x = spread((33, 1536), torch.Generator().manual_seed(1), 6).to(dtype)
    together = layer(x[None])[0].float()  # [33, vocab]
    alone = torch.cat([layer(row[None, None])[0] for row in x]).float()
    norms, _ = head.norms()
    h = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
    bound = 2 * head.gamma * h * norms + head._ulp(torch.maximum(together.abs(), alone.abs()))
    assert ((together - alone).abs() <= bound).all()
    if torch.equal(together, alone):
        pytest.skip(
            f"this machine's {dtype} kernels compute the 33-row product bit for bit as one-row products "
            "(e.g. bf16 emulated in fp32 on a CPU without AVX512_BF16): the bound held, but bounds no difference"
        )


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bf16_seeded_sampling_draws_model_generates_tokens(name: str) -> None:
    """Row-exact passes give each position its one-token logits, so seeded sampling with drafts draws
    model.generate's tokens in bf16 too, with timed draft lengths and with every draft sent."""
    settings_ = dict(do_sample=True, temperature=0.3, top_k=40)
    net = model(name, torch.bfloat16)  # (made before seeding: making it seeds torch)
    torch.manual_seed(5)
    ref = net.generate(
        prompt(),
        attention_mask=torch.ones_like(prompt()),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        pad_token_id=0,
        **settings_,
    )
    for proposer in (specula.PromptLookup(), Oracle(ref, WIDE - 1)):
        for adaptive in (True, False):
            torch.manual_seed(5)
            out = speculate(name, proposer, adaptive_draft=adaptive, **settings_)
            assert out.sequences.tolist() == ref.tolist(), (type(proposer).__name__, adaptive)
            if isinstance(proposer, Oracle) and not adaptive:
                assert out.stats.accepted > 0
