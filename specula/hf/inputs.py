"""Checking and normalising what a caller passes to :func:`specula.generate`, with errors that say what to do."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..verifier.support import context_limit, model_device, vocab_size


@dataclass(frozen=True)
class Request:
    """A validated generation request for a batch of ``B`` sequences (left-padded to one length ``L``)."""

    input_ids: np.ndarray  # [B, L] int64 token ids, padding included
    prompt_mask: np.ndarray  # [B, L] bool: True for a prompt token, False for padding
    max_length: int  # L + new tokens, never past the model's context
    eos_token_ids: frozenset[int]
    positions: torch.Tensor  # [B, max_length] position id of every slot, on the model's device
    attention_mask: torch.Tensor | None  # [B, max_length], None when no prompt has padding
    device: torch.device
    pad_token_id: int = 0  # what follows a row that ended before the others in the output

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def prompt(self, row: int) -> np.ndarray:
        """Row ``row``'s prompt tokens without its padding."""
        return self.input_ids[row][self.prompt_mask[row]]


def _token_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name} must be a tensor of token ids, got {type(value).__name__}.") from error
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids (torch.long), got dtype {value.dtype}.")
    if value.ndim == 1:
        value = value[None]
    if value.ndim != 2 or value.shape[0] == 0:
        raise ValueError(f"{name} must have shape [batch_size, sequence_length], got {tuple(value.shape)}.")
    return value.long()


def eos_ids(eos_token_id: int | Iterable[int] | torch.Tensor | None) -> frozenset[int]:
    """The set of token ids that end generation; ``ValueError`` if ``eos_token_id`` is not ids."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of token ids, got {eos_token_id!r}.")
    return frozenset(ids)


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")


def check_prompt(
    model: torch.nn.Module, input_ids: object, attention_mask: object | None, pad_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` as a ``[B, length]`` long tensor and ``attention_mask`` checked against it; raise ``ValueError``
    saying what is wrong and what to do. ``pad_token_id`` lets a batch whose rows start with it but that comes
    without an attention mask be refused."""
    input_ids = _token_tensor(input_ids, "input_ids")
    prompt_length = input_ids.shape[1]
    if prompt_length == 0:
        raise ValueError("input_ids is empty; give at least one prompt token (e.g. the BOS token).")
    vocab = vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"input_ids holds token id {low if low < 0 else high}, outside the model's vocabulary of {vocab} tokens; "
            "was the prompt encoded with this model's tokenizer?"
        )
    limit = context_limit(model)
    if limit is not None and prompt_length >= limit:
        raise ValueError(
            f"The prompt has {prompt_length} tokens but the model accepts at most {limit} positions; "
            "shorten the prompt to leave room for new tokens."
        )
    if attention_mask is not None:
        attention_mask = _token_tensor(attention_mask, "attention_mask")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}; "
                "they must match."
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
        if not bool((attention_mask[:, -1] == 1).all()):
            raise ValueError(
                "The last prompt token of a row is masked out (right padding); pad on the left (as model.generate "
                "needs too: tokenizer.padding_side = 'left') or strip the padding."
            )
        if not bool(attention_mask.any(dim=1).all()):
            raise ValueError("A row of attention_mask is all zeros: every prompt needs at least one token.")
    elif input_ids.shape[0] > 1 and pad_token_id is not None and bool((input_ids[:, 0] == pad_token_id).any()):
        raise ValueError(
            f"Some rows of input_ids start with the pad token ({pad_token_id}) but no attention_mask was given; pass "
            "the attention_mask the tokenizer returned with the padded batch."
        )
    return input_ids, attention_mask


def prepare_request(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | torch.Tensor | None,
    pad_token_id: int | None = None,
) -> Request:
    """The request the loop runs: the checked prompts, their length limit, EOS ids, and every slot's position."""
    input_ids, attention_mask = check_prompt(model, input_ids, attention_mask, pad_token_id)
    batch = input_ids.shape[0]
    check_max_new_tokens(max_new_tokens)
    prompt_length = input_ids.shape[1]
    max_length = prompt_length + max_new_tokens
    limit = context_limit(model)
    if limit is not None and max_length > limit:
        warnings.warn(
            f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {limit} positions; generation stops at {limit} tokens.",
            stacklevel=3,
        )
        max_length = limit

    device = model_device(model)
    full_mask = torch.ones(batch, max_length, dtype=torch.long)
    if attention_mask is not None:
        full_mask[:, :prompt_length] = attention_mask.cpu()
    # Position ids as model.generate computes them: count the unmasked tokens, padding gets position 0.
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    has_padding = bool((full_mask == 0).any())
    return Request(
        input_ids=input_ids.cpu().numpy().astype(np.int64),
        prompt_mask=full_mask[:, :prompt_length].numpy().astype(bool),
        max_length=max_length,
        eos_token_ids=eos_ids(eos_token_id),
        positions=positions.to(device),
        attention_mask=full_mask.to(device) if has_padding else None,
        device=device,
        pad_token_id=pad_token_id if pad_token_id is not None else min(eos_ids(eos_token_id), default=0),
    )


def left_padded(prompts: list[torch.Tensor], pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token ids of 1-D ``prompts`` padded on the left (as ``model.generate`` wants a batch), and the
    attention mask that marks the padding."""
    width = max(len(prompt) for prompt in prompts)
    pad = 0 if pad_token_id is None else pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask
