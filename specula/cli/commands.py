"""The ``specula`` commands themselves, run once the command line has been checked (:mod:`specula.cli.checks`):
``generate`` (JSONL in, JSONL out, or one streamed prompt), ``bench``, ``drift`` and ``probe``."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm
from transformers import TextStreamer

from ..decoding.budget import gigabytes
from ..decoding.loop import Decoder
from ..hf.generate import generate
from ..hf.loading import ModelNotFoundError, load_model
from ..hf.registry import proposer_factory
from ..jobs.answer_file import AnswerFile, InputOrder, StopOnInterrupt, Tally, report_skipped
from ..jobs.decode import Answerer, Settings, batch_size, cache_budget, named, names
from ..jobs.line_formats import error_line
from ..jobs.requests import BadRequest, Request, answer_key, encode, model_name, read_requests, unique_requests
from ..proposers.kernels import warm_up
from ..tools.bench import BenchInterrupted, format_table, one_at_a_time, run_batch_sizes, run_bench
from ..tools.drift import drift
from ..tools.probe import probe
from ..verifier import row_exact as row_exact_module

DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def run(args: argparse.Namespace) -> None:
    """Run the command ``args`` names; a model that cannot be found or a request it cannot serve is one line."""
    try:
        COMMANDS[args.command](args)
    except (ModelNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


def _sampling(args: argparse.Namespace) -> dict:
    """generate() arguments from the sampling options; unset ones are left to the model's generation config
    (argparse has checked the values: a temperature >= 0, top-k >= 0, top-p in (0, 1])."""
    if args.temperature is None:
        return {name: value for name, value in (("top_k", args.top_k), ("top_p", args.top_p)) if value is not None}
    if args.temperature == 0:
        return {"do_sample": False}
    settings = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    return {name: value for name, value in settings.items() if value is not None}


def _load(args: argparse.Namespace):
    # the drafting kernels load while the model does (a daemon thread: nothing waits for it)
    threading.Thread(target=warm_up, name="specula-kernels", daemon=True).start()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=device, adapter=args.adapter)
    return model, tokenizer, device


def _brings_predictions(path: Path) -> bool:
    """Whether a request of the file brings a prediction (passes then verify drafts from it, whatever the proposer)."""
    return any(isinstance(request, Request) and request.prediction is not None for _, request in read_requests(path))


def cmd_generate(args: argparse.Namespace) -> None:
    sampling_settings = _sampling(args)
    settings = Settings(
        args.max_new_tokens,
        sampling_settings,
        args.seed,
        args.exact,
        args.compile,
        args.batch_size,
        predictions=args.input is not None and _brings_predictions(args.input),
        model_name=model_name(args.model),
        adapters=tuple(args.adapter or ()),
        max_memory=args.max_memory,
    )
    output = args.answers  # (read by the checks: with --resume, the answers already there)
    if output is not None and output.torn:
        print(
            f"{args.output}: its last line was cut short when a run stopped; that request is answered again",
            file=sys.stderr,
        )
    if args.ray:
        from ..jobs.ray import generate_with_ray  # Ray is optional

        with output:
            generate_with_ray(
                args.input,
                output,
                args.model,
                args.proposer,
                settings,
                dtype=DTYPES[args.dtype],
                adapter=args.adapter,
                workers=args.workers,
                gpus_per_worker=args.gpus_per_worker,
                cpus_per_worker=args.cpus_per_worker,
                strict=args.strict,
                json_path=args.json,
            )
        return
    model, tokenizer, device = _load(args)
    proposer = proposer_factory(args.proposer, tokenizer, model.dtype, device)()  # kept across requests
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.prompt is not None:
        request = (
            {"prompt": args.prompt}
            if args.raw or tokenizer.chat_template is None
            else {"messages": [{"role": "user", "content": args.prompt}]}
        )
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = generate(
            model,
            encode(tokenizer, request).to(device),
            proposer,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            exact=args.exact,
            compile=args.compile,
            **sampling_settings,
        )
        print(f"[{out.stats}]", file=sys.stderr)
        return

    _generate_file(args, model, tokenizer, proposer, settings, output)


def _generate_file(
    args: argparse.Namespace, model, tokenizer, proposer, settings: Settings, output: AnswerFile
) -> None:
    """Answer every request of --input into --output, in input order (:class:`InputOrder`): bad lines reported and
    skipped (in a Batch API file, answered with an error line), with --resume the requests already answered
    skipped, stopped cleanly by Ctrl-C."""
    tally = Tally()
    lines = sum(1 for line in args.input.open() if line.strip())
    progress = tqdm(total=lines, desc="specula", unit="req")
    order = InputOrder(output, tally)

    def skip(number: int, where: str, reason: str, custom_id: str | None) -> None:
        """A request that is not answered: reported; in a Batch API file, an error line in its place."""
        if args.strict:
            raise SystemExit(f"error: {where}{reason} (--strict)")
        tally.skip(f"{where}{reason}")
        order.settle(number, error_line(custom_id, reason) if args.batch_api else None)
        progress.update()

    def pending() -> Iterator[Request]:
        for number, request in unique_requests(args.input, names(settings)):
            if request.id is not None and answer_key(request.id) in output.done:
                tally.answered_before += 1
                progress.update()
                continue
            order.expect(number)
            if isinstance(request, BadRequest):
                skip(number, "", str(request), request.id)
                continue
            yield request

    def on_skip(request: Request, reason: str) -> None:
        skip(request.line, f"{args.input}:{request.line}: ", reason, request.id)

    answerer = Answerer(model, tokenizer, proposer, settings, on_skip)
    with StopOnInterrupt() as stop, output, order:
        for request, answer in answerer(pending(), largest=min(lines, 32), eager=args.strict):
            order.settle(request.line, answer)
            progress.update()
            if stop.requested:
                break
    progress.close()
    sizes = sorted(set(answerer.sizes))
    estimate = answerer.plain_speedup()
    tally.report(
        f"batches of {' and '.join(map(str, sizes)) or answerer.slots}, {answerer.prefill_seconds:.1f}s of it "
        "prefills"
        + (
            f", ~{estimate:.2f}x plain decoding of the same requests (estimated from plain passes timed in the run)"
            if estimate
            else ", no estimate against plain decoding ("
            + ("other programs took the CPUs meanwhile" if answerer.disturbed else "too few plain passes timed")
            + f"; `specula bench --workloads {args.input} --batch-sizes {max(sizes, default=1)}` measures it)"
        )
        + (f"; {answerer.exactness}" if answerer.exactness is not None else "")
        + (f"; passes compiled {answerer.compiled}" if answerer.compiled else ""),
        args.output,
        stop.requested,
        args.json,
        batch_sizes=sizes,
        plain_speedup=None if estimate is None else round(estimate, 3),
        prefill_seconds=round(answerer.prefill_seconds, 3),
        verification=None if answerer.exactness is None else str(answerer.exactness),
    )


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn  # (the serve extra: checked before the model loads)

    from ..serve.app import create_app
    from ..serve.engine import Engine

    model, tokenizer, device = _load(args)
    proposer = proposer_factory(args.proposer, tokenizer, model.dtype, device)()  # one for every request
    settings = named(
        Settings(
            args.max_new_tokens,
            _sampling(args),
            args.seed,
            args.exact,
            args.compile,
            args.batch_size,
            predictions=True,
            model_name=model_name(args.model),
            max_memory=args.max_memory,
        ),
        model,
    )
    slots, budget = batch_size(model, settings), cache_budget(model, settings)
    engine = Engine(
        lambda: Decoder(
            model,
            proposer,
            slots,
            exact=settings.exact,
            predictions=True,
            compile=settings.compile,
            budget=budget,
            makespan=False,  # (each request's own time counts)
        ).prepare()
    )
    app = create_app(engine, model, tokenizer, settings, api_key=args.api_key, budget=budget)
    memory = "" if budget is None else f", keys and values within {gigabytes(budget.limit)}"
    print(
        f"specula serve: {settings.model_name} on http://{args.host}:{args.port}/v1 ({slots} requests at once"
        f"{memory}; Ctrl-C stops)",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def cmd_bench(args: argparse.Namespace) -> None:
    sampling = _sampling(args)
    workloads = args.workload_rows  # (every line checked before the model loads)
    own = sum(bool(request.options) for rows in workloads.values() for request in rows)
    if own:
        print(
            f"note: {own} workload lines give settings of their own (max_tokens, temperature ...); bench decodes "
            "every line with its command line's, the same for every method",
            file=sys.stderr,
        )
    model, tokenizer, device = _load(args)
    sampled = sampling["do_sample"]  # (bench's --temperature is never unset)
    baseline = "hf-sample" if sampled else "hf-greedy"
    progress = tqdm(total=sum(map(len, workloads.values())), desc="specula bench", unit="prompt")
    reference: dict = {}
    rows: list = []
    try:
        rows += run_bench(
            one_at_a_time(
                model,
                tokenizer,
                args.proposers.split(","),
                sampling,
                baseline,
                predicted=any(row.prediction is not None for rows in workloads.values() for row in rows),
                also_ordinary=args.also_ordinary,
                oracle=not args.no_oracle,
                compile=args.compile,
            ),
            tokenizer,
            workloads,
            args.max_new_tokens,
            args.repeats,
            baseline=baseline,
            progress=lambda _: progress.update(),
            outputs=reference,
            seed=(args.seed or 0) if sampled else None,  # (each prompt's runs seeded alike)
        )
        progress.close()
        rows += run_batch_sizes(
            model,
            tokenizer,
            args.proposers.split(","),
            sampling,
            baseline,
            workloads,
            args.max_new_tokens,
            args.batch_sizes,
            {row.workload: row.tokens_per_s for row in rows if row.method == baseline},
            None if sampled else reference,
            args.repeats,
            compile=args.compile,
        )
    except BenchInterrupted as stop:  # Ctrl-C: what was measured is kept, shown and written
        progress.close()
        rows += stop.rows
        interrupted = True
    else:
        interrupted = False
    dtype_name = DTYPE_NAMES.get(model.dtype, str(model.dtype))
    print(
        f"{Path(args.model or 'SmolLM2-135M-Instruct').name}, {dtype_name}, {device}, up to {args.limit} prompts per "
        f"workload, {args.max_new_tokens} new tokens, median of {args.repeats}; speedup vs {baseline}"
        + f"; identical: share of prompts with {baseline}'s exact output"
        + (f" (each prompt's runs seeded alike, from --seed {args.seed or 0}); sampling {sampling}" if sampled else "")
    )
    if rows:
        print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([dict(row.as_dict(), dtype=dtype_name) for row in rows], indent=1))
    if interrupted:
        print(
            f"interrupted: the table holds what was measured before Ctrl-C ({len(rows)} rows; a workload cut short "
            "counts the prompts it finished)",
            file=sys.stderr,
        )
        raise SystemExit(130)


def cmd_drift(args: argparse.Namespace) -> None:
    model, tokenizer, device = _load(args)
    factory = proposer_factory(args.proposer, tokenizer, model.dtype, device)
    reports, started = [], time.perf_counter()
    for number, request in unique_requests(args.input):
        if isinstance(request, BadRequest):
            report_skipped(str(request))
            continue
        report = drift(
            model,
            encode(tokenizer, request).to(device),
            factory(),
            args.max_new_tokens,
            exact=args.exact,
            adaptive_draft=args.adaptive,
        )
        row = {"id": request.id, **report.as_dict()}
        if not report.identical:
            row["tokens"] = [
                tokenizer.decode([t]) if t is not None else None for t in (report.plain_token, report.speculative_token)
            ]
            print(
                f"{row['id']}: differs at new token {report.position}: model.generate {row['tokens'][0]!r}, "
                f"specula {row['tokens'][1]!r}; logit gap {report.gap_one_token} in the one-token step, "
                f"{report.gap_verification} in specula's pass (tolerance {report.tolerance:.3g}): {report.verdict}"
            )
        reports.append(row)
    identical = sum(row["identical"] for row in reports)
    ties = sum(row["verdict"] == "near-tie" for row in reports)
    print(
        f"{identical} of {len(reports)} identical to model.generate, {ties} near-ties, "
        f"{len(reports) - identical - ties} not near-ties ({DTYPE_NAMES.get(model.dtype, model.dtype)}, {device}, "
        f"{sum(row['drafted'] for row in reports)} draft tokens verified, {time.perf_counter() - started:.0f}s)"
    )
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1, ensure_ascii=False))


def cmd_probe(args: argparse.Namespace) -> None:
    model, tokenizer, device = _load(args)
    text = Path(args.text).read_text() if args.text else Path(row_exact_module.__file__).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens].to(device)
    for exact in (False, True):
        for end in sorted({ids.shape[1] // 2, 3 * ids.shape[1] // 4, ids.shape[1]}):  # (queries past more keys)
            for width in args.width:
                print(f"after {end - width} tokens: {probe(model, ids[:, :end], width, exact=exact)}")


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "drift": cmd_drift, "probe": cmd_probe}
