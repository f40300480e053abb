"""The drift report: where speculative greedy output leaves ``model.generate``'s, and whether rounding explains it.

:func:`drift` decodes one request both ways, keeping the logits each way computed: ``model.generate``'s one-token
steps, and specula's passes (the pass that decided each position). At the first position where the outputs differ
it reports the two tokens, the gap between their logits in the one-token step and in specula's pass, and a verdict:
a near-tie (both gaps within what the dtype's rounding moves a logit of that size, ``TIE_ULPS`` units in the last
place) or not (a bug to report). ``specula drift`` runs it over a JSONL file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..hf.generate import generate
from ..proposers.base import Proposer
from ..verifier.cache_names import cache_in

TIE_ULPS = 8  # a gap within this many units in the last place of the larger logit counts as a near-tie


@dataclass
class Drift:
    """One request's drift. ``position`` counts new tokens (0 = the first); gaps are in logits."""

    identical: bool
    new_tokens: int
    drafted: int = 0  # draft tokens specula's passes verified (none: the check proved nothing about verification)
    position: int | None = None
    plain_token: int | None = None
    speculative_token: int | None = None
    gap_one_token: float | None = None
    gap_verification: float | None = None
    tolerance: float | None = None
    verdict: str = "identical"

    def as_dict(self) -> dict:
        return asdict(self)


class _PassLogits:
    """A forward hook that keeps, for every sequence position, the logits of the last pass that predicted it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        cache = cache_in(kwargs)
        logits = output.logits[0]  # [rows, vocab], the last rows of the pass
        end = cache.get_seq_length()  # tokens in the cache after this pass
        for j in range(logits.shape[0]):
            self.rows[end - logits.shape[0] + j + 1] = logits[j].detach().clone()  # predicts this position


def _gap(logits: torch.Tensor, better: int, worse: int | None) -> float | None:
    return None if worse is None else float(logits[better].float() - logits[worse].float())


def drift(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    proposer: Proposer | None,
    max_new_tokens: int,
    exact: bool | None = None,
    adaptive_draft: bool = True,
    **generate_kwargs,
) -> Drift:
    """Greedy decoding of ``input_ids`` ([1, length]) by ``model.generate`` and by :func:`specula.generate` with
    ``proposer`` (and ``exact``, ``adaptive_draft``), compared (see the module docstring); ``generate_kwargs``
    go to both."""
    input_ids = input_ids.reshape(1, -1)
    start = input_ids.shape[1]
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    with torch.no_grad():
        plain = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            output_logits=True,
            return_dict_in_generate=True,
            **settings,
        )
    recorder = _PassLogits(model)
    try:
        speculative = generate(model, input_ids, proposer, exact=exact, adaptive_draft=adaptive_draft, **settings)
    finally:
        recorder.handle.remove()
    a, b = plain.sequences[0, start:].tolist(), speculative.sequences[0, start:].tolist()
    drafted = speculative.stats.drafted
    if a == b:
        return Drift(identical=True, new_tokens=len(a), drafted=drafted)
    position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    token_a = a[position] if position < len(a) else None
    token_b = b[position] if position < len(b) else None
    one_token = plain.logits[position][0]
    passed = recorder.rows[start + position]
    gaps = (
        _gap(one_token, token_a, token_b) if token_a is not None else None,
        _gap(passed, token_b, token_a) if token_b is not None else None,
    )
    pair = [t for t in (token_a, token_b) if t is not None]
    size = max(float(one_token[pair].float().abs().max()), float(passed[pair].float().abs().max()), 1.0)
    dtype = next(model.parameters()).dtype  # (model.generate hands out logits upcast to fp32)
    tolerance = TIE_ULPS * torch.finfo(dtype).eps * size
    near_tie = all(g is not None and g <= tolerance for g in gaps)
    verdict = (
        "near-tie"
        if near_tie
        else (
            f"not a near-tie: the two passes disagree by more than {dtype} rounding explains; please report it "
            "with the model, dtype, device, proposer and this request"
        )
    )
    return Drift(
        identical=False,
        new_tokens=len(a),
        drafted=drafted,
        position=position,
        plain_token=token_a,
        speculative_token=token_b,
        gap_one_token=gaps[0],
        gap_verification=gaps[1],
        tolerance=tolerance,
        verdict=verdict,
    )
