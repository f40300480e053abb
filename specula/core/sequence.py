"""One request's tokens on the host while it is decoded, and where its output ends."""

from __future__ import annotations

import numpy as np
import torch
from transformers import StoppingCriteriaList

from .draft import Draft


class Sequence:
    """Prompt + output of one request on the host, in a buffer sized once; stops exactly at EOS, a stopping
    criterion, or the length limit."""

    def __init__(
        self,
        prompt: np.ndarray,
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        stopping_criteria: StoppingCriteriaList | None = None,
    ) -> None:
        self.tokens = np.empty(len(prompt) + max_new_tokens, dtype=np.int64)
        self.length = len(prompt)
        self.tokens[: self.length] = prompt
        self.eos_token_ids = eos_token_ids
        self.stopping_criteria = stopping_criteria

    @property
    def ids(self) -> np.ndarray:
        return self.tokens[: self.length]

    @property
    def room(self) -> int:
        """How many more tokens fit."""
        return len(self.tokens) - self.length

    def with_draft(self, draft: Draft, device: torch.device) -> torch.Tensor:
        """``[1, length + len(draft)]``: the sequence followed by the draft, what logits processors read."""
        return torch.cat([torch.from_numpy(self.ids), draft.tokens])[None].to(device)

    def append(self, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Append what fits, up to and including the first token that ends generation; return the appended tokens
        and whether to stop."""
        start = self.length
        kept = new_tokens[: len(self.tokens) - start]
        self.tokens[start : start + len(kept)] = kept
        for index, token in enumerate(kept):
            if token in self.eos_token_ids or self._criteria_met(start + index + 1):
                self.length = start + index + 1
                return kept[: index + 1], True
        self.length = start + len(kept)
        return kept, self.length == len(self.tokens)

    def _criteria_met(self, length: int) -> bool:
        """HF stopping criteria (stop strings, max time ...) on the first ``length`` tokens, as ``model.generate``
        checks them after every token (``scores`` is ``None``)."""
        if not self.stopping_criteria:
            return False
        return bool(self.stopping_criteria(torch.from_numpy(self.tokens[None, :length]), None).any())
