"""Request settings transformers has no processor or token ids for: OpenAI's ``frequency_penalty`` and
``presence_penalty``, vLLM's ``allowed_token_ids`` as transformers logits processors (so that specula's acceptance
applies them at every verified position as ``model.generate`` applies its own), vLLM's ``bad_words`` as transformers'
``bad_words_ids``."""

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


class AllowedTokens(LogitsProcessor):
    """Every token but ``allowed`` gets ``-inf`` (``vocab``: the scores' width): what transformers'
    ``suppress_tokens`` does with the others, its mask made once.

    >>> AllowedTokens([0, 2], vocab=3)(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3)).tolist()
    [[0.0, -inf, 0.0]]
    """

    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.refused = torch.ones(vocab, dtype=torch.bool)
        self.refused[allowed] = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.masked_fill(self.refused.to(scores.device)[: scores.shape[-1]], float("-inf"))


def word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token ids of each of ``words`` as the text's first word and as a later one (after a space), each way
    once: transformers' ``bad_words_ids`` for vLLM's ``bad_words``."""
    spelt = [
        tokenizer(text, add_special_tokens=False)["input_ids"]
        for word in words
        for text in (word.lstrip(), " " + word.lstrip())
    ]
    return [list(ids) for ids in dict.fromkeys(map(tuple, spelt)) if ids]
