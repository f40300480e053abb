"""specula's entry points, one path: ``specula.generate(model, input_ids, proposer)`` is
``model.generate(input_ids, custom_generate=specula.custom_generate, proposer=...)``. ``model.generate`` prepares
everything (generation config, logits processors and warpers, stopping criteria, stop strings, streamer) and hands it
to :func:`custom_generate`, which decodes with specula's loop instead of its own (:mod:`specula.hf.bridge`). Both
return :class:`GenerateOutput`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable, Literal

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

from ..core.stats import GenerateOutput
from ..decoding.loop import Job
from ..proposers.base import Proposer
from ..verifier.support import context_limit, vocab_size
from .bridge import decode, jobs_of, kept_outputs, prepared
from .inputs import check_max_new_tokens, check_prompt, eos_ids
from .predictions import PredictionInput, checked_predictions
from .wrapped import unwrapped


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    proposer: Proposer | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    eos_token_id: int | Iterable[int] | torch.Tensor | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: BaseStreamer | None = None,
    adaptive_draft: bool = True,
    exact: bool | Literal["invariant"] | None = None,
    prediction: PredictionInput = None,
    compile: bool | None = None,
    **generation_kwargs: Any,
) -> GenerateOutput:
    """Decode with ``model``, sped up by speculation, without changing what it generates.

    Each pass asks ``proposer`` for draft tokens, verifies ``[last token, d1..dK]`` in one forward pass of the
    target, keeps the draft prefix the target accepts plus one token of the target's own, and rolls the KV cache
    back past the rejected drafts. Greedy output is token for token ``model.generate``'s; sampled output has exactly
    its distribution (speculative sampling, see :mod:`specula.core.acceptance`). ``proposer=None`` decodes one token per
    pass through the same loop.

    Settings are resolved exactly as ``model.generate`` resolves them, by ``model.generate`` itself (this is
    ``model.generate(..., custom_generate=specula.custom_generate)``): what is not given comes from the model's
    ``generation_config`` -- ``do_sample`` and the sampling settings, ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens``, forced BOS/EOS, suppressed and bad words, ``max_new_tokens``, ``eos_token_id`` -- then from
    transformers' defaults. What specula cannot reproduce exactly (beam search, several sequences, assisted
    generation, attentions and hidden states) is refused with a ``ValueError``; ``output_logits=True`` and
    ``output_scores=True`` return each step's logits and processed scores as ``model.generate`` does (a row of a
    batch that ended earlier has zeros at the later steps).

    Args:
        model: any HF decoder-only causal LM (``AutoModelForCausalLM``), also inside a ``peft.PeftModel`` (its
            adapters applied, unmerged) or a module ``torch.compile`` returned (:mod:`specula.hf.wrapped`).
        input_ids: the prompts, shape ``[B, length]`` (or ``[length]`` for one), left-padded as for
            ``model.generate``; the rows are decoded together, each exactly as alone, each keeping the drafts it
            accepts (batches need models whose layers all cache full attention).
        proposer: where drafts come from, e.g. ``specula.PromptLookup()``; ``None`` for plain decoding.
        attention_mask: as in HF; zeros mark left padding (needed when the rows of a batch are padded).
        max_new_tokens, eos_token_id: as in ``model.generate``.
        do_sample: sample instead of decoding greedily; ``None`` follows the model's ``generation_config``.
        temperature, top_k, top_p: sampling settings, as in ``model.generate``; ``temperature=0`` decodes greedily.
        generator: random source for sampling; ``None`` uses torch's global RNG. For a batch, a list of one generator
            per row gives each row its own draws, so a request seeded alike samples the same alone and in any batch.
        logits_processor: extra HF logits processors, applied at every verified position with exactly the tokens
            before it, after the ones the generation config asks for.
        stopping_criteria: extra HF stopping criteria (e.g. ``StopStringCriteria``), checked after every new token.
        streamer: an HF streamer (``TextStreamer``, ``TextIteratorStreamer`` ...): gets the prompt, then the new
            tokens of every pass as soon as they are accepted.
        adaptive_draft: choose each pass's draft length from measured pass costs and running acceptance, and stop
            sending drafts that do not pay (:mod:`specula.policy.adaptive`); ``False`` verifies every draft as proposed.
        exact: ``True`` computes every position of a verification pass bit for bit as a one-token step computes it
            (row-exact, :mod:`specula.verifier.row_exact`), so that greedy output is ``model.generate``'s bit for bit
            in bf16 and fp16 too, whatever it costs; ``False`` verifies the plainly ordinary way, the cheapest (greedy
            output may then leave ``model.generate``'s at a near-tie, ``specula drift`` shows where, and follow the
            draft lengths and batch). ``None``
            (the default) chooses: in bf16 and fp16, exact where a row-exact pass costs at most 1.1x an ordinary one
            on this machine and model (measured once, kept: :mod:`specula.verifier.exactness`), else on a CPU
            ``"invariant"`` where it holds; in fp32 ordinary (its rounding is far below the gaps between logits).
            ``"invariant"``: ordinary passes (bf16/fp16) that round every row alike whatever its draft lengths and
            batch, where a check on the live model finds it holds (:mod:`specula.verifier.invariant`): output then
            follows neither (nor the load, nor the measurement store). ``stats.exactness`` says what was chosen and
            why.
        prediction: the output the request expects back, drafted from wherever the output follows it (the file
            being edited, last run's answer; :mod:`specula.proposers.prediction`): text (with ``tokenizer=``), token
            ids,
            or OpenAI's ``{"type": "content", "content": text}``; for a batch, a list of one per row (``None`` for a
            row without). The output is still the model's; ``stats.accepted_prediction_tokens`` and
            ``stats.rejected_prediction_tokens`` count its tokens verified and kept or rejected.
        compile: ``True`` runs every pass after the prefill compiled, at static shapes (CUDA graphs on a GPU, inductor
            on a CPU; :mod:`specula.verifier.static`), verifying the ordinary way; ``False`` runs them eagerly;
            ``None`` (the default) compiles where a pass is mostly the host's work of launching kernels (a GPU with
            a small model: measured once per machine and model, kept), never with row-exact verification.
        **generation_kwargs: any other ``model.generate`` argument: ``GenerationConfig`` fields
            (``repetition_penalty=1.2``, ``stop_strings=[...]`` with ``tokenizer=``, ...) or ``generation_config=``.

    Returns:
        :class:`GenerateOutput` (``model.generate``'s output with ``return_dict_in_generate=True``): ``sequences``
        (prompts + new tokens, ``[B, length]``, padded after a row's end as ``model.generate`` pads it) and ``stats``
        (batch totals, per-row stats in ``stats.rows``).
    """
    model = unwrapped(model)
    if not isinstance(model, GenerationMixin):
        raise TypeError(
            f"specula.generate needs a transformers causal LM (one with model.generate), got {type(model).__name__}; "
            "load it with AutoModelForCausalLM (a PEFT model or a torch.compile'd module around one is taken too)."
        )
    input_ids, attention_mask = check_prompt(model, input_ids, attention_mask, model.generation_config.pad_token_id)
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"A streamer takes one sequence, got a batch of {input_ids.shape[0]}; stream one request at a time, or "
            "drop the streamer for the batch."
        )
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens)
    if eos_token_id is not None:
        eos_ids(eos_token_id)
    if temperature == 0:  # greedy, as vLLM and most serving APIs read it; model.generate would refuse it
        do_sample, temperature = False, None
    given = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        streamer=streamer,
    )
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        custom_generate=custom_generate,
        proposer=proposer,
        generator=generator,
        adaptive_draft=adaptive_draft,
        exact=exact,
        prediction=prediction,
        compile=compile,
        return_dict_in_generate=True,
        **{name: value for name, value in given.items() if value is not None},
        **generation_kwargs,
    )


def custom_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    proposer: Proposer | None = None,
    tokenizer=None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    adaptive_draft: bool = True,
    exact: bool | Literal["invariant"] | None = None,
    prediction: PredictionInput = None,
    compile: bool | None = None,
    **model_kwargs,
) -> torch.LongTensor | GenerateOutput:
    """Decoding method for ``model.generate(custom_generate=specula.custom_generate, proposer=...)``.

    Greedy or sampled per the generation config, with the logits processors, stopping criteria (EOS, max length,
    ``stop_strings`` with ``tokenizer=``, custom ones) and streamer ``generate`` prepared; a stop inside an accepted
    block ends the output exactly there. Returns the sequences, or with ``return_dict_in_generate=True`` a
    :class:`GenerateOutput` (``sequences`` and specula's ``stats``; ``logits`` and ``scores`` where asked).
    ``generator`` (a ``torch.Generator`` on the
    model's device, or a list of one per row of a batch) makes sampling independent of torch's global RNG (and,
    one per row, of the other rows: a seeded request samples the same in any batch); ``adaptive_draft``,
    ``exact``, ``prediction`` (text encoded with ``tokenizer``) and ``compile`` as in :func:`specula.generate`.
    """
    del synced_gpus  # one process
    predictions = checked_predictions(
        prediction, input_ids.shape[0], vocab_size(model), tokenizer, context_limit(model)
    )
    request, sampling, generators = prepared(
        model, input_ids, logits_processor, generation_config, generator, model_kwargs
    )
    out = decode(
        model,
        request,
        proposer,
        sampling,
        stopping_criteria,
        streamer,
        adaptive_draft,
        exact,
        generators,
        predictions,
        compile,
        kept_outputs(generation_config),
    )
    return out if generation_config.return_dict_in_generate else out.sequences


def _jobs_only(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs) -> list[Job]:
    """A ``custom_generate`` that decodes nothing: the requests ``generate`` prepared, for :func:`prepare_jobs`. It
    declares :func:`custom_generate`'s signature (below), so ``generate`` hands it the same arguments."""
    own = inspect.signature(custom_generate).parameters
    predictions = checked_predictions(
        kwargs.get("prediction"), input_ids.shape[0], vocab_size(model), kwargs.get("tokenizer"), context_limit(model)
    )
    request, sampling, generators = prepared(
        model,
        input_ids,
        logits_processor,
        generation_config,
        kwargs.get("generator"),
        {k: v for k, v in kwargs.items() if k not in own},
    )
    return jobs_of(request, sampling, stopping_criteria, generators, predictions, kept_outputs(generation_config))


_jobs_only.__signature__ = inspect.signature(custom_generate)


def prepare_jobs(model: torch.nn.Module, input_ids: torch.Tensor, **generate_kwargs) -> list[Job]:
    """The requests (one per row of ``input_ids``) that ``specula.generate(model, input_ids, **generate_kwargs)``
    would decode, prepared by ``model.generate`` itself (generation config, logits processors, stopping criteria,
    each job's :class:`~specula.core.sampling.Sampling`), for a :class:`specula.decoding.loop.Decoder` that takes
    requests as they come: jobs
    prepared with other settings share its passes, each decoded with its own."""
    mask = generate_kwargs.pop("attention_mask", None)
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if mask is None else mask,
        custom_generate=_jobs_only,
        **generate_kwargs,
    )


def _keep_tokenizer_and_streamer(extract):
    """transformers 5.x (through 5.24 at least) forwards only a callable's *own* extra arguments: ``tokenizer``
    (which ``stop_strings`` needs) and ``streamer`` are dropped, so ``stop_strings`` fails and nothing is streamed.
    For :func:`custom_generate` only, put them back, as ``generate`` passes them to its built-in decoding methods."""
    signature = inspect.signature(extract)

    @functools.wraps(extract)
    def extract_keeping_them(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tokenizer = bound.arguments["kwargs"].get("tokenizer")
        mode_kwargs = extract(*args, **kwargs)
        if bound.arguments["custom_generate"] in (custom_generate, _jobs_only):
            for name, value in (("tokenizer", tokenizer), ("streamer", bound.arguments.get("streamer"))):
                if value is not None:
                    mode_kwargs[name] = value
        return mode_kwargs

    extract_keeping_them.keeps_tokenizer_and_streamer = True
    return extract_keeping_them


def _drops_tokenizer_or_streamer(extract) -> bool:
    """Whether the installed ``generate`` would drop ``tokenizer`` or ``streamer`` on their way to
    :func:`custom_generate` (asked of ``extract`` itself, with two markers: the patch is applied only where needed)."""
    if getattr(extract, "keeps_tokenizer_and_streamer", False) or not {
        "custom_generate",
        "kwargs",
        "streamer",
        "synced_gpus",
    } <= set(inspect.signature(extract).parameters):
        return False
    tokenizer, streamer = object(), object()
    try:
        kept = extract(
            torch.nn.Module(),
            custom_generate=custom_generate,
            kwargs={"tokenizer": tokenizer},
            synced_gpus=False,
            assistant_model=None,
            streamer=streamer,
        )
    except Exception:  # (a shape this module does not know: left alone, and the tests of stop strings will tell)
        return False
    return kept.get("tokenizer") is not tokenizer or kept.get("streamer") is not streamer


_extract = getattr(GenerationMixin, "_extract_generation_mode_kwargs", None)
if _extract is not None and _drops_tokenizer_or_streamer(_extract):
    GenerationMixin._extract_generation_mode_kwargs = _keep_tokenizer_and_streamer(_extract)
