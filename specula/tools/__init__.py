"""Measuring and diagnosing: the benchmark, the drift report and the invariance probe."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
