"""Where drafts come from: the proposer interface, the built-in proposers, their Numba kernels, and the registry of
proposers by name (built in, or registered by other packages)."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
