"""``specula.generate``: ``model.generate`` with specula's loop, in one call."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

from .decoding_method import custom_generate
from .inputs import check_max_new_tokens, check_prompt, eos_ids
from ..proposers.base import Proposer
from ..core.stats import GenerateOutput


@torch.inference_mode()
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
    row_exact: bool | None = None,
    **generation_kwargs: Any,
) -> GenerateOutput:
    """Decode with ``model``, sped up by speculation, without changing what it generates.

    Each step asks ``proposer`` for draft tokens, verifies ``[last token, d1..dK]`` in one forward pass of the
    target, keeps the draft prefix the target accepts plus one token of the target's own, and rolls the KV cache
    back past the rejected drafts. Greedy output is token for token ``model.generate``'s; sampled output has exactly
    its distribution (speculative sampling, see :mod:`specula.acceptance`). ``proposer=None`` decodes one token per
    pass through the same loop.

    Settings are resolved exactly as ``model.generate`` resolves them, by ``model.generate`` itself (this is
    ``model.generate(..., custom_generate=specula.custom_generate)``): what is not given comes from the model's
    ``generation_config`` -- ``do_sample`` and the sampling settings, ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens``, forced BOS/EOS, suppressed and bad words, ``max_new_tokens``, ``eos_token_id`` -- then from
    transformers' defaults. What specula cannot reproduce exactly (beam search, several sequences, assisted
    generation, per-step scores) is refused with a ``ValueError``.

    Args:
        model: any HF decoder-only causal LM (``AutoModelForCausalLM``).
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
            tokens of every step as soon as they are accepted.
        adaptive_draft: choose each step's draft length from measured step costs and running acceptance, and stop
            sending drafts that do not pay (:mod:`specula.policy.adaptive`); ``False`` verifies every draft as proposed.
        row_exact: compute every position of a verification pass bit for bit as a one-token step computes it
            (:mod:`specula.row_exact`), so that greedy output is ``model.generate``'s in bf16 and fp16 too. ``None``
            (the default) turns it on in bf16 and fp16, where passes of other shapes round differently, and off in
            fp32, where they do too but far below the gaps between logits. ``False`` makes passes cheaper on some
            devices; greedy output then stays reproducible but may differ from ``model.generate``'s at near-ties
            (``specula drift`` shows where).
        **generation_kwargs: any other ``model.generate`` argument: ``GenerationConfig`` fields
            (``repetition_penalty=1.2``, ``stop_strings=[...]`` with ``tokenizer=``, ...) or ``generation_config=``.

    Returns:
        ``GenerateOutput`` with ``sequences`` (prompts + new tokens, ``[B, length]``, padded after a row's end as
        ``model.generate`` pads it) and ``stats`` (batch totals, per-row stats in ``stats.rows``).
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(
            f"specula.generate needs a transformers causal LM (one with model.generate), got {type(model).__name__}; "
            "load it with AutoModelForCausalLM."
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
        max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample, temperature=temperature,
        top_k=top_k, top_p=top_p, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        streamer=streamer,
    )
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        custom_generate=custom_generate,
        proposer=proposer,
        generator=generator,
        adaptive_draft=adaptive_draft,
        row_exact=row_exact,
        return_dict_in_generate=True,
        **{name: value for name, value in given.items() if value is not None},
        **generation_kwargs,
    )
    return GenerateOutput(sequences=out.sequences, stats=out.stats)
