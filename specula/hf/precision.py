"""Which dtype to run a model in when the user does not say: ``dtype="auto"``.

bf16 halves the memory a model takes and, where the hardware computes in bf16, the time of its passes. A CPU
without BF16 instructions emulates it, several times slower than fp32 (measurements: ``docs/hardware.md``). The
rule:

- CUDA: bf16 where the GPU supports it, else fp16;
- CPU with native BF16 (AVX512_BF16 or AMX): bf16;
- other CPUs: fp32, unless fp32 weights would take more than half the machine's memory; then bf16;
- other devices: bf16.
"""

from __future__ import annotations

import os

import torch

MAX_MEMORY_SHARE = 0.5  # fp32 weights may take at most this share of the machine's memory


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86 AVX512_BF16 or AMX), as torch's build detects it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def physical_memory_bytes() -> int | None:
    """The machine's physical memory, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def auto_dtype(device: str | torch.device, num_parameters: int) -> torch.dtype:
    """The dtype for a model of ``num_parameters`` on ``device`` (see the module docstring for the rule)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu" or cpu_has_native_bf16():
        return torch.bfloat16
    memory = physical_memory_bytes()
    if memory is not None and 4 * num_parameters > MAX_MEMORY_SHARE * memory:
        return torch.bfloat16
    return torch.float32
