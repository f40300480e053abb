"""What specula measures about a target model in this process, held with the model while it lives: what passes
cost, which batch size runs fastest, how its passes are made row-exact or fast. Every generation with the model in this
process starts from what the earlier ones measured; :func:`specula.machine.store.forget` drops it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from . import store


@dataclass
class ModelProfile:
    """The measured facts of one target model."""

    # pass-cost tables by (setting, longest draft, rows) (specula.policy.costs)
    pass_costs: dict[Hashable, Any] = field(default_factory=dict)
    # (the largest batch size tried, the fastest of them) (specula.policy.batch_size)
    batch_size: tuple[int, int] | None = None
    # (the dtype, device and attention it was built for, the row-exact kernels) (specula.verifier.row_exact)
    row_exact: tuple[Hashable, Any] | None = None
    # (the dtype and device they were packed for, the packed linear layers) (specula.verifier.packed)
    packed: tuple[Hashable, Any] | None = None
    # how many threads ordinary passes run with (specula.verifier.threads)
    threads: Any = None


def profile_of(model: torch.nn.Module) -> ModelProfile:
    """``model``'s profile, empty at first; forgotten with the model, or by :func:`~specula.machine.store.forget`."""
    return store.memo("profiles", weakref.WeakKeyDictionary).setdefault(model, ModelProfile())
