"""A model whose weights torchao or optimum-quanto quantized decodes as its own ``model.generate``: in fp32 the
ordinary way, and row-exactly (``exact=True``) bit for bit, its quantized layers computed in chunks of rows as they
are (their products are their own: no column-major copy, no bound of the LM head's shortcut). A model quantizing its
activations is refused before any pass."""

from __future__ import annotations

import pytest
import torch
from helpers import PartlyRight, hf_greedy
from tiny_models import tiny_model

import specula

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
