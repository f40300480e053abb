"""The decoding core: drafts, the acceptance rule, the speculation loop and what it counts."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
