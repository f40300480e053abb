"""The core, below the model and the loop: drafts, the acceptance rule, how a token is chosen, a request's tokens and
what decoding counts (the loop itself: :mod:`specula.decoding`)."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
