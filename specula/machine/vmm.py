"""GPU tensors whose memory is taken chunk by chunk as it is written: CUDA's virtual memory management, through the
driver's own API (``libcuda``, by ctypes: no build step, nothing beyond torch's own CUDA)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math

import torch

PINNED, ON_DEVICE, READ_WRITE, MINIMUM = 1, 1, 3, 0  # CUmemAllocationType, CUmemLocationType, CUmemAccess_flags, ...


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_uint8 * 8),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_SIGNATURES = {
    "cuMemGetAllocationGranularity": (ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int),
    "cuMemAddressReserve": (
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_uint64,
        ctypes.c_uint64,
    ),
    "cuMemAddressFree": (ctypes.c_uint64, ctypes.c_size_t),
    "cuMemCreate": (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(_AllocationProp), ctypes.c_uint64),
    "cuMemRelease": (ctypes.c_uint64,),
    "cuMemMap": (ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64),
    "cuMemUnmap": (ctypes.c_uint64, ctypes.c_size_t),
    "cuMemSetAccess": (ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}


@functools.cache
def _driver() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        driver = ctypes.CDLL("libcuda.so.1")
        for name, arguments in _SIGNATURES.items():
            function = getattr(driver, name)
            function.argtypes, function.restype = arguments, ctypes.c_int
        return driver
    return None


def _call(name: str, *arguments) -> None:
    driver = _driver()
    result = getattr(driver, name)(*arguments)
    if result != 0:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"CUDA's {name} failed: {(text.value or b'error %d' % result).decode()}")


def _prop(device: torch.device) -> _AllocationProp:
    return _AllocationProp(type=PINNED, location=_Location(ON_DEVICE, device.index or 0))


@functools.cache
def granularity(device: torch.device) -> int | None:
    """The bytes of one chunk on ``device`` (CUDA's least granularity of mapped memory; None where CUDA's virtual
    memory is not at hand)."""
    if device.type != "cuda" or _driver() is None:
        return None
    torch.cuda.init()
    size = ctypes.c_size_t()
    try:
        _call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(_prop(device)), MINIMUM)
    except RuntimeError:
        return None
    return size.value


class _Reservation:
    """Addresses reserved on a device and what each chunk of them maps: the object a :class:`DevicePages`'s tensor
    keeps alive (through ``__cuda_array_interface__``), freed with the last view of it."""

    def __init__(self, size: int, granule: int, device: torch.device) -> None:
        self.device, self.granule, self.size = device, granule, size
        self.chunks: list[int | None] = [None] * (size // granule)  # each chunk's memory of its own (None: none)
        self.mapped = [False] * len(self.chunks)  # (to memory of its own, or to the chunk of zeros)
        address = ctypes.c_uint64()
        _call("cuMemAddressReserve", ctypes.byref(address), size, granule, 0, 0)
        self.address, self.zeros = address.value, self.create()
        self.map(0, self.zeros)  # (where the chunk of zeros is zeroed)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.address, False), "version": 2}

    def at(self, chunk: int) -> int:
        return self.address + chunk * self.granule

    def create(self) -> int:
        handle = ctypes.c_uint64()
        _call("cuMemCreate", ctypes.byref(handle), self.granule, ctypes.byref(_prop(self.device)), 0)
        return handle.value

    def map(self, chunk: int, handle: int) -> None:
        """Map ``chunk`` to ``handle``'s memory (unmapping what it mapped)."""
        if self.mapped[chunk]:
            _call("cuMemUnmap", self.at(chunk), self.granule)
        _call("cuMemMap", self.at(chunk), self.granule, 0, handle, 0)
        access = _AccessDesc(_Location(ON_DEVICE, self.device.index or 0), READ_WRITE)
        _call("cuMemSetAccess", self.at(chunk), self.granule, ctypes.byref(access), 1)
        self.mapped[chunk] = True

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.device)
            for chunk, mapped in enumerate(self.mapped):  # (each mapping whole, as it was mapped)
                if mapped:
                    _call("cuMemUnmap", self.at(chunk), self.granule)
            for handle in [*self.chunks, self.zeros]:
                if handle is not None:
                    _call("cuMemRelease", handle)
            _call("cuMemAddressFree", self.address, self.size)


class DevicePages:
    """A GPU tensor of zeros whose memory is taken chunk by chunk as it is written, and given back in ranges: the
    GPU's :class:`~specula.machine.memory.Pages`.

    Its addresses are reserved once, and a chunk is mapped only once something reads or writes it: :meth:`readable`
    maps chunks to one shared chunk of zeros (what no row wrote reads as zeros and takes no memory; nothing writes
    there), :meth:`ensure` gives chunks memory of their own before a write, and :meth:`release` gives it back (the
    chunks read as zeros again). Unlike the CPU's pages, neither a read nor a write maps a chunk by itself: a read of
    a chunk never mapped is an illegal address, a write to the chunk of zeros changes what every unwritten token
    reads. Worked example: rows of 23,040 bytes a token (the keys and values of SmolLM2-135M, every layer, bf16) in
    chunks of 2 MiB take a chunk per 91 tokens."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        granule = granularity(device)
        if granule is None:
            raise RuntimeError(f"CUDA's virtual memory management is not at hand on {device}")
        self.device, self.granule = device, granule
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        with torch.cuda.device(device):
            self.reserved = _Reservation(-(-max(count * self.itemsize, 1) // granule) * granule, granule, device)
            flat = torch.as_tensor(self.reserved, device=device)  # [size] uint8 (it keeps the reservation)
            flat[:granule].zero_()  # (the shared chunk of zeros)
        self.tensor = flat[: count * self.itemsize].view(dtype).view(shape)

    def _chunks(self, start: int, end: int, whole: bool) -> range:
        """The chunks within elements ``start`` to ``end`` (``whole``), or that they touch."""
        first, last = start * self.itemsize, end * self.itemsize
        if whole:
            return range(-(-first // self.granule), last // self.granule)
        return range(first // self.granule, -(-last // self.granule))

    def readable(self, start: int, end: int) -> None:
        """The chunks that elements ``start`` to ``end`` touch may be read (those never mapped read zeros)."""
        for chunk in self._chunks(start, end, whole=False):
            if not self.reserved.mapped[chunk]:
                self.reserved.map(chunk, self.reserved.zeros)

    def ensure(self, start: int, end: int) -> None:
        """Memory of their own (zeros) for the chunks that elements ``start`` to ``end`` touch: they may be written."""
        chunks = self.reserved.chunks
        taken = [chunk for chunk in self._chunks(start, end, whole=False) if chunks[chunk] is None]
        if not taken:
            return
        torch.cuda.current_stream(self.device).synchronize()  # (no pass in flight reads the chunks remapped)
        flat = self.tensor.view(-1).view(torch.uint8)
        for chunk in taken:
            chunks[chunk] = self.reserved.create()
            self.reserved.map(chunk, chunks[chunk])
            flat[chunk * self.granule : (chunk + 1) * self.granule].zero_()

    def release(self, start: int, end: int) -> None:
        """Give back the whole chunks within elements ``start`` to ``end``: they read as zeros again."""
        chunks = self.reserved.chunks
        given = [chunk for chunk in self._chunks(start, end, whole=True) if chunks[chunk] is not None]
        if not given:
            return
        torch.cuda.current_stream(self.device).synchronize()
        for chunk in given:
            self.reserved.map(chunk, self.reserved.zeros)
            _call("cuMemRelease", chunks[chunk])
            chunks[chunk] = None

    def resident(self) -> int:
        """Bytes of it in memory of its own now (the shared chunk of zeros apart)."""
        return sum(handle is not None for handle in self.reserved.chunks) * self.granule
