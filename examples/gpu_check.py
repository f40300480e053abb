"""specula's GPU check: identity with model.generate, pass costs eager and compiled, and throughput against HF's
ways of decoding, on one GPU with no network, in under 10 minutes (docs/hardware.md, "The GPU check").

Real weights do not travel to such a machine, so models of real sizes are built from their configs with random
weights (SmolLM2-135M, Qwen2.5-1.5B and Llama-3.1-8B shapes). A random model's drafts mean nothing, so the throughput
runs draft with :class:`AtRate`: the target's own greedy continuation (recorded by ``model.generate`` first, and by
specula's plain decoding, which in bf16 may leave it at a near-tie), each
draft token right with probability ``--accept`` (independently, seeded by the position), so that passes accept
what a real proposer's do on the workloads here. Its default, 0.585, gives 2.38 tokens per pass with drafts of 10,
what PromptLookup reached on the code_edit workload with SmolLM2-135M (README's results table, CPU).

``--form`` holds those models' weights as users quantize them (issue 67's forms on a GPU): torchao's int8 or int4
weight-only layers, or bitsandbytes' 8-bit or nf4 layers; the passes and decodes then run on that form, against its
own ``model.generate`` and HF's prompt lookup, and a method specula refuses for the form (drafts with bitsandbytes'
layers) is reported with its reason while plain decoding through specula still runs.

Usage (the device machine has torch 2.11 and transformers 5.17; specula needs transformers >= 5.23, whose wheel
travels in .whl, torchao's and bitsandbytes' too for ``--form``, see docs/hardware.md)::

    python examples/gpu_check.py --out $OUT [--parts identity,bandwidth,passes,decode] [--shapes 135m,1.5b,8b]
    python examples/gpu_check.py --out $OUT --parts decode --shapes 1.5b --modes eager --form torchao-int8
    python examples/gpu_check.py --device cpu --shapes tiny --parts identity,passes,decode   # the script itself, on CPU
    python examples/gpu_check.py --device cpu --parts host --new-tokens 64   # the host's work per pass, any device

Prints each figure as it is measured and writes them all to OUT/gpu_check.json; a part that would overrun
``--budget`` seconds is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import specula  # noqa: E402
from specula.decoding.driver import finished_rows  # noqa: E402
from specula.machine.memory import resident_bytes  # noqa: E402
from specula.verifier.cache_layers import PreallocatedLayer  # noqa: E402
from specula.verifier.runner import CachedModel, RaggedRows  # noqa: E402
from specula.verifier.support import kv_bytes_per_token  # noqa: E402

SHAPES = {
    "tiny": lambda: transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "135m": lambda: transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "1.5b": lambda: transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "8b": lambda: transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
CONTEXT = 512  # prompt tokens of the timed passes and decodes


class AtRate(specula.Proposer):
    """Drafts the recorded greedy continuation of each prompt with every token right with probability ``accept``
    (a wrong one is the right one + 1), deterministically by position: acceptance as a real proposer's, on a random
    model."""

    def __init__(self, references: list[list[int]], accept: float, num_draft: int = 16) -> None:
        self.references = [np.asarray(r) for r in references]
        self.accept, self.num_draft = accept, num_draft

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        start = len(context_ids)
        for reference in self.references:
            if start < len(reference) and np.array_equal(reference[:start], context_ids):
                tokens = reference[start : start + min(self.num_draft, max_tokens)].copy()
                right = np.random.default_rng(start).random(len(tokens)) < self.accept
                tokens[~right] = (tokens[~right] + 1) % 100 + 3
                return specula.Draft(torch.from_numpy(tokens))
        return specula.Draft.empty()


def model_of(shape: str, dtype: torch.dtype, device: str, form: str = "as-built") -> torch.nn.Module:
    """A model of ``shape`` with random weights (seeded), in eval mode, on ``device``, held in ``form``
    (:data:`FORMS`)."""
    torch.manual_seed(0)
    config = SHAPES[shape]()
    config.eos_token_id, config.pad_token_id = None, 0
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model = formed(model, form, device)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


FORMS = ("as-built", "torchao-int8", "torchao-int4", "bnb-int8", "bnb-nf4")


def formed(model: torch.nn.Module, form: str, device: str) -> torch.nn.Module:
    """``model`` held in ``form``: torchao's int8 or int4 weight-only layers (int4: tinygemm's layout on a GPU, the
    CPU's own on a CPU; bf16), or bitsandbytes' 8-bit or nf4 layers (saved and loaded again through transformers, as
    users load them)."""
    if form == "as-built":
        return model
    if form.startswith("torchao"):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        if form == "torchao-int8":
            config = Int8WeightOnlyConfig()
        elif device.startswith("cuda"):
            config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        else:
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

            config = PrototypeInt4WeightOnlyConfig(group_size=64)
        quantize_(model, config)
        return model
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # (its 8-bit layers warn at every call in bf16)
    settings = {"load_in_8bit": True} if form == "bnb-int8" else {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    quantization = transformers.BitsAndBytesConfig(**settings, bnb_4bit_compute_dtype=model.dtype)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=model.dtype, quantization_config=quantization, device_map=device
        ).eval()


def labelled(shape: str, form: str) -> str:
    """What the figures of ``shape`` held in ``form`` are reported under."""
    return shape if form == "as-built" else f"{shape}-{form}"


def synchronized(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds(run, device: str, repeats: int = 5) -> float:
    """The median of ``repeats`` timed runs after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        synchronized(device)
        started = time.perf_counter()
        run()
        synchronized(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prompts(count: int, length: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """``[count, length]`` token ids: random text that repeats itself, as code being edited does."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(3, vocab, (count, length // 4), generator=generator)
    return block.repeat(1, 4)[:, :length].to(device)


def out_of_time(args, what: str, report) -> bool:
    """Whether the run is past ``--budget`` (then ``what`` is reported skipped)."""
    if time.perf_counter() - args.started <= args.budget:
        return False
    report(f"skipped/{what}", "out of time")
    return True


def identity(args, report) -> None:
    """Tiny models of several architectures: specula's tokens against model.generate's (each check on its own: one
    that fails is reported with its error, and the others still run)."""
    from tiny_models import tiny_model  # (tests/tiny_models.py)

    def same(name: str, ours, theirs) -> None:
        """Report whether ``ours()`` and ``theirs()`` (token tensors) are equal."""
        try:
            report(f"identity/{name}", bool(torch.equal(ours().cpu(), theirs().cpu())))
        except Exception as error:
            report(f"identity/{name}", f"failed: {type(error).__name__}: {error}"[:300])

    def greedy(model, ids, new, **kwargs):
        return lambda: model.generate(
            ids,
            attention_mask=kwargs.pop("attention_mask", torch.ones_like(ids)),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
            **kwargs,
        )

    def ours(model, ids, proposer, new, **kwargs):
        return lambda: specula.generate(model, ids, proposer, max_new_tokens=new, **kwargs).sequences

    for arch in ("llama", "qwen2", "gpt2", "mistral", "gemma3"):
        model = tiny_model(arch).to(args.device)
        ids = prompts(1, 40, 96, args.device)
        same(f"{arch}/fp32-greedy", ours(model, ids, specula.PromptLookup(), 48), greedy(model, ids, 48))
        if True in args.modes:
            same(
                f"{arch}/fp32-greedy-compiled",
                ours(model, ids, specula.PromptLookup(), 48, compile=True),
                greedy(model, ids, 48),
            )
        if arch in ("llama", "qwen2"):
            half = tiny_model(arch).to(args.device, torch.bfloat16)
            same(f"{arch}/bf16-exact", ours(half, ids, specula.PromptLookup(), 48, exact=True), greedy(half, ids, 48))
    model = tiny_model("llama").to(args.device)
    rows = [prompts(1, n, 96, args.device, seed=n)[0] for n in (30, 17, 41)]
    batch, mask = specula.hf.inputs.left_padded(rows, 0)
    settings = dict(do_sample=True, temperature=0.8, max_new_tokens=40)

    def seeded(run):
        return lambda: (torch.manual_seed(5), run())[1]

    for compiled in args.modes:
        name = "compiled" if compiled else "eager"
        same(
            f"llama/batch-of-3-{name}",
            ours(model, batch, specula.PromptLookup(), 40, attention_mask=mask, compile=compiled),
            greedy(model, batch, 40, attention_mask=mask),
        )
        same(
            f"llama/trees-{name}",
            ours(model, rows[0][None], specula.PromptLookup(branches=4), 40, compile=compiled),
            greedy(model, rows[0][None], 40),
        )
        same(
            f"llama/seeded-sampling-{name}",
            seeded(
                lambda: (
                    specula.generate(
                        model, rows[1][None], specula.PromptLookup(), compile=compiled, **settings
                    ).sequences
                )
            ),
            seeded(lambda: model.generate(rows[1][None], attention_mask=torch.ones_like(rows[1][None]), **settings)),
        )


def bandwidth(args, report) -> None:
    """What reading a large tensor once costs: the physical limit of a one-token pass (its weights read once)."""
    size = (4 << 30) if args.device.startswith("cuda") else (256 << 20)
    data = torch.empty(size // 2, dtype=torch.bfloat16, device=args.device).normal_()
    took = seconds(lambda: data.sum(dtype=torch.float32), args.device, repeats=10)
    report("bandwidth/GB_per_s", round(size / took / 1e9, 1))
    args.bandwidth = size / took


def per_shape(part):
    """``part(args, report, shape)`` for each of ``--shapes`` in turn, until the budget is spent; a shape that fails is
    reported with its error and the next one still runs."""

    def run(args, report) -> None:
        for shape in args.shapes:
            if out_of_time(args, f"{part.__name__}/{shape}", report):
                continue
            try:
                part(args, report, shape)
            except Exception as error:
                report(f"failed/{part.__name__}/{shape}", f"{type(error).__name__}: {error}"[:500])
            torch._dynamo.reset()  # (the shape's graphs, and the model they hold)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()

    return run


@per_shape
@torch.inference_mode()  # (as specula's loop runs its passes: no autograd, so CUDA graphs replay)
def passes(args, report, shape: str) -> None:
    """Pass cost by rows x width after CONTEXT tokens, eager and compiled; a compiled one-token pass against the time
    its weights take to read once."""
    model = model_of(shape, args.dtype, args.device, args.form)
    label = labelled(shape, args.form)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    for rows in args.rows if shape != "8b" else args.rows[:1]:
        if out_of_time(args, f"passes/{label}/{rows}-rows", report):
            return
        for compiled in args.modes:
            target = RaggedRows(
                model,
                rollback=True,
                capacity=CONTEXT + 64,
                slots=rows,
                compiled="always" if compiled else None,
                max_width=max(args.widths),
            )
            for row in range(rows):
                target.start_row(row, prompts(1, CONTEXT, vocab, args.device, seed=row)[0])
            for width in args.widths:
                blocks = [torch.randint(3, vocab, (width,), device=args.device) for _ in range(rows)]

                def one_pass():
                    target.forward_rows(blocks, [width] * rows)
                    target.keep_rows([0] * rows)

                took = seconds(one_pass, args.device)
                name = f"passes/{label}/{rows}x{width}/{'compiled' if compiled else 'eager'}_ms"
                report(name, round(took * 1000, 3))
                if compiled and rows == 1 and width == 1 and getattr(args, "bandwidth", None):
                    report(
                        f"passes/{label}/one-token-compiled-over-weight-read",
                        round(took / (weights / args.bandwidth), 2),
                    )


@per_shape
def decode(args, report, shape: str) -> None:
    """One request and batches, greedy, CONTEXT-token prompts, --new-tokens each: specula (compiled, AtRate drafts;
    PromptLookup for HF prompt lookup's comparison) against model.generate eager, with a static cache (compiled on a
    GPU), with prompt lookup, and batched. A method that fails (a form specula refuses drafts for) is reported so, and
    the others still run."""
    model = model_of(shape, args.dtype, args.device, args.form)
    label = labelled(shape, args.form)
    vocab, new = model.config.vocab_size, args.new_tokens
    one = prompts(1, CONTEXT, vocab, args.device)
    mask = torch.ones_like(one)

    def hf(**kwargs):
        return model.generate(one, attention_mask=mask, do_sample=False, max_new_tokens=new, **kwargs)

    def attempt(name: str, run):
        """``run()``, or ``None`` with its error reported under ``name``."""
        try:
            return run()
        except Exception as error:
            report(f"failed/decode/{label}/{name}", f"{type(error).__name__}: {error}"[:300])
            return None

    reference = hf()
    # (drafts follow model.generate's text and specula's own plain decoding's, which in bf16 may leave it at a
    # near-tie: a real proposer's drafts follow the text being verified)
    plain = attempt("1-row/specula-plain-text", lambda: specula.generate(model, one, None, max_new_tokens=new))
    drafts = AtRate([reference[0].tolist()] + ([plain.sequences[0].tolist()] if plain else []), args.accept)
    outputs = {}

    def ours(proposer, compiled, key):
        outputs[key] = specula.generate(model, one, proposer, max_new_tokens=new, compile=compiled)
        return outputs[key]

    methods = {"hf-eager": hf, "hf-prompt-lookup": lambda: hf(prompt_lookup_num_tokens=10)}
    if True in args.modes:
        methods["hf-static-compiled"] = lambda: hf(cache_implementation="static")
    for compiled in args.modes:
        tag = "compiled" if compiled else "eager"
        methods[f"specula-at-rate-{tag}"] = lambda c=compiled, t=tag: ours(drafts, c, f"at-rate-{t}")
        methods[f"specula-prompt-lookup-{tag}"] = lambda c=compiled, t=tag: ours(
            specula.PromptLookup(), c, f"prompt-lookup-{t}"
        )
        if args.form != "as-built":  # (plain decoding: what a form refused drafts still gets)
            methods[f"specula-none-{tag}"] = lambda c=compiled, t=tag: ours(None, c, f"none-{t}")
    for name, run in methods.items():
        took = attempt(f"1-row/{name}", lambda run=run: seconds(run, args.device, 3))
        if took is not None:
            report(f"decode/{label}/1-row/{name}/tok_per_s", round(new / took, 1))
    for key, out in outputs.items():
        report(f"decode/{label}/1-row/specula-{key}/tok_per_pass", round(out.stats.tokens_per_pass, 2))
        report(f"decode/{label}/1-row/specula-{key}/identical", bool(torch.equal(out.sequences, reference)))
    for rows in args.batches if shape != "8b" else args.batches[:1]:
        if out_of_time(args, f"decode/{label}/{rows}-rows", report):
            break
        batch = prompts(rows, CONTEXT, vocab, args.device, seed=rows)
        masks = torch.ones_like(batch)
        expected = model.generate(batch, attention_mask=masks, do_sample=False, max_new_tokens=new)
        took = seconds(
            lambda: model.generate(batch, attention_mask=masks, do_sample=False, max_new_tokens=new), args.device, 2
        )
        report(f"decode/{label}/{rows}-rows/hf-batched/tok_per_s", round(rows * new / took, 1))
        drafts = AtRate([row.tolist() for row in expected], args.accept)
        for name, proposer, compiled in (
            ("at-rate-eager", drafts, False),
            ("none-eager", None, False),
            ("at-rate-compiled", drafts, True),
            ("none-compiled", None, True),
        ):
            if compiled not in args.modes:  # (none: plain decoding, the server's)
                continue
            out = {}
            took = attempt(
                f"{rows}-rows/specula-{name}",
                lambda: seconds(
                    lambda: out.update(
                        o=specula.generate(
                            model, batch, proposer, attention_mask=masks, max_new_tokens=new, compile=compiled
                        )
                    ),
                    args.device,
                    2,
                ),
            )
            if took is not None:
                report(f"decode/{label}/{rows}-rows/specula-{name}/tok_per_s", round(rows * new / took, 1))
                report(
                    f"decode/{label}/{rows}-rows/specula-{name}/identical",
                    bool(torch.equal(out["o"].sequences, expected)),
                )
    compiled = specula.verifier.static._PASSES.get(model)
    if compiled is not None:
        report(
            f"decode/{label}/compiled-shapes",
            {"count": len(compiled.shapes), "seconds": round(compiled.compile_seconds, 1)},
        )


def device_used(device: str) -> int:
    """Bytes in use on the device (the driver's count: CUDA's virtual memory too; elsewhere the resident set)."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        return total - free
    return resident_bytes() or 0


def cache_held(target) -> int:
    """The bytes of keys and values a runner's cache holds (an arena's or pages: what rows wrote)."""
    return sum(layer.held_bytes() for layer in target.cache.layers if isinstance(layer, PreallocatedLayer))


@per_shape
@torch.inference_mode()
def memory(args, report, shape: str) -> None:
    """The batch's cache on the device: CUDA's virtual memory (chunk size, what mapping costs), then a batch of
    ``--batches``' first rows, one request long (``--long`` new tokens) beside short ones (``--new-tokens``),
    decoded with the arena (every layer's rows in one buffer paged by chunk) and with rectangles of the rows in use
    (``cache_layers.ARENA`` emptied), eager passes with PromptLookup's drafts (``--modes eager``), and compiled plain
    passes over the arena (``static.ON_ARENA`` on) and over rectangles (``--modes compiled``): the cache's and the
    device's peaks, what stays after, the time, and whether all decode the same tokens, and model.generate's for
    the short requests."""
    from specula.machine import vmm
    from specula.verifier import cache_layers, static

    label = labelled(shape, args.form)
    model = model_of(shape, args.dtype, args.device, args.form)
    device = torch.device(args.device)
    if device.type == "cuda":
        granule = vmm.granularity(device)
        report(f"memory/{label}/chunk_bytes", granule)
        before = device_used(args.device)
        started = time.perf_counter()
        pages = vmm.DevicePages((8, 8192, 30, 2, 3, 64), torch.bfloat16, device)
        report(f"memory/{label}/reserve_8x8192_ms", round(1000 * (time.perf_counter() - started), 1))
        report(f"memory/{label}/reserved_used_MB", round((device_used(args.device) - before) / 1e6, 1))
        flat = pages.tensor.view(-1)
        started = time.perf_counter()
        pages.readable(0, len(flat))  # (every chunk mapped to the chunk of zeros)
        report(f"memory/{label}/readable_all_ms", round(1000 * (time.perf_counter() - started), 1))
        started = time.perf_counter()
        pages.ensure(0, 64 * granule // 2)
        synchronized(args.device)
        report(f"memory/{label}/ensure_64_chunks_ms", round(1000 * (time.perf_counter() - started), 1))
        flat[: 64 * granule // 2] = 1
        zeros = bool((flat[64 * granule // 2 :].float().abs().sum() == 0).item())
        report(f"memory/{label}/ensured_MB", {"resident": pages.resident() / 1e6, "zeros_elsewhere": zeros})
        started = time.perf_counter()
        pages.release(0, 64 * granule // 2)
        synchronized(args.device)
        report(f"memory/{label}/release_64_chunks_ms", round(1000 * (time.perf_counter() - started), 1))
        report(f"memory/{label}/released_reads_zeros", bool((flat.float().abs().sum() == 0).item()))
        del pages, flat
        torch.cuda.empty_cache()  # (what the checks' sums took)
        report(f"memory/{label}/freed_used_MB", round((device_used(args.device) - before) / 1e6, 1))
    rows, vocab = args.batches[0], model.config.vocab_size
    batch = prompts(rows, CONTEXT, vocab, "cpu", seed=3)
    jobs = [specula.Job(batch[0].numpy(), args.long)] + [specula.Job(row.numpy(), args.new_tokens) for row in batch[1:]]
    short = batch[1:].to(args.device)
    expected = model.generate(
        short, attention_mask=torch.ones_like(short), do_sample=False, max_new_tokens=args.new_tokens
    )
    outputs, order = {}, {id(job): i for i, job in enumerate(jobs)}
    paged, kinds = cache_layers.ARENA, []  # (name, arena's devices, compiled passes' too, compiled)
    if False in args.modes:
        kinds += [("arena", paged, (), False), ("rectangle", (), (), False), ("arena-again", paged, (), False)]
    if True in args.modes:
        kinds += [("arena-compiled", paged, paged, True), ("rectangle-compiled", (), (), True)]
    for kind, arena, compiled_arena, compiled in kinds:
        kept = cache_layers.ARENA, static.ON_ARENA
        cache_layers.ARENA, static.ON_ARENA = arena, compiled_arena
        try:
            seen, forward_rows = [], CachedModel.forward_rows

            def watched(self, blocks, *rest, **kwargs):
                if len(seen) % 16 == 0:
                    seen.append((cache_held(self), device_used(args.device)))
                else:
                    seen.append(seen[-1])
                return forward_rows(self, blocks, *rest, **kwargs)

            CachedModel.forward_rows = watched
            if device.type == "cuda":
                torch.cuda.empty_cache()
            idle = device_used(args.device)
            drafts = None if compiled else specula.PromptLookup()  # (compiled: one width, few buckets to compile)
            decoder = specula.Decoder(model, drafts, slots=rows, compile=compiled)
            started = time.perf_counter()
            done = sorted(finished_rows(decoder, jobs), key=lambda row: order[id(row.job)])
            synchronized(args.device)
            took = time.perf_counter() - started
        finally:
            CachedModel.forward_rows, (cache_layers.ARENA, static.ON_ARENA) = forward_rows, kept
        outputs[kind] = [row.output.tolist() for row in done]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        held_tokens = sum(len(job.prompt) + len(out) for job, out in zip(jobs, outputs[kind]))
        report(
            f"memory/{label}/{rows}-rows/{kind}",
            {
                "seconds": round(took, 2),
                "tok_per_s": round(sum(len(out) for out in outputs[kind]) / took, 1),
                "cache_peak_MB": round(max(held for held, _ in seen) / 1e6, 1),
                "tokens_kv_MB": round(held_tokens * kv_bytes_per_token(model) / 1e6, 1),
                "device_peak_over_idle_MB": round((max(used for _, used in seen) - idle) / 1e6, 1),
                "cache_after_MB": round(cache_held(decoder._target) / 1e6, 1) if decoder._target else None,
                "device_after_over_idle_MB": round((device_used(args.device) - idle) / 1e6, 1),
                "short_as_generate": all(
                    out == ref[CONTEXT:].tolist() for out, ref in zip(outputs[kind][1:], expected.cpu())
                ),
            },
        )
        del decoder
    report(f"memory/{label}/{rows}-rows/all_alike", all(out == outputs[kinds[0][0]] for out in outputs.values()))


@torch.inference_mode()
def host(args, report) -> None:
    """The host's work per plain pass: the tiny shape (its compute next to nothing), one row and ``--batches`` of
    CONTEXT-token prompts, ``--new-tokens`` each, HF's batched ``model.generate`` against specula with no drafts,
    interleaved, 7 rounds: milliseconds per step (each a pass over every row), the medians and the median ratio."""
    model = model_of("tiny", torch.float32, args.device)
    new = args.new_tokens
    for rows in [1, *args.batches]:
        batch = prompts(rows, CONTEXT, model.config.vocab_size, args.device, seed=rows)
        kwargs = dict(attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=new)
        methods = {
            "hf-batched": lambda: model.generate(batch, **kwargs),
            "specula-none": lambda: specula.generate(model, batch, None, **kwargs),
        }
        times = {name: [] for name in methods}
        for _ in range(7):
            for name, run in methods.items():
                times[name].append(seconds(run, args.device, 1) / new * 1e3)
        for name, ms in times.items():
            report(f"host/{rows}-rows/{name}/ms_per_step", round(statistics.median(ms), 3))
        ratios = [ours / theirs for ours, theirs in zip(times["specula-none"], times["hf-batched"])]
        report(f"host/{rows}-rows/specula-over-hf", round(statistics.median(ratios), 2))


PARTS = {
    "identity": identity,
    "bandwidth": bandwidth,
    "passes": passes,
    "decode": decode,
    "memory": memory,
    "host": host,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--shapes", default="135m,1.5b,8b")
    parser.add_argument("--rows", default="1,8,32", help="rows of the timed passes (8b: the first only)")
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--batches", default="8,32", help="rows of the batched decodes (8b: the first only)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="of the models of real shapes")
    parser.add_argument(
        "--form",
        choices=FORMS,
        default="as-built",
        help="how the models of real shapes hold their weights (passes, decode): torchao or bitsandbytes quantized",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long", type=int, default=2048, help="new tokens of the long request of the memory part")
    parser.add_argument("--accept", type=float, default=0.585)
    parser.add_argument(
        "--budget", type=float, default=540.0, help="seconds; parts and shapes that would start past it are skipped"
    )
    parser.add_argument("--modes", default="eager,compiled", help="passes eager, compiled, or both")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="what compiles passes (eager: dynamo's graphs run as they are, to try the script quickly on a CPU)",
    )
    args = parser.parse_args()
    specula.verifier.static.BACKEND = args.compile_backend
    args.shapes, args.dtype = args.shapes.split(","), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    for name, given, known in (("shape", args.shapes, SHAPES), ("part", args.parts.split(","), PARTS)):
        if set(given) - set(known):
            parser.error(f"unknown {name} {sorted(set(given) - set(known))}: choose from {', '.join(known)}")
    args.modes = [{"eager": False, "compiled": True}[mode] for mode in args.modes.split(",")]
    args.rows, args.widths, args.batches = (
        [int(n) for n in value.split(",")] for value in (args.rows, args.widths, args.batches)
    )
    started, results = time.perf_counter(), {}
    args.started = started

    args.out.mkdir(parents=True, exist_ok=True)

    def report(name: str, value) -> None:
        results[name] = value
        print(f"{time.perf_counter() - started:7.1f}s  {name}: {value}", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))  # (each figure kept as it comes)

    report(
        "versions",
        {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        },
    )
    for part in args.parts.split(","):
        if out_of_time(args, part, report):
            continue
        try:
            PARTS[part](args, report)
        except Exception as error:  # (a failing part is reported; the others still run)
            report(f"failed/{part}", f"{type(error).__name__}: {error}"[:500])


if __name__ == "__main__":
    main()
