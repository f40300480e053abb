"""The decoding core: drafts, the acceptance rule, the speculation loop and what it counts."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
