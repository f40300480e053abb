"""How much to speculate: draft lengths from measured pass costs and acceptance, and the batch size."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
