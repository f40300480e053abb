"""How much memory is free on a device: what bounds the batches, packed copies and exact kernels specula keeps."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import platform
import sys

import numpy as np
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


NO_RESERVE = 0x4000  # Linux's MAP_NORESERVE (x86-64, arm64): no swap set aside for pages not yet written


def _generic_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


class Pages:
    """A CPU tensor of zeros whose memory is taken page by page as it is written, and given back in ranges.

    It lives in an anonymous mapping of its own: the system hands a page over at its first write (a read of one never
    written maps the shared zero page, which takes no memory), and :meth:`release` returns pages, which read as zeros
    again. So a batch's buffer, as long as its longest row, holds for each row only what that row wrote: memory that
    follows each row's own tokens, with one rectangle for attention to read (vAttention's idea, by the CPU's own
    paging). Worked example: rows of 3 key/value heads x 64 dims in fp32 take a 4,096-byte page per 16 tokens of a
    head, so a row of 20 tokens beside one of 8,000 holds 2 pages a head, not 500."""

    granule = mmap.PAGESIZE  # (bytes the system hands over at once)

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (NO_RESERVE if _generic_linux() else 0)
        self.map = mmap.mmap(-1, max(count * self.itemsize, 1), flags=flags)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (a huge page would take 2 MB for a row's first token)
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=count).view(shape)  # (the tensor keeps the map)

    @staticmethod
    def whole(count: int, size: int) -> int:
        """``count`` rounded up to a number of items of ``size`` bytes that fills whole pages."""
        step = mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, size)
        return -(-count // step) * step

    def readable(self, start: int, end: int) -> None:
        """Nothing: a page never written reads as zeros (``DevicePages.readable``'s counterpart)."""

    def ensure(self, start: int, end: int) -> None:
        """Nothing: a page is taken at its first write (``DevicePages.ensure``'s counterpart)."""

    def release(self, start: int, end: int) -> None:
        """Give back the whole pages within elements ``start`` to ``end`` of the flat tensor: they read as zeros."""
        first = -(-start * self.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end * self.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def held(self) -> np.ndarray:
        """Which of its pages are in memory now (``[pages]`` bools): written and not given back (Linux's
        ``/proc/self/pagemap``: present and mapped here alone; a page only read is the shared zero page)."""
        pages = -(-len(self.map) // mmap.PAGESIZE)
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(self.tensor.data_ptr() // mmap.PAGESIZE * 8)
            entries = np.frombuffer(pagemap.read(pages * 8), dtype=np.uint64)  # [pages]
        return ((entries >> np.uint64(63)) & (entries >> np.uint64(56)) & np.uint64(1)).astype(bool)

    def resident(self) -> int:
        """Bytes of it in memory now (:meth:`held`)."""
        return int(self.held().sum()) * mmap.PAGESIZE
