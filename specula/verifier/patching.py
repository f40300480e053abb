"""Module forwards replaced for the length of one pass, stacking with what else replaced them (row-exact
verification's linear layers, a recurrent layer's steps): each is given back what it was before."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


@contextlib.contextmanager
def forwards_replaced(modules: Iterable[torch.nn.Module], replace: Callable) -> Iterator[None]:
    """Within the block, each module's ``forward`` is ``replace(module, forward)`` (``forward``: what it is now)."""
    modules = list(modules)
    before = [module.__dict__.get("forward") for module in modules]  # (None: the class's own)
    for module in modules:
        module.forward = replace(module, module.forward)
    try:
        yield
    finally:
        for module, forward in zip(reversed(modules), reversed(before)):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
