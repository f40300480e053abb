"""What a model can do, read from the model: the token ids it accepts, the longest sequence it supports."""

from __future__ import annotations

import torch


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the input embedding matrix: the token ids the model accepts."""
    return model.get_input_embeddings().weight.shape[0]


def context_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's positions support, if its config says."""
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None
