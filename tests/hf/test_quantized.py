"""A model whose weights torchao or optimum-quanto quantized decodes as its own ``model.generate``: in fp32 the
ordinary way (torchao's int8 layers from their int8 numbers where that is faster: :mod:`specula.verifier.int8`), and
row-exactly (``exact=True``) bit for bit, its quantized layers computed in chunks of rows as they are (their products
are their own: no column-major copy, no bound of the LM head's shortcut). A model quantizing its activations is
refused before any pass."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Oracle, PartlyRight, hf_greedy
from tiny_models import tiny_model

import specula
from specula.machine.profile import profile_of
from specula.verifier import int8, packed
from specula.verifier.support import weight_state

PROMPT = torch.arange(3, 23).repeat(3)[None]


def optimum_quanto():
    """optimum-quanto, or a skip where it is not installed (its own modules: a build folder an uninstall leaves
    behind makes ``optimum.quanto`` an empty namespace)."""
    pytest.importorskip("optimum.quanto.quantize", reason="the quanto tests need optimum-quanto: 'specula[quant]'")
    import optimum.quanto

    return optimum.quanto


def quantized(form: str) -> torch.nn.Module:
    """A tiny Llama whose linear layers (the LM head too) hold ``form`` weights: torchao's int8 in fp32 and int4 in
    bf16 (what its CPU int4 kernel computes in), optimum-quanto's int8 and int4 in bf16 (its layers subclasses of
    ``nn.Linear`` with a forward of their own)."""
    model = tiny_model("llama")
    if form.startswith("torchao"):
        pytest.importorskip("torchao", reason="the torchao tests need torchao: pip install 'specula[quant]'")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        if form == "torchao int8":
            quantize_(model, Int8WeightOnlyConfig())
        else:
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

            quantize_(model.to(torch.bfloat16), PrototypeInt4WeightOnlyConfig(group_size=32))
    else:
        quanto = optimum_quanto()
        if form == "quanto int4":
            from optimum.quanto.library.extensions import get_extension

            try:  # (where it cannot be built, quanto's int4 weights cannot be read at all)
                get_extension("quanto_cpp").lib
            except Exception as error:  # (a missing compiler or Python's headers: what torch's build raises varies)
                pytest.skip(f"optimum-quanto's int4 weights need its C++ extension, which could not be built: {error}")
        quanto.quantize(model.to(torch.bfloat16), weights=quanto.qint4 if form == "quanto int4" else quanto.qint8)
        quanto.freeze(model)
    return model


@pytest.mark.parametrize(
    ("form", "exact"),
    [
        ("torchao int8", None),
        ("torchao int8", True),
        ("torchao int4", True),
        ("quanto int8", True),
        ("quanto int4", True),
    ],
)
def test_a_quantized_model_decodes_as_its_own_generate(form, exact) -> None:
    """Drafts right up to a point that moves, every one sent: ``model.generate``'s tokens, also through its
    ``custom_generate`` (mutants: a quantized layer given the column-major product, or the head's bound, fails on
    the quantized weight; passes under ``torch.inference_mode``, where quanto's int4 weights cannot be read)."""
    model = quantized(form)
    reference = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    options = {"max_new_tokens": 24, "eos_token_id": [], "adaptive_draft": False, "exact": exact}
    out = specula.generate(model, PROMPT, PartlyRight(reference, 4), **options)
    assert torch.equal(out.sequences, reference) and out.stats.accepted > 0
    assert out.stats.exactness.exact is bool(exact)
    through = model.generate(
        PROMPT, custom_generate=specula.custom_generate, proposer=PartlyRight(reference, 4), do_sample=False, **options
    )
    assert torch.equal(through, reference)


def test_a_model_quantizing_its_activations_is_refused_before_any_pass() -> None:
    """optimum-quanto's ``activations=``: its keys and values are quantized tensors; refused, saying what to do
    (mutant: the check off fails inside quanto, copying them into the cache)."""
    quanto = optimum_quanto()
    model = tiny_model("llama")
    quanto.quantize(model, weights=quanto.qint8, activations=quanto.qint8)
    quanto.freeze(model)
    with pytest.raises(specula.UnsupportedModelError, match="quantizes its activations.*weights only"):
        specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=8)


@pytest.fixture
def int8_calls(monkeypatch):
    """torchao's int8 layers computed from their int8 numbers in every pass and step up to 16 rows (whatever the
    clock finds here); counts the kernel's calls by rows."""
    calls = []
    monkeypatch.setattr(packed, "_faster_packed", lambda layer, weight, rows=9, streamed=False: rows <= 16)
    kernel = int8.int8_matmul
    monkeypatch.setattr(int8, "int8_matmul", lambda x, *args: calls.append(len(x)) or kernel(x, *args))
    return calls


def test_the_int8_kernel_computes_torchaos_product() -> None:
    """Rows of every count (in fours and a tail), a bias, batch dimensions: torchao's own product within fp32's
    rounding of another order of sums, and within bf16's for bf16 rows (mutant: a scale left out, or the tail rows
    skipped, fails)."""
    pytest.importorskip("torchao", reason="the torchao tests need torchao: pip install 'specula[quant]'")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    layer = torch.nn.Linear(96, 40)
    quantize_(torch.nn.Sequential(layer), Int8WeightOnlyConfig())
    weight = int8.int8_weight(layer.weight)
    assert weight is not None and weight.numbers.dtype == torch.int8
    forward = int8.int8_forward(weight, layer.bias, layer.forward)
    for rows in (1, 3, 4, 7, 13):
        x = torch.randn(2, rows, 96, generator=torch.Generator().manual_seed(rows))
        assert torch.allclose(forward(x), layer(x), rtol=1e-5, atol=1e-5)
    assert int8.int8_weight(torch.nn.Linear(4, 4).weight) is None  # (a plain weight: oneDNN's packing)
    layer.to(torch.bfloat16)  # (bf16 rows: summed in fp32, rounded once; torchao rounds its sums, then scales)
    half = int8.int8_forward(int8.int8_weight(layer.weight), layer.bias, layer.forward)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert half(x).dtype == torch.bfloat16 and torch.allclose(half(x).float(), layer(x).float(), rtol=2e-2, atol=2e-2)


def test_quanto_int8_layers_decode_from_their_numbers_as_their_own_generate(int8_calls) -> None:
    """optimum-quanto's int8 ``QLinear``s in fp32 (its activations not quantized): the kernel in passes, the output
    ``model.generate``'s (mutant: quanto's layers not packable, no kernel call)."""
    quanto = optimum_quanto()
    model = copy.deepcopy(tiny_model("llama"))
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    reference = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(
        model, PROMPT, Oracle(reference, 6), max_new_tokens=24, eos_token_id=[], adaptive_draft=False
    )
    assert torch.equal(out.sequences, reference) and out.stats.accepted > 12 and max(int8_calls) == 7
    profile_of(model).packed = None


def test_int8_layers_decode_from_their_numbers_as_their_own_generate(int8_calls) -> None:
    """Passes and ordinary steps take the kernel, wider passes than it is faster for and prefills torchao's product;
    the output is ``model.generate``'s, also after a weight changed in place, which its state shows (mutants: the
    kernel for every width, or a quantized weight's state not read from its inner tensors, fail)."""
    model = copy.deepcopy(quantized("torchao int8"))
    reference = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    options = {"max_new_tokens": 24, "eos_token_id": [], "adaptive_draft": False}
    out = specula.generate(model, PROMPT, Oracle(reference, 6), **options)
    assert torch.equal(out.sequences, reference) and out.stats.accepted > 12
    assert int8_calls and max(int8_calls) == 7  # (passes of 7 tokens, never the prefill's 60)
    int8_calls.clear()
    steps = specula.generate(model, PROMPT, Oracle(reference, 0), **{**options, "max_new_tokens": 8})
    assert torch.equal(steps.sequences, reference[:, : PROMPT.shape[1] + 8]) and set(int8_calls) == {1}
    int8_calls.clear()
    wide = specula.generate(model, PROMPT, Oracle(reference, 20), **options)
    assert torch.equal(wide.sequences, reference) and max(int8_calls) <= 16  # (21 tokens: torchao's own product)
    before = weight_state(model.model.layers[0].mlp.down_proj.weight)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.qdata.mul_(-1)
    assert weight_state(model.model.layers[0].mlp.down_proj.weight) != before
    reference = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    out = specula.generate(model, PROMPT, Oracle(reference, 6), **options)
    assert torch.equal(out.sequences, reference)
    profile_of(model).packed = None


def test_bf16_int8_layers_take_the_kernel_at_every_width_and_follow_no_draft_length(int8_calls, fresh_store) -> None:
    """In bf16 a row must round alike in every pass (invariant passes): the kernel takes passes wider than it is
    faster for too, and drafts of 1, 5 and 24 tokens give the same tokens (mutant: the fp32 row limit in bf16 sends
    passes over 16 tokens to torchao's product)."""
    pytest.importorskip("torchao", reason="the torchao tests need torchao: pip install 'specula[quant]'")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    reference = hf_greedy(model, PROMPT, 24, eos_token_id=[])
    runs = [
        specula.generate(
            model,
            PROMPT,
            Oracle(reference, draft),
            max_new_tokens=24,
            eos_token_id=[],
            exact="invariant",
            adaptive_draft=False,
        )
        for draft in (1, 5, 24)
    ]
    assert all(run.stats.exactness.invariant for run in runs) and max(int8_calls) > 16
    assert all(torch.equal(run.sequences, runs[0].sequences) for run in runs)
    profile_of(model).packed = None


def test_a_bf16_int8_model_is_checked_for_invariance_apart_from_what_torchaos_products_gave(fresh_store) -> None:
    """A store kept from passes of torchao's own products (before the kernel read the int8 numbers) does not answer
    for passes with it: the check runs again (mutant: the key without the int8 mark answers the kept ``False``)."""
    pytest.importorskip("torchao", reason="the torchao tests need torchao: pip install 'specula[quant]'")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from specula.machine import store
    from specula.verifier import invariant

    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    weight = next(model.parameters())
    before = store.key(
        weight.device,
        "invariant passes, query heads folded",
        invariant._model_key(model),
        weight.dtype,
        model.config._attn_implementation,
        invariant.KEY_BLOCK,
        invariant.QUERY_BLOCK,
    )
    store.shared().keep(before, False)
    assert invariant.holds(model)
    profile_of(model).packed = None
