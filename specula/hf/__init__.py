"""The HuggingFace integration: ``specula.generate``, ``custom_generate`` for ``model.generate``, input checks, and
loading models offline."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
