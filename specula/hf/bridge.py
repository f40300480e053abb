"""From what ``model.generate`` prepared to specula's loop and back: the checked request and its sampling, one
:class:`~specula.decoding.loop.Job` per row, the loop's run over them, and the output ``model.generate`` would
return."""

from __future__ import annotations

import dataclasses
import time
from typing import Literal

import numpy as np
import torch
from transformers import EosTokenCriteria, GenerationConfig, MaxLengthCriteria, StoppingCriteriaList
from transformers.cache_utils import CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.streamers import BaseStreamer

from ..core.sampling import Sampling
from ..core.stats import GenerateOutput, SpecStats
from ..decoding.driver import decode_all
from ..decoding.loop import Decoder, Job
from ..proposers.base import Proposer
from ..verifier.adapters import adapter_layers, names_given
from ..verifier.cache_names import cache_in
from ..verifier.support import model_device
from .inputs import Request, prepare_request

_UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")


def prepared(model, input_ids, logits_processor, generation_config, generator, model_kwargs):
    """The checked request, its sampling and per-row generators (``None``: one stream) from what ``generate``
    prepared."""
    _refuse_what_cannot_be_exact(model, input_ids, generation_config, generator, cache_in(model_kwargs))
    request = prepare_request(
        model,
        input_ids,
        model_kwargs.get("attention_mask"),
        max(generation_config.max_length - input_ids.shape[1], 0),
        generation_config.eos_token_id,
        _pad_token_id(generation_config),
    )
    per_row = isinstance(generator, (list, tuple))
    sampling = Sampling(
        do_sample=bool(generation_config.do_sample),
        processors=logits_processor,
        generator=None if per_row else generator,
    )
    return request, sampling, list(generator) if per_row else None


def jobs_of(
    request: Request,
    sampling: Sampling,
    stopping_criteria: StoppingCriteriaList | None = None,
    row_generators: list[torch.Generator] | None = None,
    predictions: list[np.ndarray | None] | None = None,
    keep: tuple[bool, bool] = (False, False),
) -> list[Job]:
    """One :class:`Job` per row of ``request`` (its key: the row, ``None`` alone), with its sampling (its own random
    stream where ``row_generators`` gives one) and prediction, keeping each new token's logits and scores where
    ``keep`` says (:func:`kept_outputs`)."""
    batch, width = request.input_ids.shape
    padded = batch == 1 and request.attention_mask is not None
    stopping_criteria = _beyond_own(stopping_criteria, request)
    return [
        Job(
            request.prompt(b),
            request.max_length - width,
            request.eos_token_ids,
            stopping_criteria,
            sampling if row_generators is None else dataclasses.replace(sampling, generator=row_generators[b]),
            key=b if batch > 1 else None,
            padded=(request.input_ids[0], request.positions, request.attention_mask) if padded else None,
            prediction=None if predictions is None else predictions[b],
            keep_logits=keep[0],
            keep_scores=keep[1],
        )
        for b in range(batch)
    ]


def kept_outputs(generation_config: GenerationConfig) -> tuple[bool, bool]:
    """Whether ``generate`` returns each step's logits and scores (``output_logits``, ``output_scores``, in a
    dict)."""
    returned = bool(generation_config.return_dict_in_generate)
    return returned and bool(generation_config.output_logits), returned and bool(generation_config.output_scores)


def _beyond_own(criteria: StoppingCriteriaList | None, request: Request) -> StoppingCriteriaList | None:
    """``criteria`` without those a row's :class:`~specula.core.sequence.Sequence` keeps itself, checked after
    every token at no cost: ``generate``'s length limit (the row's room ends there) and its EOS ids."""
    if not criteria:
        return criteria
    kept = StoppingCriteriaList(
        criterion
        for criterion in criteria
        if not (type(criterion) is MaxLengthCriteria and criterion.max_length >= request.max_length)
        and not (
            type(criterion) is EosTokenCriteria
            and set(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist()) <= request.eos_token_ids
        )
    )
    return kept or None


def decode(
    model: torch.nn.Module,
    request: Request,
    proposer: Proposer | None,
    sampling: Sampling,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: BaseStreamer | None = None,
    adaptive_draft: bool = True,
    exact: bool | Literal["invariant"] | None = None,
    row_generators: list[torch.Generator] | None = None,
    predictions: list[np.ndarray | None] | None = None,
    compile: bool | None = None,
    keep: tuple[bool, bool] = (False, False),
) -> GenerateOutput:
    """:class:`Decoder` on a validated request of one or more rows, all in one batch (see :func:`specula.generate`);
    ``row_generators`` gives each row its own random stream, ``predictions`` each its prediction's tokens;
    ``compile`` as in :func:`specula.generate`; ``keep``: return each step's logits and scores
    (:func:`kept_outputs`)."""
    started = time.perf_counter()
    batch, width = request.input_ids.shape
    jobs = jobs_of(request, sampling, stopping_criteria, row_generators, predictions, keep)
    for job, adapter in zip(jobs, names_given(adapter_layers(model)) or ()):  # (PeftModel.generate(adapter_names=))
        job.adapter = adapter
    decoder = Decoder(
        model,
        proposer,
        batch,
        adaptive_draft,
        exact,
        predictions=any(job.prediction is not None for job in jobs),
        compile=compile,
    )
    stream = None if streamer is None else lambda row, kept: streamer.put(torch.tensor(kept))
    rows = decode_all(decoder, jobs, stream) if request.max_length > width else {}
    if streamer is not None:
        streamer.end()
    new = [rows[job.key].sequence.ids[len(job.prompt) :] if job.key in rows else np.zeros(0, np.int64) for job in jobs]
    per_row = [rows[job.key].stats if job.key in rows else SpecStats(prompt_tokens=len(job.prompt)) for job in jobs]
    stats = SpecStats.total(
        per_row,
        passes=decoder.passes,
        wall_time_s=time.perf_counter() - started,
        prefill_time_s=sum(row.prefill_time_s for row in per_row),
    )
    found = [rows.get(job.key) for job in jobs]
    return GenerateOutput(
        sequences=_padded(request, new).to(request.device),
        stats=stats,
        logits=_steps([[] if row is None else row.logits for row in found]) if keep[0] else None,
        scores=_steps([[] if row is None else row.scores for row in found]) if keep[1] else None,
    )


def _steps(rows: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...] | None:
    """Each step's ``[B, vocab]`` from each row's ``[vocab]`` per new token, as ``generate`` returns its logits and
    scores; a row that ended earlier has zeros there (``generate`` computes the model on its padding)."""
    steps = max(map(len, rows), default=0)
    if not steps:
        return None
    like = next(row[0] for row in rows if row)
    return tuple(
        torch.stack([row[t] if t < len(row) else torch.zeros_like(like) for row in rows]) for t in range(steps)
    )


def _padded(request: Request, new: list[np.ndarray]) -> torch.Tensor:
    """``[B, L + new]``: each row's (padded) prompt and its new tokens ``new[b]``, rows that ended early padded after
    their end with ``request.pad_token_id``, as ``model.generate`` pads them."""
    width = request.input_ids.shape[1]
    out = np.full((len(new), width + max(map(len, new))), request.pad_token_id, dtype=np.int64)
    out[:, :width] = request.input_ids
    for b, tokens in enumerate(new):
        out[b, width : width + len(tokens)] = tokens
    return torch.from_numpy(out)


def _pad_token_id(generation_config: GenerationConfig) -> int | None:
    """The pad token ``generate`` prepared (the pad token, else the first EOS token), if any."""
    prepared = getattr(generation_config, "_pad_token_tensor", None)
    return int(prepared.reshape(-1)[0]) if prepared is not None else generation_config.pad_token_id


def _refuse_what_cannot_be_exact(model, input_ids, generation_config, generator, cache) -> None:
    """``ValueError`` for what ``generate`` was asked that specula's loop cannot do exactly."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            "specula decodes greedily or by sampling, but these generation settings ask for "
            f"{mode.value.replace('_', ' ')} "
            "(num_beams, prompt_lookup_num_tokens, assistant_model, penalty_alpha, dola_layers ...); drop them, or "
            "call model.generate without specula."
        )
    asked = [name for name in _UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if asked:
        raise ValueError(f"specula cannot return {', '.join(asked)}; generate without them.")
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"specula returns one sequence per prompt, got num_return_sequences="
            f"{generation_config.num_return_sequences}; repeat the prompt in the batch instead."
        )
    if cache is not None and _filled(cache):
        raise ValueError("specula starts from the prompt; it cannot continue a filled cache (cache, past_key_values).")
    generators = generator if isinstance(generator, (list, tuple)) else [] if generator is None else [generator]
    if isinstance(generator, (list, tuple)) and len(generator) != input_ids.shape[0]:
        raise ValueError(
            f"generator holds {len(generator)} generators for a batch of {input_ids.shape[0]}; give one per row."
        )
    device = model_device(model)
    for one in generators:
        if not isinstance(one, torch.Generator):
            raise ValueError(
                f"generator must be a torch.Generator, a list of one per row, or None; got {type(one).__name__}."
            )
        if one.device.type != device.type:
            raise ValueError(
                f"generator is on {one.device} but the model is on {device}; create it with "
                f"torch.Generator(device={str(device)!r})."
            )


def _filled(cache) -> bool:
    """Whether ``cache`` holds anything: tokens in an attention layer, or a recurrent layer's state (a cache of
    recurrent layers alone has no length to ask)."""
    return any(
        layer.get_seq_length() > 0
        if isinstance(layer, CacheLayerMixin)
        else any(getattr(layer, "has_previous_state", {}).values())
        for layer in getattr(cache, "layers", ())
    )
