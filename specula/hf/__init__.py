"""The HuggingFace integration: ``specula.generate``, ``custom_generate`` for ``model.generate``, input checks, and
loading models offline."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
