"""Benchmarking specula against HF ``model.generate`` in one process, methods interleaved, medians of repeats."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from ..core.stats import PREDICTION_COUNTERS, TREE_COUNTERS, SpecStats
from ..decoding.driver import decode_all
from ..decoding.loop import Decoder
from ..hf.generate import generate, prepare_jobs
from ..hf.inputs import left_padded
from ..hf.registry import proposer_factory
from ..hf.wrapped import unwrapped
from ..jobs.requests import encode
from ..proposers.base import Proposer
from ..verifier.cache_names import cache_in
from .replay import Replay

# A method turns a prompt, max new tokens and the request's prediction ("prediction" of its workload line, or None;
# used by methods made with predicted=True) into (new token ids, seconds, SpecStats or None).
Method = Callable[[torch.Tensor, int, object], tuple[list[int], float, object]]
# A batch method turns prompts (1-D) into (each row's new token ids, seconds, SpecStats or None).
# (prompts, max new tokens, batch size) -> (new tokens per prompt, seconds, SpecStats or None)
BatchMethod = Callable[[list[torch.Tensor], int, int], tuple[list[list[int]], float, object]]


class HFMethod:
    """``model.generate`` (greedy unless ``do_sample=True`` is given) as a bench method, with extra HF arguments (e.g.
    ``prompt_lookup_num_tokens=10``). ``setup`` says how ``generate`` decoded, as it chose on the first run: the
    cache class it passed the model and whether it compiled the model's forward (its own auto-compile decision; a
    version that never asks, as 5.23's assisted generation, does not compile)."""

    def __init__(self, model: torch.nn.Module, **generate_kwargs) -> None:
        self.model, self.generate_kwargs = model, {"do_sample": False, **generate_kwargs}
        self.setup: str | None = None

    def __call__(self, prompt: torch.Tensor, max_new_tokens: int, prediction: object = None):
        prompt = prompt.to(self.model.device)
        if self.setup is None:
            with self._recording() as seen:
                self._generate(prompt, 1)
            self.setup = f"{seen['cache']}, {'compiled' if seen['compiled'] else 'not compiled'}"
        started = time.perf_counter()
        out = self._generate(prompt, max_new_tokens)
        return out[0, prompt.shape[1] :].tolist(), time.perf_counter() - started, None

    def _generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return self.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, **self.generate_kwargs
        )

    @contextlib.contextmanager
    def _recording(self) -> Iterator[dict]:
        """Within the block, the first cache the model is called with, and ``generate``'s compile decisions."""
        seen = {"cache": "no cache", "compiled": False}
        model = unwrapped(self.model)  # (what generate runs: a PEFT model's base model, a compiled module's)
        decide = getattr(model, "_valid_auto_compile_criteria", None)

        def recording_decision(*args, **kwargs) -> bool:
            compiles = decide(*args, **kwargs)
            seen["compiled"] |= bool(compiles)
            return compiles

        def first_cache(module, args, kwargs) -> None:
            if seen["cache"] == "no cache" and cache_in(kwargs) is not None:
                seen["cache"] = type(cache_in(kwargs)).__name__

        handle = model.register_forward_pre_hook(first_cache, with_kwargs=True)
        if decide is not None:
            model._valid_auto_compile_criteria = recording_decision
        try:
            yield seen
        finally:
            handle.remove()
            if decide is not None:
                del model._valid_auto_compile_criteria


def hf_method(model: torch.nn.Module, **generate_kwargs) -> HFMethod:
    """:class:`HFMethod`: ``model.generate`` with these extra arguments."""
    return HFMethod(model, **generate_kwargs)


def specula_method(
    model: torch.nn.Module, make_proposer: Callable[[], Proposer | None], predicted_with=None, **generate_kwargs
) -> Method:
    """``specula.generate`` with a fresh proposer per request and extra arguments (e.g. ``do_sample=True``); given
    ``predicted_with`` (the tokenizer that encodes predictions), with each request's prediction."""

    def run(prompt: torch.Tensor, max_new_tokens: int, prediction: object = None):
        given = (
            {"prediction": prediction, "tokenizer": predicted_with}
            if predicted_with is not None and prediction is not None
            else {}
        )
        out = generate(model, prompt, make_proposer(), max_new_tokens=max_new_tokens, **generate_kwargs, **given)
        return out.sequences[0, prompt.shape[1] :].tolist(), out.stats.wall_time_s, out.stats

    return run


def hf_batch_method(model: torch.nn.Module, pad_token_id: int | None, **generate_kwargs) -> BatchMethod:
    """``model.generate`` on the prompts left-padded into batches of ``batch_size`` in turn (static batches: HF's
    ``generate`` has no slots to refill); each row's new tokens end at its first EOS."""
    generate_kwargs.setdefault("do_sample", False)
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])

    def run(prompts: list[torch.Tensor], max_new_tokens: int, batch_size: int):
        rows, seconds = [], 0.0
        for first in range(0, len(prompts), batch_size):
            ids, mask = left_padded([p.to(model.device) for p in prompts[first : first + batch_size]], pad_token_id)
            started = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, **generate_kwargs
            )
            seconds += time.perf_counter() - started
            for tokens in out[:, ids.shape[1] :].tolist():
                rows.append(tokens[: next((i + 1 for i, token in enumerate(tokens) if token in eos), len(tokens))])
        return rows, seconds, None

    return run


def specula_batch_method(
    model: torch.nn.Module, make_proposer: Callable[[], Proposer | None], **generate_kwargs
) -> BatchMethod:
    """specula decoding the prompts ``batch_size`` at a time with continuous batching, as ``specula generate
    --batch-size`` runs a file: one fresh proposer for the run."""

    def run(prompts: list[torch.Tensor], max_new_tokens: int, batch_size: int):
        jobs = []
        for key, prompt in enumerate(prompts):
            (job,) = prepare_jobs(
                model, prompt[None].to(model.device), max_new_tokens=max_new_tokens, **generate_kwargs
            )
            job.key = key
            jobs.append(job)
        decoder = Decoder(
            model,
            make_proposer(),
            batch_size,
            exact=generate_kwargs.get("exact"),
            compile=generate_kwargs.get("compile"),
        )
        started = time.perf_counter()
        rows = decode_all(decoder, jobs)
        seconds = time.perf_counter() - started
        stats = SpecStats.total([rows[k].stats for k in range(len(prompts))], decoder.passes, seconds, 0.0)
        return [rows[k].sequence.ids[len(prompt) :].tolist() for k, prompt in enumerate(prompts)], seconds, stats

    return run


def oracle_method(
    model: torch.nn.Module, reference: Method, num_draft: int = 10, max_rounds: int = 8, **generate_kwargs
) -> Method:
    """The speed of a perfect proposer: ``specula.generate`` with :class:`Replay` of the output it will produce,
    every draft ``num_draft`` tokens long (``adaptive_draft=False``).

    In fp32 that output is what ``reference`` (specula with a proposer) generated. In bf16 a verification pass
    over another number of tokens can round a near-tie differently, so the replay can leave the reference; the
    reference is then replaced by what the replay generated, until a replay reproduces it (untimed, once per prompt):
    verification blocks are then the same every run, and so are the tokens.
    """
    outputs: dict[tuple, list[int]] = {}

    def replay(prompt: torch.Tensor, output: list[int], max_new_tokens: int):
        out = generate(
            model,
            prompt,
            Replay([prompt[0].tolist() + output], num_draft),
            max_new_tokens=max_new_tokens,
            adaptive_draft=False,
            **generate_kwargs,
        )
        return out.sequences[0, prompt.shape[1] :].tolist(), out.stats

    def run(prompt: torch.Tensor, max_new_tokens: int, prediction: object = None):
        key = (tuple(prompt[0].tolist()), max_new_tokens)
        if key not in outputs:
            output = reference(prompt, max_new_tokens)[0]
            for _ in range(max_rounds):
                replayed, _ = replay(prompt, output, max_new_tokens)
                if replayed == output:
                    break
                output = replayed
            outputs[key] = output
        tokens, stats = replay(prompt, outputs[key], max_new_tokens)
        return tokens, stats.wall_time_s, stats

    return run


@dataclass
class BenchRow:
    workload: str
    method: str
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup_vs_hf_greedy: float
    identical_to_greedy: float | None  # share of prompts whose output equals the baseline's (None: not compared)
    repeatable: float | None  # share of prompts whose output was the same in every repeat (None: not compared)
    acceptance_rate: float | None
    tokens_per_pass: float | None
    drafted: int  # draft tokens sent to the target, all prompts (last repeat)
    tree_passes: int = 0  # passes that sent a tree (last repeat), their draft tokens, and the tokens they accepted
    tree_drafted: int = 0  # beyond their first branches (SpecStats)
    tree_gain: int = 0
    accepted_prediction_tokens: int = 0  # a row with predictions: their tokens verified and kept / rejected
    rejected_prediction_tokens: int = 0  # (last repeat, all prompts)
    hf_setup: str | None = None  # a model.generate row: the cache it used, whether it compiled (HFMethod.setup)
    verification: str | None = None  # a specula row: exact or ordinary verification, and why (SpecStats.exactness)

    def as_dict(self) -> dict:
        return asdict(self)


def run_bench(
    methods: dict[str, Method],
    tokenizer,
    workloads: dict[str, list[dict]],
    max_new_tokens: int,
    repeats: int = 3,
    baseline: str = "hf-greedy",
    progress: Callable[[str], None] | None = None,
    compare_outputs: bool = True,
    outputs: dict | None = None,
    seed: int | None = None,
) -> list[BenchRow]:
    """Run every method on every prompt ``repeats`` times, rotating the order, and summarise per workload.

    Time per prompt is the median over repeats; a workload's tokens/s is its total new tokens over the summed
    medians; speedups are against ``baseline``. With ``compare_outputs``, output identity is judged against
    ``baseline``'s output on the same prompt (when sampling, with ``seed``: every run on the ``i``-th prompt of a
    workload starts from ``torch.manual_seed(seed + i)``). ``outputs``, if given, receives the baseline's output
    per ``(workload, prompt index)``, for :func:`run_batch_bench`.
    """
    names, baseline_outputs = list(methods), outputs
    rows: list[BenchRow] = []
    with _interruptible(rows):
        warm = encode(tokenizer, next(iter(workloads.values()))[0])
        for method in methods.values():  # compile kernels, fill allocator caches
            method(warm, 4)
        for workload, requests in workloads.items():
            totals = {name: dict.fromkeys(_COUNTERS, 0) for name in names}
            measured = []  # the prompts measured so far: a bench stopped half-way reports them
            try:
                for index, request in enumerate(requests):
                    times, outputs, varied = _runs(
                        methods, encode(tokenizer, request), max_new_tokens, repeats, index, seed, request.prediction
                    )
                    if baseline_outputs is not None:
                        baseline_outputs[workload, index] = outputs[baseline][0]
                    for name in names:
                        _add(
                            totals[name],
                            *outputs[name],
                            statistics.median(times[name]),
                            outputs[baseline][0],
                            name not in varied,
                        )
                    measured.append(index)
                    if progress:
                        progress(f"{workload} {index + 1}/{len(requests)}")
            finally:
                if measured:
                    base_rate = totals[baseline]["tokens"] / totals[baseline]["seconds"]
                    rows += [
                        _row(
                            workload,
                            name,
                            len(measured),
                            totals[name],
                            base_rate,
                            compare_outputs,
                            getattr(methods[name], "setup", None),
                        )
                        for name in names
                    ]
    return rows


class BenchInterrupted(Exception):
    """Ctrl-C stopped a bench: ``rows`` holds what was measured (a workload cut short: its prompts measured so
    far)."""

    def __init__(self, rows: list[BenchRow]) -> None:
        super().__init__(f"interrupted after {len(rows)} rows")
        self.rows = rows


@contextlib.contextmanager
def _interruptible(rows: list[BenchRow]) -> Iterator[None]:
    """Ctrl-C within becomes :class:`BenchInterrupted` with ``rows`` as they are then."""
    try:
        yield
    except KeyboardInterrupt:
        raise BenchInterrupted(rows) from None


_STATS_COUNTERS = ("drafted", "accepted", "passes", *TREE_COUNTERS, *PREDICTION_COUNTERS)
_COUNTERS = ("tokens", "seconds", "same", "repeatable", *_STATS_COUNTERS)


def _runs(
    methods: dict[str, Method],
    prompt: torch.Tensor,
    max_new_tokens: int,
    repeats: int,
    index: int,
    seed: int | None,
    prediction: object = None,
) -> tuple[dict[str, list[float]], dict[str, tuple[list[int], object]], set[str]]:
    """Every method on one prompt (and its ``prediction``) ``repeats`` times, the order rotated by prompt and
    repeat: each method's times, its last output and stats, and the methods whose output changed between repeats."""
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, tuple[list[int], object]] = {}
    varied: set[str] = set()
    for repeat in range(repeats):
        shift = (index + repeat) % len(names)
        for name in names[shift:] + names[:shift]:
            if seed is not None:
                torch.manual_seed(seed + index)
            tokens, seconds, stats = methods[name](prompt, max_new_tokens, prediction)
            times[name].append(seconds)
            if name in outputs and outputs[name][0] != tokens:
                varied.add(name)
            outputs[name] = (tokens, stats)
    return times, outputs, varied


def _add(
    total: dict, tokens: list[int], stats: SpecStats | None, seconds: float, reference: list[int], repeatable: bool
) -> None:
    """One prompt's run of a method into the method's totals for its workload."""
    total["tokens"] += len(tokens)
    total["seconds"] += seconds
    total["same"] += tokens == reference
    total["repeatable"] += repeatable
    if stats is not None:
        for counter in _STATS_COUNTERS:
            total[counter] += getattr(stats, counter)
        if stats.exactness is not None:
            total["verification"] = str(stats.exactness)


def _row(
    workload: str, name: str, prompts: int, total: dict, base_rate: float, compare_outputs: bool, hf_setup: str | None
) -> BenchRow:
    rate = total["tokens"] / total["seconds"]
    return BenchRow(
        workload=workload,
        method=name,
        prompts=prompts,
        new_tokens=total["tokens"],
        seconds=total["seconds"],
        tokens_per_s=rate,
        speedup_vs_hf_greedy=rate / base_rate,
        identical_to_greedy=total["same"] / prompts if compare_outputs else None,
        repeatable=total["repeatable"] / prompts if compare_outputs else None,
        acceptance_rate=total["accepted"] / total["drafted"] if total["drafted"] else None,
        tokens_per_pass=total["tokens"] / total["passes"] if total["passes"] else None,
        drafted=total["drafted"],
        **{counter: total[counter] for counter in TREE_COUNTERS + PREDICTION_COUNTERS},
        hf_setup=hf_setup,
        verification=total.get("verification"),
    )


def run_batch_bench(
    methods: dict[str, BatchMethod],
    tokenizer,
    workloads: dict[str, list[dict]],
    max_new_tokens: int,
    batch_size: int,
    baseline_rates: dict[str, float],
    reference: dict | None = None,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Throughput of each batch method over each whole workload, ``batch_size`` prompts at a time: total new tokens
    over the summed median seconds of the batches. Speedups are against ``baseline_rates`` (tokens/s of
    ``model.generate`` one prompt at a time, per workload); identity against ``reference`` (per ``(workload, prompt
    index)``, that baseline's outputs), where given."""
    rows: list[BenchRow] = []
    with _interruptible(rows):
        for workload, requests in workloads.items():
            prompts = [encode(tokenizer, request)[0] for request in requests]
            for row in _batch_rows(
                methods,
                prompts,
                workload,
                max_new_tokens,
                batch_size,
                baseline_rates[workload],
                reference,
                repeats,
                progress,
            ):
                rows.append(row)
    return rows


def _batch_rows(
    methods: dict[str, BatchMethod],
    prompts: list[torch.Tensor],
    workload: str,
    max_new_tokens: int,
    batch_size: int,
    baseline_rate: float,
    reference: dict | None,
    repeats: int,
    progress: Callable[[str], None] | None,
) -> Iterator[BenchRow]:
    """:func:`run_batch_bench`'s rows of one workload, one method at a time."""
    for name, method in methods.items():
        runs = [method(prompts, max_new_tokens, batch_size) for _ in range(repeats)]
        outputs, _, stats = runs[-1]
        seconds = statistics.median(run[1] for run in runs)
        tokens = sum(map(len, outputs))
        repeatable = sum(all(run[0][k] == outputs[k] for run in runs) for k in range(len(prompts)))
        same = sum(outputs[k] == reference[workload, k] for k in range(len(prompts))) if reference is not None else 0
        if progress:
            progress(f"{workload} {name}")
        rate = tokens / seconds
        yield BenchRow(
            workload=workload,
            method=name,
            prompts=len(prompts),
            new_tokens=tokens,
            seconds=seconds,
            tokens_per_s=rate,
            speedup_vs_hf_greedy=rate / baseline_rate,
            identical_to_greedy=same / len(prompts) if reference is not None else None,
            repeatable=repeatable / len(prompts),
            acceptance_rate=stats.acceptance_rate if stats is not None and stats.drafted else None,
            tokens_per_pass=stats.tokens_per_pass if stats is not None else None,
            drafted=stats.drafted if stats is not None else 0,
            **({counter: getattr(stats, counter) for counter in TREE_COUNTERS} if stats is not None else {}),
            verification=str(stats.exactness) if stats is not None and stats.exactness is not None else None,
        )


HF_PROMPT_LOOKUP_TOKENS = 10  # hf-prompt-lookup's prompt_lookup_num_tokens (HF's documented example value)


def method_name(spec: str) -> str:
    """A proposer's row in the bench table: ``specula-NAME[:ARG]``, a draft model's ``specula-draft``."""
    return "specula-" + ("draft" if spec.startswith("draft:") else spec)


def one_at_a_time(
    model: torch.nn.Module,
    tokenizer,
    proposers: list[str],
    sampling: dict,
    baseline: str,
    predicted: bool = False,
    also_ordinary: bool = False,
    oracle: bool = True,
    compile: bool | None = None,
) -> dict[str, Method]:
    """The methods bench runs one prompt at a time: ``model.generate`` (as ``baseline``), its prompt lookup (not for
    models with recurrent state, which HF's assisted generation refuses), each of ``proposers`` (``predicted``: the
    workload lines carry predictions, so also with them; ``also_ordinary``: also with ordinary verification), and
    (greedy, ``oracle``) the oracle, which replays the first proposer's output."""
    methods = {baseline: hf_method(model, **sampling)}
    if not getattr(model, "_is_stateful", False):
        methods["hf-prompt-lookup"] = hf_method(model, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS, **sampling)
    for spec in proposers:
        factory = proposer_factory(spec, tokenizer, model.dtype, model.device)
        methods[method_name(spec)] = specula_method(model, factory, compile=compile, **sampling)
        if predicted:
            methods[method_name(spec) + "+prediction"] = specula_method(
                model, factory, predicted_with=tokenizer, compile=compile, **sampling
            )
        if also_ordinary:
            methods[method_name(spec) + "-ordinary"] = specula_method(model, factory, exact=False, **sampling)
    if not sampling.get("do_sample") and oracle:
        methods["oracle"] = oracle_method(model, methods[method_name(proposers[0])], **sampling)
    return methods


def run_batch_sizes(
    model: torch.nn.Module,
    tokenizer,
    proposers: list[str],
    sampling: dict,
    baseline: str,
    workloads: dict[str, list[dict]],
    max_new_tokens: int,
    sizes: list[int],
    baseline_rates: dict[str, float],
    reference: dict | None = None,
    repeats: int = 3,
    compile: bool | None = None,
) -> list[BenchRow]:
    """:func:`run_batch_bench` for each batch size of ``sizes``: ``model.generate`` on left-padded batches (prompts
    padded with the tokenizer's pad token, else its EOS token), each of ``proposers`` with continuous batching."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows: list[BenchRow] = []
    for size in sizes:
        methods = {f"{baseline}-b{size}": hf_batch_method(model, pad, **sampling)}
        for spec in proposers:
            factory = proposer_factory(spec, tokenizer, model.dtype, model.device)
            methods[f"{method_name(spec)}-b{size}"] = specula_batch_method(model, factory, compile=compile, **sampling)
        try:
            rows += run_batch_bench(
                methods, tokenizer, workloads, max_new_tokens, size, baseline_rates, reference, repeats
            )
        except BenchInterrupted as stop:  # (with the rows of the sizes before)
            raise BenchInterrupted(rows + stop.rows) from None
    return rows


def format_table(rows: list[BenchRow]) -> str:
    """A plain-text table, one block per workload."""
    workload_width = max([11] + [len(row.workload) + 2 for row in rows])
    method_width = max([29] + [len(row.method) + 2 for row in rows])
    header = (
        f"{'workload':<{workload_width}}{'method':<{method_width}}{'tok/s':>8}{'speedup':>9}{'identical':>11}"
        f"{'repeatable':>12}{'accept':>8}{'tok/pass':>10}{'trees':>20}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        accept = f"{row.acceptance_rate:.0%}" if row.acceptance_rate is not None else "-"
        identical = f"{row.identical_to_greedy:.0%}" if row.identical_to_greedy is not None else "-"
        repeatable = f"{row.repeatable:.0%}" if row.repeatable is not None else "-"
        per_pass = f"{row.tokens_per_pass:.2f}" if row.tokens_per_pass is not None else "-"
        # passes that sent a tree, their mean size, and the tokens they gained over their first branches
        trees = (
            f"{row.tree_passes} x{row.tree_drafted / row.tree_passes:.1f} +{row.tree_gain}" if row.tree_passes else "-"
        )
        lines.append(
            f"{row.workload:<{workload_width}}{row.method:<{method_width}}{row.tokens_per_s:>8.1f}"
            f"{row.speedup_vs_hf_greedy:>8.2f}x"
            f"{identical:>11}{repeatable:>12}{accept:>8}{per_pass:>10}{trees:>20}"
        )
    setups = {row.method: row.hf_setup for row in rows if row.hf_setup is not None}
    if setups:
        lines.append("model.generate decoded with: " + "; ".join(f"{name} {setup}" for name, setup in setups.items()))
    predicted = [row for row in rows if row.accepted_prediction_tokens or row.rejected_prediction_tokens]
    if predicted:
        lines.append(
            "prediction tokens verified, accepted / rejected: "
            + "; ".join(
                f"{row.workload} {row.method} {row.accepted_prediction_tokens} / {row.rejected_prediction_tokens}"
                for row in predicted
            )
        )
    verified = {row.method: row.verification for row in rows if row.verification is not None}
    if verified:
        lines.append("specula verified: " + "; ".join(f"{name} {how}" for name, how in verified.items()))
    return "\n".join(lines)
