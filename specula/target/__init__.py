"""The target model as the loop drives it: KV cache and row blocks, row-exact kernels, capability checks."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
