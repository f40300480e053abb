"""Measuring and diagnosing: the benchmark, the drift report and the invariance probe."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
