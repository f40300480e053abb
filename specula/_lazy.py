"""Subpackages and modules as attributes of their package, imported on first use: after ``import specula``,
``specula.hf.loading.load_model()`` works without importing ``specula.hf.loading`` first."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Callable


def submodules(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` when it exists."""

    def __getattr__(name: str) -> ModuleType:
        if importlib.util.find_spec(f"{package}.{name}") is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")

    return __getattr__
