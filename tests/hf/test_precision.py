"""dtype="auto": fp32 on a CPU without native bf16 (unless it would not fit), bf16 where the hardware computes in it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from specula.hf import loading, precision

GIB = 1 << 30


@pytest.fixture
def cpu(monkeypatch):
    """Set what the CPU can do and how much memory the machine has."""

    def configure(native_bf16: bool, memory: int | None = 64 * GIB) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
        monkeypatch.setattr(precision, "physical_memory_bytes", lambda: memory)

    return configure


def test_fp32_on_a_cpu_that_emulates_bf16(cpu) -> None:
    cpu(native_bf16=False)
    assert precision.auto_dtype("cpu", 135_000_000) == torch.float32
    assert precision.auto_dtype(torch.device("cpu"), 1_500_000_000) == torch.float32


def test_bf16_on_a_cpu_with_bf16_instructions(cpu) -> None:
    cpu(native_bf16=True)
    assert precision.auto_dtype("cpu", 135_000_000) == torch.bfloat16


def test_bf16_when_fp32_weights_would_take_more_than_half_the_memory(cpu) -> None:
    cpu(native_bf16=False, memory=16 * GIB)
    assert precision.auto_dtype("cpu", 2 * GIB // 4) == torch.float32  # 2 GiB of fp32 weights
    assert precision.auto_dtype("cpu", 7_000_000_000) == torch.bfloat16  # 28 GB of fp32 weights
    cpu(native_bf16=False, memory=None)  # unknown memory: the dtype is chosen for speed alone
    assert precision.auto_dtype("cpu", 7_000_000_000) == torch.float32


def test_the_real_machine_is_described() -> None:
    assert isinstance(precision.cpu_has_native_bf16(), bool)
    memory = precision.physical_memory_bytes()
    assert memory is None or memory > 256 * (1 << 20)


def test_load_model_resolves_auto(cpu, tmp_path) -> None:
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    expected_parameters = model.num_parameters()
    assert loading._num_parameters(tmp_path) == expected_parameters
    for native_bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        cpu(native_bf16=native_bf16)
        loaded, _ = loading.load_model(tmp_path, tune_layout=False)
        assert loaded.dtype == dtype
    with pytest.raises(ValueError, match="torch.dtype or 'auto'"):
        loading.load_model(tmp_path, dtype="float32")
