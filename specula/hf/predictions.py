"""Checking what a caller passes as ``prediction=`` (the output a request expects back), before the model runs."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .openai import prediction_content

PredictionInput = str | list | tuple | np.ndarray | torch.Tensor | dict | None


def _one(prediction: object, row: str, vocab: int, tokenizer, limit: int | None) -> np.ndarray | None:
    """One request's prediction as token ids (``None``: it has none), or a ValueError saying what is wrong."""
    try:
        prediction = prediction_content(prediction)
    except TypeError as error:
        raise ValueError(f"The prediction{row}: {error}") from None
    if prediction is None:
        return None
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError(
                f"The prediction{row} is text: pass tokenizer= (the model's) to encode it, or give token ids."
            )
        ids = np.asarray(tokenizer(prediction, add_special_tokens=False)["input_ids"], dtype=np.int64)
    else:
        try:
            ids = np.asarray(prediction.cpu() if isinstance(prediction, torch.Tensor) else prediction)
        except (TypeError, ValueError):
            ids = np.asarray([], dtype=object)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(
                f"The prediction{row} must be text or a 1-D sequence of token ids, got "
                f"{type(prediction).__name__}{f' of shape {ids.shape}' if ids.ndim > 1 else ''}."
            )
        ids = ids.astype(np.int64)
    if ids.size == 0:
        warnings.warn(f"The prediction{row} is empty: that request decodes without one.", stacklevel=4)
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(
            f"The prediction{row} holds token id {bad}, outside the model's vocabulary of {vocab} "
            "tokens; was it encoded with another model's tokenizer?"
        )
    if limit is not None and len(ids) > limit:
        raise ValueError(
            f"The prediction{row} has {len(ids)} tokens, more than the model's context of {limit} "
            "positions holds; predict the output only."
        )
    return ids


def checked_predictions(
    prediction: object, batch: int, vocab: int, tokenizer=None, limit: int | None = None
) -> list[np.ndarray | None]:
    """One prediction (token ids, or ``None``) per row of a batch of ``batch`` prompts: ``prediction`` is one
    request's (text, token ids, OpenAI's ``{"type": "content", ...}``) where ``batch`` is 1, else a list with one
    entry per row (each of those, or ``None``). Raises ``ValueError`` saying what is wrong: text without a
    tokenizer, ids outside the vocabulary, more tokens than the model's context (``limit``), a list of another
    length than the batch; an empty prediction is ignored with a warning."""
    if prediction is None:
        return [None] * batch
    per_row = isinstance(prediction, (list, tuple)) and any(
        isinstance(entry, (str, list, tuple, dict, np.ndarray, torch.Tensor)) or entry is None for entry in prediction
    )
    if (
        isinstance(prediction, torch.Tensor)
        and prediction.ndim == 2
        or isinstance(prediction, np.ndarray)
        and prediction.ndim == 2
    ):
        per_row = True
    if not per_row:
        if batch != 1:
            raise ValueError(
                f"A batch of {batch} prompts needs a list of {batch} predictions (one per row, None for "
                f"a row without), got one prediction."
            )
        return [_one(prediction, "", vocab, tokenizer, limit)]
    if len(prediction) != batch:
        raise ValueError(
            f"{len(prediction)} predictions for a batch of {batch} prompts; give one per row (None for a row without)."
        )
    return [
        _one(entry, f" of row {b}" if batch > 1 else "", vocab, tokenizer, limit) for b, entry in enumerate(prediction)
    ]
