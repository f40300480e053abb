"""How much to speculate: draft lengths from measured pass costs and acceptance, and the batch size."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
