"""Requests decoded into answer lines, as ``specula generate`` does it, on this machine or in Ray workers: up to a
batch of them at a time in the same passes (continuous batching), each with its own settings, as
``specula.generate`` would decode it alone."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from jinja2 import TemplateError
from transformers import LogitsProcessorList

from ..core.logprobs import TokenLogprob
from ..core.stats import SpecStats
from ..decoding.budget import CacheBudget, OverBudget
from ..decoding.driver import finished_rows
from ..decoding.loop import Decoder, Job, Row, room
from ..hf.generate import prepare_jobs
from ..hf.grammar import GrammarConstraint, guide_grammar
from ..hf.inputs import eos_ids
from ..hf.penalties import AllowedTokens, PresenceFrequencyPenalty, word_token_ids
from ..hf.tools import call_grammar, read_calls
from ..machine.memory import spare_bytes
from ..policy.batch_size import fastest_batch_size, kept_batch_size
from ..verifier.adapters import BASE, adapters_of
from ..verifier.exactness import choose
from ..verifier.row_exact import is_half_precision
from ..verifier.static import compiles
from ..verifier.support import context_limit, model_device, tokens_meet, vocab_size
from .line_formats import answer_line
from .requests import Request, encode, model_name, names_model

GRAMMARS = ("response_format", "guided_choice", "guided_regex", "guided_grammar", "tool_choice")  # what asks for one
FREE_SHARE = 0.5  # of the memory free at start, what the cache may take where --max-memory is not given
REMEASURE = 256  # requests between measurements of the batch size, where it is measured (not given)


@dataclass
class Settings:
    """The run's defaults, the same wherever its requests run: what a request line does not say for itself (the
    command line's options)."""

    max_new_tokens: int | None = 256  # None: as many as the model's context leaves after the prompt (OpenAI's API)
    sampling: dict = field(default_factory=dict)  # do_sample / temperature / top_k / top_p, as generate() takes them
    seed: int | None = None  # a request on line n without its own "seed" draws from a generator seeded ``seed + n``
    exact: bool | Literal["invariant"] | None = None
    compile: bool | None = None  # compiled passes (None: where a pass is mostly launching kernels, specula.generate)
    batch_size: int | None = None  # None: the size measured fastest on this machine
    predictions: bool = False  # whether requests may bring predictions ("prediction")
    model_name: str | None = None  # what answers call the model (None: its folder's name, :func:`model_name`)
    adapters: tuple[str, ...] = ()  # the PEFT adapters it holds, which a request's "model" may name (:func:`named`)
    max_memory: int | None = None  # bytes the cache's keys and values may take (None: a share of what is free)


def generate_options(request: Request, settings: Settings, device: torch.device | str, choice: int = 0) -> dict:
    """The ``generate()`` arguments that decode ``request`` (its ``choice``-th answer, of OpenAI's ``n``: drawn
    from the seed after the first's, where seeded): its own settings (OpenAI's names) over the run's; what neither
    gives comes from the model's generation config, as in ``model.generate``."""
    own = request.options
    sampling = dict(settings.sampling)
    if "temperature" in own:
        sampling = (
            {"do_sample": False}
            if own["temperature"] == 0
            else {**sampling, "do_sample": True, "temperature": float(own["temperature"])}
        )
    if "top_k" in own:
        sampling["top_k"] = max(own["top_k"], 0)  # (-1, vLLM's "every token", is 0 to transformers)
    if "top_p" in own:
        sampling["top_p"] = float(own["top_p"])
    if "min_p" in own:
        sampling["min_p"] = float(own["min_p"])
    if sampling.get("do_sample") is False:  # (greedy: no sampling settings to warn about)
        sampling = {"do_sample": False}
    seed = own.get("seed", None if settings.seed is None else settings.seed + request.line)
    seed = None if seed is None else seed + choice
    renamed = {"stop": "stop_strings", "min_tokens": "min_new_tokens", "repetition_penalty": "repetition_penalty"}
    return {
        "max_new_tokens": own.get("max_tokens", settings.max_new_tokens),
        **sampling,
        # each request its own random stream, so that its answer does not depend on its batch-mates
        **({} if seed is None else {"generator": [torch.Generator(device).manual_seed(seed)]}),
        **{renamed[name]: value for name, value in own.items() if name in renamed},
        # OpenAI's logit bias, per token: transformers' bias of one-token sequences
        **(
            {"sequence_bias": {(token,): bias for token, bias in own["logit_bias"].items()}}
            if "logit_bias" in own
            else {}
        ),
    }


def named(settings: Settings, model) -> Settings:
    """``settings`` with the name answers call the model (given, else its folder's: :func:`model_name`) and the
    names of the adapters it holds."""
    return replace(
        settings,
        model_name=settings.model_name
        or (model_name(model.name_or_path) if model.name_or_path else model.config.model_type),
        adapters=tuple(adapters_of(model)),
    )


def names(settings: Settings) -> tuple[str, ...]:
    """What a request's ``"model"`` may name: the model, or one of its adapters."""
    return (settings.model_name, *settings.adapters)


def adapter_of(request: Request, settings: Settings) -> str | None:
    """The adapter a request's passes take: the one its ``"model"`` names; none (:data:`BASE`) where it names the
    model itself and the model holds adapters; the active one (``None``) where it names nothing."""
    if request.model is None or not settings.adapters:
        return None
    return next((name for name in settings.adapters if names_model(request.model, name)), BASE)


def answered_by(request: Request, settings: Settings) -> str:
    """The name an answer gives its model: the adapter the request named, else the model's."""
    adapter = adapter_of(request, settings)
    return settings.model_name if adapter in (None, BASE) else adapter


def batch_size(model, settings: Settings, largest: int = 32) -> int:
    """The batch size requests are decoded in: ``settings.batch_size`` where given, else the fastest here (up to
    ``largest``), measured once per machine and model and kept (a file of a few requests does not wait for it on
    every run); where the batch size cannot change what a request decodes to, a long run measures it again as it
    goes (:meth:`Answerer.__call__`)."""
    if tokens_meet(model):  # (its rows decode one at a time: specula.Decoder)
        return 1
    if settings.batch_size is not None:
        return settings.batch_size
    return kept_batch_size(model, largest)


def _fixed(model, settings: Settings) -> bool:
    """Whether the kept batch size holds for the whole run: where it changes what a request decodes to (ordinary
    bf16/fp16 verification rounds by the rows of a pass), it must not follow the load of the moment."""
    return settings.batch_size is None and is_half_precision(model) and not choose(model, settings.exact).exact


def cache_budget(model, settings: Settings) -> CacheBudget | None:
    """The memory budget of the run's cache: ``settings.max_memory``, else :data:`FREE_SHARE` of the memory free now
    (after the model loaded); ``None`` where that is not known."""
    limit = settings.max_memory
    if limit is None:
        spare = spare_bytes(model_device(model))
        limit = None if spare is None else int(spare * FREE_SHARE)
    if limit is None:
        return None
    return CacheBudget.of(model, limit, bool(compiles(model, settings.compile, choose(model, settings.exact).exact)))


def jobs_of(model, tokenizer, request: Request, settings: Settings, budget: CacheBudget | None = None) -> list[Job]:
    """The jobs that decode ``request``'s answers (OpenAI's ``n``; keys ``(request, choice)``): one per choice, each
    its own random stream, or one alone where they would all be the same (greedy); a ``ValueError`` (or the chat
    template's ``TemplateError``) where it cannot be decoded, such as a prompt longer than the model's context, or
    one whose cache would not fit ``budget`` even alone."""
    first = job_of(model, tokenizer, request, settings, budget)
    if first.sampling.greedy:
        return [first]
    return [
        first,
        *(job_of(model, tokenizer, request, settings, budget, choice) for choice in range(1, choices(request))),
    ]


def choices(request: Request) -> int:
    """How many answers ``request`` asks for (OpenAI's ``n``)."""
    return request.options.get("n", 1)


def job_of(
    model, tokenizer, request: Request, settings: Settings, budget: CacheBudget | None = None, choice: int = 0
) -> Job:
    """The job that decodes ``request``'s ``choice``-th answer (its key: ``(request, choice)``) with its own
    settings over the run's (:func:`jobs_of`)."""
    device = model_device(model)
    for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
        outside = [token for token in request.options.get(name, ()) if token >= vocab_size(model)]
        if outside:  # (transformers would find it at the first pass, in the middle of a batch)
            raise ValueError(
                f'"{name}" names token ids outside the model\'s vocabulary of {vocab_size(model)}: {outside[:5]}'
            )
    prompt, options = encode(tokenizer, request).to(device), generate_options(request, settings, device, choice)
    open_ended = options["max_new_tokens"] is None
    if open_ended:  # (the rest of the context; a prompt that fills it is refused below)
        limit = context_limit(model)
        if limit is None:  # (a model that states no context: its generation config's length, as model.generate)
            del options["max_new_tokens"]
        else:
            options["max_new_tokens"] = max(limit - prompt.shape[1], 1)
    stop_ids, ignore_eos = frozenset(request.options.get("stop_token_ids", ())), request.options.get("ignore_eos")
    if stop_ids or ignore_eos:  # (vLLM's: tokens that end the answer as its end of sequence does; on past that)
        ends = frozenset() if ignore_eos else eos_ids(model.generation_config.eos_token_id)
        options["eos_token_id"] = sorted(ends | stop_ids)
    processors = LogitsProcessorList()  # (OpenAI's settings transformers has no name for, applied after its own)
    penalties = {name: request.options.get(f"{name}_penalty", 0) for name in ("frequency", "presence")}
    if any(penalties.values()):  # (over the output)
        processors.append(PresenceFrequencyPenalty(prompt.shape[1], **penalties))
    if "allowed_token_ids" in request.options:
        processors.append(AllowedTokens(request.options["allowed_token_ids"], vocab_size(model)))
    if "bad_words" in request.options:
        options["bad_words_ids"] = word_token_ids(tokenizer, request.options["bad_words"])
    grammar = guide_grammar(request.options)  # (the output held to a JSON schema, a regex, a choice)
    if "tool_choice" in request.options:  # (a call required: the output held to calls of its tools)
        asked, one = request.options["tool_choice"], not request.options.get("parallel_tool_calls", True)
        name = asked["function"]["name"] if isinstance(asked, dict) else None
        grammar = call_grammar(tokenizer, request.options["tools"], name, one)
    if grammar is not None:
        try:
            processors.append(GrammarConstraint(tokenizer, vocab_size(model), grammar, prompt.shape[1]))
        except ValueError as error:  # (named by the field that asked for a grammar)
            held = next(name for name in GRAMMARS if name in request.options)
            raise ValueError(f'"{held}": {error}') from None
    if processors:
        options["logits_processor"] = processors
    empty = options.get("max_new_tokens") == 0  # (echo's: the prompt alone; generate() makes a token at least)
    (job,) = prepare_jobs(
        model,
        prompt,
        prediction=request.prediction,
        tokenizer=tokenizer,
        **options | ({"max_new_tokens": 1} if empty else {}),
    )
    if empty:
        job.max_new_tokens = 0
    job.open_ended = open_ended
    if budget is not None and (why := budget.refusal(room(job))):
        raise OverBudget(why)
    job.key, job.adapter, job.logprobs = (
        (request, choice),
        adapter_of(request, settings),
        request.options.get("logprobs"),
    )
    if request.options.get("echo"):  # (its prompt's tokens are listed too: their log probabilities where asked)
        job.prompt_logprobs = job.logprobs
    return job


def answer_of(rows: list[Row], request: Request, tokenizer, settings: Settings) -> dict:
    """The answer line of ``request``'s finished rows, a choice each (one row of a greedy request gives every
    choice it asks for: :func:`jobs_of`)."""
    made = [choice_of(row, request, tokenizer) for row in rows] * (choices(request) if len(rows) == 1 else 1)
    stats = rows[0].stats if len(rows) == 1 else SpecStats.total([row.stats for row in rows], 0, 0.0, 0.0)
    return answer_line(
        request,
        made,
        len(rows[0].job.prompt),
        len(made) * stats.new_tokens if len(rows) == 1 else stats.new_tokens,
        _stats(stats, rows, rows[0].job.prediction is not None),
        answered_by(request, settings),
    )


def choice_of(row: Row, request: Request, tokenizer) -> dict:
    """One choice of an answer: its text ends before a stop string (OpenAI's ``stop``), after its prompt where it
    asks for ``echo``; it finished for a ``"stop"`` (EOS, a stop string) or for its ``"length"``; its tokens' log
    probabilities where asked."""
    output, skip = row.output, request.options.get("skip_special_tokens", True)
    text = tokenizer.decode(output, skip_special_tokens=skip)
    content, stop = stopped_text(text, request.options)
    stopped = stop or (len(output) > 0 and int(output[-1]) in row.job.eos_token_ids)
    listed = row.logprobs[: content_tokens(row, tokenizer, content, skip)] if row.job.logprobs is not None else None
    if request.options.get("echo"):  # (a text completion's prompt before its answer, its tokens listed first)
        content = request.prompt + content
        listed = None if listed is None else row.prompt_logprobs + listed
    calls = []
    if "tools" in request.options:  # (the calls it wrote, and the text before them)
        content, calls = read_calls(content, {tool["function"]["name"] for tool in request.options["tools"]})
    return {
        "text": content,
        "finish_reason": "tool_calls" if calls and stopped else "stop" if stopped else "length",
        "logprobs": None if listed is None else logprob_entries(listed, tokenizer),
    } | ({"tool_calls": [call.openai(f"call_{uuid.uuid4().hex[:24]}") for call in calls]} if calls else {})


def stopped_text(text: str, options: dict) -> tuple[str, bool]:
    """``text`` up to the first stop string it holds (``options``' ``stop``; with vLLM's
    ``include_stop_str_in_output``, that string included), and whether it held one.

    >>> stopped_text("a. b. c", {"stop": [". c", "."]})
    ('a', True)
    >>> stopped_text("b. c", {"stop": ["."], "include_stop_str_in_output": True})
    ('b.', True)
    """
    ends = [(at, len(stop)) for at, stop in ((text.find(stop), stop) for stop in options.get("stop", ())) if at >= 0]
    if not ends:
        return text, False
    at, length = min(ends)
    return text[: at + length * options.get("include_stop_str_in_output", False)], True


def content_tokens(row: Row, tokenizer, content: str, skip: bool = True) -> int:
    """How many of ``row``'s output tokens make ``content`` (a prefix of its text, decoded skipping special tokens
    where ``skip``): not the EOS that ended it, nor the tokens of a stop string the text ends before (a token is
    content where the text before it is shorter)."""
    output = row.output.tolist()
    count = len(output) - (len(output) > 0 and output[-1] in row.job.eos_token_ids)
    while count and len(tokenizer.decode(output[: count - 1], skip_special_tokens=skip)) >= len(content):
        count -= 1
    return count


def logprob_entries(chosen: list[TokenLogprob], tokenizer) -> list[dict]:
    """Tokens with their log probabilities and alternatives, as OpenAI's chat completions list them (``{"token",
    "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``)."""
    ids = sorted({t.token for t in chosen} | {token for t in chosen for token, _ in t.top})
    texts = dict(zip(ids, tokenizer.batch_decode([[token] for token in ids])))

    def entry(token: int, logprob: float | None) -> dict:
        return {"token": texts[token], "logprob": logprob, "bytes": list(texts[token].encode())}

    return [entry(t.token, t.logprob) | {"top_logprobs": [entry(*pair) for pair in t.top]} for t in chosen]


def _stats(stats: SpecStats, rows: list[Row], predicted: bool) -> dict:
    """An answer's stats (``stats``: its rows' together; passes: those they took part in, seconds: until the last
    finished); with a prediction, its tokens verified and kept or rejected (OpenAI's names)."""
    return {
        "new_tokens": stats.new_tokens,
        "passes": sum(row.stats.passes for row in rows),
        "accepted": stats.accepted,
        "drafted": stats.drafted,
        "seconds": round(max(row.stats.wall_time_s for row in rows), 4),
        "exact": None if stats.exactness is None else stats.exactness.exact,
        "compiled": stats.compiled,
    } | (
        {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.rejected_prediction_tokens,
        }
        if predicted
        else {}
    )


class Answerer:
    """Decodes requests into answer lines (:mod:`specula.jobs.line_formats`, in each request's shape), up to
    ``settings.batch_size`` at a time in the same passes, each with its own settings, as ``specula.generate`` would
    decode it alone; a request that cannot be decoded (e.g. a prompt longer than the model's context) is passed to
    ``on_skip`` with its reason. Kept across calls, it keeps its proposer (an n-gram predictor keeps learning) and
    its batch size."""

    def __init__(self, model, tokenizer, proposer, settings: Settings, on_skip: Callable[[Request, str], None]) -> None:
        self.model, self.tokenizer, self.proposer, self.on_skip = model, tokenizer, proposer, on_skip
        self.settings = named(settings, model)
        self.budget = cache_budget(model, settings)
        self.slots = settings.batch_size
        self.sizes: list[int] = []  # the batch sizes that ran, for the summary
        self.comparisons = []  # each decoder's Decoder.plain_comparison(), for the summary
        self.disturbed = False  # whether other programs took the CPUs while a decoder ran (Decoder.disturbed)
        self.prefill_seconds = 0.0  # what its prefills took, for the summary
        self.exactness = None  # how the last call verified
        self.compiled: str | None = None  # ... and where its passes ran compiled (specula.verifier.static.compiles)
        self._waiting: dict[int, list[Row | None]] = {}  # by id of a request: its rows, a choice each, as they end

    def _jobs_of(self, request: Request) -> list[Job]:
        try:
            jobs = jobs_of(self.model, self.tokenizer, request, self.settings, self.budget)
        except (ValueError, TemplateError) as error:  # (the chat template's own refusal: roles out of order ...)
            self.on_skip(request, str(error))
            return []
        self._waiting[id(request)] = [None] * len(jobs)
        return jobs

    def __call__(
        self, requests: Iterable[Request], largest: int = 32, eager: bool = False
    ) -> Iterator[tuple[Request, dict]]:
        """(request, answer line) as requests finish (not in input order: see
        :class:`specula.jobs.answer_file.InputOrder`). ``largest`` bounds the measured batch size;
        ``eager`` prepares every request before decoding any. The batch size (:func:`batch_size`) is measured again
        every :data:`REMEASURE` requests (what was kept may be out of date for this moment's machine); where it
        changed, the requests in flight finish and the rest go on in batches of the new size. Where the batch size
        changes the answers (ordinary bf16/fp16 verification), the kept one holds for the whole run."""
        prepared = itertools.chain.from_iterable(map(self._jobs_of, requests))
        if eager:
            prepared = iter(list(prepared))
        measured = self.settings.batch_size is None and not _fixed(self.model, self.settings)
        while (first := next(prepared, None)) is not None:
            if self.slots is None:
                self.slots = batch_size(self.model, self.settings, largest)
            decoder = Decoder(
                self.model,
                self.proposer,
                self.slots,
                exact=self.settings.exact,
                predictions=self.settings.predictions,
                compile=self.settings.compile,
                budget=self.budget,
            )
            self.exactness = decoder.prepare().exactness
            self.compiled = decoder.compiles
            jobs = itertools.chain([first], prepared)
            try:
                for row in finished_rows(decoder, self._jobs(jobs, largest) if measured else jobs):
                    request, choice = row.job.key
                    rows = self._waiting[id(request)]
                    rows[choice] = row
                    if None not in rows:  # (its last choice)
                        del self._waiting[id(request)]
                        yield request, answer_of(rows, request, self.tokenizer, self.settings)
            finally:
                self.sizes.append(self.slots)
                self.comparisons.append(decoder.plain_comparison())
                self.disturbed = self.disturbed or decoder.disturbed
                self.prefill_seconds += decoder.prefill_seconds

    def plain_speedup(self) -> float | None:
        """The estimated speedup of every call so far against plain decoding of the same requests
        (:meth:`specula.Decoder.plain_comparison`); ``None`` where one decoder's is not known."""
        if not self.comparisons or None in self.comparisons:
            return None
        return sum(plain for plain, _ in self.comparisons) / sum(cost for _, cost in self.comparisons)

    def _jobs(self, prepared: Iterator[Job], largest: int) -> Iterator[Job]:
        """The jobs of ``prepared`` until, measured again after every :data:`REMEASURE` of them, the fastest batch
        size is another than the decoder's: then it becomes ``slots``, and the rest stay in ``prepared``."""
        for count, job in enumerate(prepared, start=1):
            yield job
            if count % REMEASURE == 0:
                size = fastest_batch_size(self.model, largest=largest, again=True)
                if size != self.slots:
                    self.slots = size
                    return
