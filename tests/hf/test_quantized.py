"""A model whose weights torchao quantized (int8 and int4 weight-only) decodes as its own ``model.generate``: in fp32
the ordinary way, and row-exactly (``exact=True``) bit for bit, its quantized layers computed in chunks of rows
as they are (their products are their own: no column-major copy, no bound of the LM head's shortcut)."""

from __future__ import annotations

import pytest
import torch
from helpers import PartlyRight, hf_greedy
from tiny_models import tiny_model

import specula

torchao = pytest.importorskip("torchao", reason="the torchao tests need torchao: pip install 'specula[test]'")

PROMPT = torch.arange(3, 23).repeat(3)[None]


def quantized(form: str) -> torch.nn.Module:
    """A tiny Llama whose linear layers (the LM head too) hold ``form`` weights: int8 in fp32, int4 in bf16 (what
    torchao's CPU int4 kernel computes in)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = tiny_model("llama")
    if form == "int8":
        quantize_(model, Int8WeightOnlyConfig())
    else:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        quantize_(model.to(torch.bfloat16), PrototypeInt4WeightOnlyConfig(group_size=32))
    assert type(model.get_output_embeddings().weight) not in (torch.Tensor, torch.nn.Parameter)
    return model


@pytest.mark.parametrize(("form", "exact"), [("int8", None), ("int8", True), ("int4", True)])
def test_a_torchao_model_decodes_as_its_own_generate(form, exact) -> None:
    """Drafts right up to a point that moves, every one sent: ``model.generate``'s tokens, also through its
    ``custom_generate`` (mutant: a quantized layer given the column-major product, or the head's bound, fails on
    the quantized weight)."""
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
