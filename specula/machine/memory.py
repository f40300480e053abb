"""How much memory is free on a device: what bounds the batches, packed copies and exact kernels specula keeps."""

from __future__ import annotations

import contextlib
import ctypes

import torch


def spare_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = open("/proc/meminfo").read().splitlines()
        return int(next(line for line in lines if line.startswith("MemAvailable:")).split()[1]) * 1024
    return None


def resident_bytes() -> int | None:
    """This process's resident set (None where unknown): what a server's memory is watched by."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        import resource

        return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    return None


def give_back_freed() -> None:
    """Return the C heap's freed memory to the system (glibc's ``malloc_trim``; elsewhere nothing): after a load, what
    its passes allocated and freed in blocks under glibc's mmap threshold stays in the process's heap otherwise, so
    the resident set would keep a large batch's level while idle."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
