"""GPU tensors in CUDA's virtual memory (specula.machine.vmm): chunks mapped where read, memory of their own where
written, given back. The mapping itself needs a GPU; without one, the module says it is not at hand."""

from __future__ import annotations

import pytest
import torch

from specula.machine import vmm

GPU = torch.cuda.is_available() and vmm.granularity(torch.device("cuda", 0)) is not None


def test_without_a_gpu_nothing_is_at_hand() -> None:
    assert vmm.granularity(torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="not at hand on cpu"):
        vmm.DevicePages((4, 4), torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with virtual memory management")
def test_chunks_take_memory_where_written_and_read_zeros_elsewhere() -> None:
    """Four rows of two chunks each: the rows read as zeros once readable; a written row holds its own chunks (and
    only those), its neighbours still read zeros, and once given back it reads zeros and holds nothing (mutants: the
    chunk of zeros written through, release without remapping)."""
    device = torch.device("cuda", 0)
    granule = vmm.granularity(device)
    row = 2 * granule // 4  # (float32 elements of two chunks)
    pages = vmm.DevicePages((4, row), torch.float32, device)
    pages.readable(0, 4 * row)
    assert pages.resident() == 0 and int(pages.tensor.abs().sum()) == 0
    pages.ensure(row, 2 * row)
    pages.tensor[1] = 1.0
    assert pages.resident() == 2 * granule
    assert float(pages.tensor.sum()) == row and int(pages.tensor[[0, 2, 3]].abs().sum()) == 0
    pages.release(row, 2 * row)
    assert pages.resident() == 0 and int(pages.tensor.abs().sum()) == 0
