"""The name under which a model takes its cache, in one place: ``cache`` from transformers 5.24, ``past_key_values``
before it (``cache_params`` for Mamba-style models). specula passes and reads the cache under the name the model's
forward declares, so that 5.24 never routes a call through its deprecation shims (which warn) and earlier versions
get the names they know."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_parameter(parameters: Mapping[str, inspect.Parameter]) -> str | None:
    """The name under which a forward with these ``parameters`` takes a transformers ``Cache``, if it takes one
    (XLM's ``cache`` takes a dict of its own: not a ``Cache``)."""
    return next((name for name in CACHE_ARGUMENTS if _takes_a_cache(parameters.get(name))), None)


def cache_in(kwargs: Mapping[str, Any]) -> Any:
    """The cache among a call's keyword arguments (a forward's, or the model kwargs ``generate`` prepared), if any."""
    return next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)


def _takes_a_cache(parameter: inspect.Parameter | None) -> bool:
    if parameter is None:
        return False
    annotation = parameter.annotation
    return annotation is inspect.Parameter.empty or "dict" not in str(annotation)
