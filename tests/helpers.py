"""Proposers with known behaviour, and the HF reference the verifier is compared with."""

from __future__ import annotations

import numpy as np
import torch

import specula


def hf_greedy(model, input_ids, max_new_tokens, eos_token_id=None, attention_mask=None) -> torch.Tensor:
    """``model.generate`` greedy: the output specula must reproduce token for token."""
    return model.generate(
        input_ids,
        attention_mask=attention_mask if attention_mask is not None else torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


class Oracle(specula.Proposer):
    """Proposes the continuation of a reference run: every draft token is right."""

    def __init__(self, reference: torch.Tensor, num_draft: int) -> None:
        self.reference = reference.reshape(-1).tolist()
        self.num_draft = num_draft

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        start = len(context_ids)
        return specula.Draft(self.reference[start : start + min(self.num_draft, max_tokens)])


class AlwaysWrong(Oracle):
    """Proposes a token other than the reference's at every position: nothing can be accepted."""

    def __init__(self, reference: torch.Tensor, num_draft: int, vocab_size: int) -> None:
        super().__init__(reference, num_draft)
        self.vocab_size = vocab_size

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        right = super().propose(context_ids, max_tokens).tokens
        return specula.Draft((right + 1) % self.vocab_size)


class Recorder(specula.Proposer):
    """Wraps a proposer and records every hook call, to check what the loop tells proposers."""

    def __init__(self, inner: specula.Proposer) -> None:
        self.inner = inner
        self.prompts: list[list[int]] = []
        self.observed: list[tuple[list[int], int]] = []

    def begin(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        self.inner.begin(prompt_ids, sampling)

    def propose(self, context_ids, max_tokens):
        return self.inner.propose(context_ids, max_tokens)

    def observe(self, new_ids, num_accepted):
        self.observed.append((list(new_ids), num_accepted))
        self.inner.observe(new_ids, num_accepted)
