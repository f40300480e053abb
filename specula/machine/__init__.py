"""What specula measures about the machine at hand, at the bottom of the house: one store of measured state (one
file on disk, keyed by the machine's fingerprint), the clock and pass timer every measurement uses, robust
statistics, and each model's in-memory profile. Every other package asks here; this one imports none of them."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
