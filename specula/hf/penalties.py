"""OpenAI's ``frequency_penalty`` and ``presence_penalty`` as a transformers logits processor, so that specula's
acceptance applies them at every verified position as ``model.generate`` applies its own processors."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class PresenceFrequencyPenalty(LogitsProcessor):
    """Lowers each token's logit by ``frequency`` times the times it occurs among the tokens generated so far (those
    after the first ``prompt_length``), and by ``presence`` once where it occurs at all: OpenAI's penalties, over the
    output only as vLLM applies them (negative values favour repeats).

    >>> penalty = PresenceFrequencyPenalty(prompt_length=1, frequency=0.5, presence=1.0)
    >>> penalty(torch.tensor([[2, 1, 1]]), torch.zeros(1, 3)).tolist()  # (token 2 is the prompt's)
    [[0.0, -2.0, 0.0]]
    """

    def __init__(self, prompt_length: int, frequency: float = 0.0, presence: float = 0.0) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, float(frequency), float(presence)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]  # [B, tokens generated so far]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
