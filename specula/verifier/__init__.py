"""The verifier: the target model as the loop drives it (KV cache and row blocks, rollback of attention and recurrent
state, row-exact kernels and their calibration, capability checks)."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
