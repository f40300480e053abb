"""``specula.generate``: the speculation loop around any HF causal LM."""

from __future__ import annotations

import time
from typing import Iterable

import numpy as np
import torch

from .acceptance import accept_draft
from .inputs import Request, prepare_request, vocab_size
from .proposer import Draft, Proposer
from .sampling import resolve_sampling
from .stats import GenerateOutput, SpecStats
from .cached_model import CachedModel


class _Sequence:
    """Prompt + output on the host, in a buffer sized once; stops exactly at EOS or the length limit."""

    def __init__(self, request: Request) -> None:
        self.tokens = np.empty(request.max_length, dtype=np.int64)
        self.length = len(request.prompt)
        self.tokens[: self.length] = request.prompt
        self.eos_token_ids = request.eos_token_ids

    @property
    def ids(self) -> np.ndarray:
        return self.tokens[: self.length]

    def append(self, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Append what fits, up to and including the first EOS; return the appended tokens and whether to stop."""
        kept = new_tokens[: len(self.tokens) - self.length]
        ended_by_eos = False
        for index, token in enumerate(kept):
            if token in self.eos_token_ids:
                kept, ended_by_eos = kept[: index + 1], True
                break
        self.tokens[self.length : self.length + len(kept)] = kept
        self.length += len(kept)
        return kept, ended_by_eos or self.length == len(self.tokens)


def _propose(proposer: Proposer | None, context: np.ndarray, budget: int, vocab: int, stats: SpecStats) -> Draft:
    """Ask the proposer for at most ``budget`` tokens and check what it returns."""
    if proposer is None or budget <= 0:
        return Draft.empty()
    started = time.perf_counter()
    draft = proposer.propose(context, budget)
    stats.draft_time_s += time.perf_counter() - started
    if not isinstance(draft, Draft):
        raise TypeError(f"{proposer!r}.propose() must return a specula.Draft, got {type(draft).__name__}.")
    if len(draft) > budget:
        draft = Draft(draft.tokens[:budget], None if draft.probs is None else draft.probs[:budget])
    if len(draft) and (int(draft.tokens.min()) < 0 or int(draft.tokens.max()) >= vocab):
        bad = int(draft.tokens.min()) if int(draft.tokens.min()) < 0 else int(draft.tokens.max())
        raise ValueError(
            f"{proposer!r} proposed token id {bad}, outside the target's vocabulary of {vocab} tokens; "
            "the proposer must use the target's tokenizer."
        )
    if draft.probs is not None and draft.probs.shape[1] != vocab:
        raise ValueError(
            f"{proposer!r} returned draft probabilities over {draft.probs.shape[1]} tokens but the target's "
            f"vocabulary has {vocab}; give q over the target's token ids."
        )
    return draft


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    proposer: Proposer | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    eos_token_id: int | Iterable[int] | torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Decode with ``model``, sped up by speculation, without changing what it generates.

    Each step asks ``proposer`` for draft tokens, verifies ``[last token, d1..dK]`` in one forward pass of the
    target, keeps the draft prefix the target accepts plus one token of the target's own, and rolls the KV cache
    back past the rejected drafts. Greedy output is token for token ``model.generate(do_sample=False)``'s; sampled
    output has exactly the distribution of ``model.generate(do_sample=True)`` (speculative sampling, see
    :mod:`specula.acceptance`). ``proposer=None`` decodes one token per pass through the same loop.

    Args:
        model: any HF decoder-only causal LM (``AutoModelForCausalLM``).
        input_ids: the prompt, shape ``[1, length]`` (or ``[length]``); one sequence at a time.
        proposer: where drafts come from, e.g. ``specula.PromptLookup()``; ``None`` for plain decoding.
        attention_mask: as in HF; zeros mark left padding.
        max_new_tokens: defaults to the model's ``generation_config`` (as ``model.generate``).
        eos_token_id: token id(s) that end generation; defaults to the model's ``generation_config``.
        do_sample: sample instead of decoding greedily.
        temperature, top_k, top_p: sampling settings, applied with transformers' warpers; unset ones come from the
            model's ``generation_config``, then transformers' defaults (1.0, 50, 1.0), as in ``model.generate``.
            ``temperature=0`` decodes greedily.
        generator: random source for sampling; ``None`` uses torch's global RNG.

    Returns:
        ``GenerateOutput`` with ``sequences`` (prompt + new tokens, ``[1, length]``) and ``stats``.
    """
    started = time.perf_counter()
    request = prepare_request(model, input_ids, attention_mask, max_new_tokens, eos_token_id)
    sampling = resolve_sampling(model, do_sample, temperature, top_k, top_p, generator)
    sequence = _Sequence(request)
    stats = SpecStats(prompt_tokens=sequence.length)
    if request.max_length > sequence.length:
        target = CachedModel(model, request.positions, request.attention_mask, rollback=proposer is not None)
        vocab = vocab_size(model)
        if proposer is not None:
            proposer.check_target(model)
            proposer.begin(sequence.ids, sampling)
        draft = _propose(proposer, sequence.ids, request.max_length - sequence.length - 1, vocab, stats)
        block = torch.from_numpy(request.prompt)  # the first pass is the prefill, with a draft already
        while True:
            block = torch.cat([block, draft.tokens]).to(request.device)
            logits = target.forward(block, num_logits=len(draft) + 1)
            new_tokens = accept_draft(logits, draft, sampling)
            target.rollback(len(draft) + 1 - len(new_tokens))
            stats.record_step(drafted=len(draft), accepted=len(new_tokens) - 1)
            if stats.steps == 1:
                stats.prefill_time_s = time.perf_counter() - started
            kept, finished = sequence.append(new_tokens)
            if proposer is not None:
                proposer.observe(kept, min(len(new_tokens) - 1, len(kept)))
            if finished:
                break
            draft = _propose(proposer, sequence.ids, request.max_length - sequence.length - 1, vocab, stats)
            block = torch.from_numpy(sequence.tokens[sequence.length - 1 : sequence.length])
    stats.new_tokens = sequence.length - stats.prompt_tokens
    stats.wall_time_s = time.perf_counter() - started
    return GenerateOutput(sequences=torch.from_numpy(sequence.ids.copy())[None].to(request.device), stats=stats)
