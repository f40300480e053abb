"""Speed and identity of specula on the forms users hold a model in: as loaded, with a LoRA adapter unmerged (PEFT),
with int8 or int4 weight-only weights (torchao; int4 in bf16, what its CPU kernel computes in: in fp32 it is tens of
times slower), with optimum-quanto's int8 weights (``quanto``), with half its layers offloaded to disk (accelerate's
``device_map``), and as the module ``torch.compile`` returned. For each form, its own ``model.generate``, HF's prompt
lookup and specula's PromptLookup decode the same code edits one at a time, interleaved in one process, medians of
repeats (:func:`specula.tools.bench.run_bench`); outputs are compared with that form's own ``model.generate``.

    python examples/forms.py [--workload FILE] [--limit 2] [--repeats 3] \
        [--forms plain,lora,int8,int4,quanto,offload,compiled] [--model DIR] [--proposers prompt-lookup,draft:DIR] \
        [--device cpu]

Forms whose package is missing (peft, torchao, optimum-quanto, accelerate) are skipped, saying so. The default
workload is the last ``--limit`` lines of ``../shared/workloads/code_edit.jsonl``; the default model the embedded
SmolLM2-135M-Instruct, the default proposer PromptLookup (``draft:DIR``: a small model drafting, loaded as the form's
dtype, never offloaded: what offloading a large model pairs with).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specula.hf.loading import load_model, resolve_model
from specula.jobs.requests import Request, read_requests
from specula.tools.bench import format_table, one_at_a_time, run_bench

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "code_edit.jsonl"
FORMS = ("plain", "lora", "int8", "int4", "quanto", "offload", "compiled")


def form(
    name: str, dtype: torch.dtype, offload_to: Path, path: str | None = None, device: str = "cpu"
) -> torch.nn.Module:
    """The model at ``path`` (default: the embedded one) on ``device`` in form ``name`` (an ``ImportError`` where its
    package is missing, or the form has no such device here)."""
    if name == "offload":  # the first half of the layers on the device, the second on disk
        folder = resolve_model(path)
        layers = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).config.num_hidden_layers
        device_map = {part: device for part in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
        device_map |= {f"model.layers.{i}": device if i < layers // 2 else "disk" for i in range(layers)}
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, device_map=device_map, offload_folder=str(offload_to)
        ).eval()
    if name == "int4" and device != "cpu":
        raise ImportError("the int4 form is torchao's CPU layout")
    model, _ = load_model(path, dtype=torch.bfloat16 if name == "int4" else dtype, device=device)
    if name == "lora":  # adapters as training starts them (B = 0): the model's output, the adapter layers' cost
        import peft

        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        return peft.get_peft_model(model, config).eval()
    if name == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
        return model
    if name == "int4":  # (torchao's CPU layout: the tinygemm kernel for the CPU)
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_

        quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=64))
        return model
    if name == "quanto":
        from optimum.quanto import freeze, qint8, quantize

        quantize(model, weights=qint8)
        freeze(model)
        return model
    if name == "compiled":
        return torch.compile(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--limit", type=int, default=2, help="the file's last N requests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: load_model's choice")
    parser.add_argument("--model", help="an HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--proposers", default="prompt-lookup", help="specula's, comma-separated (draft:DIR too)")
    parser.add_argument("--device", default="cpu", help="torch device the model is loaded on (offload: its first half)")
    args = parser.parse_args()
    requests = [request for _, request in read_requests(args.workload) if isinstance(request, Request)][-args.limit :]
    dtypes = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}
    loaded, tokenizer = load_model(args.model, dtype=dtypes[args.dtype], device=args.device)
    dtype = loaded.dtype
    del loaded
    named = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    print(f"{named}, {dtype} (int4: bf16), {len(requests)} requests of {args.workload.name}", flush=True)
    with tempfile.TemporaryDirectory() as offload_to:
        for name in args.forms.split(","):
            try:
                model = form(name, dtype, Path(offload_to), args.model, args.device)
            except ImportError as error:
                print(f"{name}: skipped ({error})", file=sys.stderr)
                continue
            proposers = args.proposers.split(",")
            methods = one_at_a_time(model, tokenizer, proposers, {}, "hf-greedy", oracle=False)
            rows = run_bench(methods, tokenizer, {name: requests}, args.max_new_tokens, args.repeats)
            print(format_table(rows), flush=True)
            del model, methods


if __name__ == "__main__":
    main()
