"""What specula measures about a target model on this machine, held with the model while it lives: what passes
cost, which batch size runs fastest, how its passes are made row-exact or fast. Every generation with the model in this
process starts from what the earlier ones measured."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

import numpy as np
import torch

if TYPE_CHECKING:
    from .packed import PackedLinears
    from .row_exact import RowExact
    from .threads import ThreadChoice


@dataclass
class ModelProfile:
    """The measured facts of one target model."""

    # pass-cost tables by (setting, longest draft, rows): seconds by tokens per pass (specula.policy.costs)
    step_seconds: dict[Hashable, np.ndarray] = field(default_factory=dict)
    # (the largest batch size tried, the fastest of them) (specula.policy.batch_size)
    batch_size: tuple[int, int] | None = None
    # (the dtype, device and attention it was built for, the row-exact kernels) (specula.verifier.row_exact)
    row_exact: tuple[Hashable, RowExact] | None = None
    # (the dtype and device they were packed for, the packed linear layers) (specula.verifier.packed)
    packed: tuple[Hashable, PackedLinears] | None = None
    # how many threads ordinary passes run with (specula.verifier.threads)
    threads: ThreadChoice | None = None


_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def profile_of(model: torch.nn.Module) -> ModelProfile:
    """``model``'s profile, empty at first; forgotten with the model."""
    return _PROFILES.setdefault(model, ModelProfile())
