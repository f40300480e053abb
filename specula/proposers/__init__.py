"""Where drafts come from: the proposer interface, the built-in proposers, their Numba kernels, and the registry of
proposers by name (built in, or registered by other packages)."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
