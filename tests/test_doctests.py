"""The examples in specula's docstrings run as written."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import specula

MODULES = sorted(
    module.name
    for module in pkgutil.walk_packages(specula.__path__, "specula.")
    if not module.name.endswith(".__main__")
)  # (importing it runs the command)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"
