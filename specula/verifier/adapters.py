"""PEFT adapters chosen per request: each row of a pass computed with the adapter its request names.

A model holding several LoRA adapters (PEFT, unmerged) computes row ``b`` of a pass with adapter ``names[b]`` through
PEFT's mixed-batch forward: every LoRA layer adds each adapter's product to its own rows only, as
``PeftModel.generate(adapter_names=...)`` has it. A row that names none takes the model's active adapter, as the
model's own ``generate`` does; :data:`BASE` names none at all (the base model's weights alone).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

from .support import UnsupportedModelError

BASE = "__base__"  # PEFT's name for no adapter: the base model's weights alone


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's LoRA layers (PEFT's ``LoraLayer``), which take an adapter per row; none without PEFT's."""
    if not any(type(module).__module__.startswith("peft.") for module in model.modules()):
        return []
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def adapters_of(model: torch.nn.Module) -> list[str]:
    """The names of the LoRA adapters ``model`` holds, in the order they were loaded."""
    return list(dict.fromkeys(name for layer in adapter_layers(model) for name in layer.lora_A))


def names_given(layers: list[torch.nn.Module]) -> list[str] | None:
    """The adapter of each row of the batch that ``PeftModel.generate(adapter_names=...)`` is decoding, read from the
    pre-forward hooks PEFT put on its LoRA layers for that call (``None``: no such call is under way). Those hooks
    give every forward the whole batch's names, while specula's passes hold other rows (a prompt's prefill alone,
    rows that finished left out): :func:`per_row` puts each row's own in their place."""
    for hook in layers[0]._forward_pre_hooks.values() if layers else ():
        names = getattr(hook, "keywords", {}).get("adapter_names")
        if names is not None:
            return list(names)
    return None


@contextlib.contextmanager
def per_row(layers: list[torch.nn.Module], names: Sequence[str | None]) -> Iterator[None]:
    """Within the block, row ``b`` of every forward pass is computed with adapter ``names[b]`` (``None``: the active
    one); nothing changes where no row names one."""
    if not layers or all(name is None for name in names):
        yield
        return
    active = layers[0].active_adapters
    if None in names and len(active) != 1:
        raise UnsupportedModelError(
            f"a request that names no adapter shares a pass with one that does, and the model's active adapters are "
            f"{list(active)}: name the adapter of every request, or activate one (set_adapter)"
        )
    rows = [active[0] if name is None else name for name in names]
    inject = functools.partial(_inject, names=rows)  # (run after any of PEFT's own: the last word)
    handles = [layer.register_forward_pre_hook(inject, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _inject(module: torch.nn.Module, args: tuple, kwargs: dict, names: list[str]) -> tuple[tuple, dict]:
    return args, {**kwargs, "adapter_names": names}
