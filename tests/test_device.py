"""Device choice under simulated machines: NPU importable or not, CUDA or not."""

from __future__ import annotations

import types

import pytest
import torch

from kit.system import device


@pytest.fixture
def fake_machine(monkeypatch):
    """Configure what torch_npu / torch.npu / torch.cuda report, then call detect()."""

    def configure(
        npu_importable: bool,
        npu_count: int = 0,
        bf16: bool = True,
        cuda: bool = False,
        cuda_bf16: bool = True,
    ):
        mod = types.ModuleType("torch_npu")
        mod.__version__ = "2.13.0"
        device.torch_npu_import.cache_clear()
        if npu_importable:
            monkeypatch.setattr(device, "torch_npu_import", lambda: (mod, None))
            monkeypatch.setattr(
                torch,
                "npu",
                types.SimpleNamespace(
                    is_available=lambda: npu_count > 0,
                    device_count=lambda: npu_count,
                    get_device_name=lambda i=0: "Ascend910B3",
                    is_bf16_supported=lambda: bf16,
                ),
                raising=False,
            )
        else:
            monkeypatch.setattr(
                device,
                "torch_npu_import",
                lambda: (None, "OSError: libhccl.so: cannot open shared object file"),
            )
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
        monkeypatch.delenv("KIT_DEVICE", raising=False)

    return configure


def test_cpu_machine_chooses_cpu_gloo_fp32_and_keeps_npu_error(fake_machine):
    fake_machine(npu_importable=False)
    info = device.detect()
    assert (info.kind, info.device, info.backend, info.dtype) == ("cpu", "cpu", "gloo", "float32")
    assert info.visible_devices_env is None
    assert info.torch_npu_error == "OSError: libhccl.so: cannot open shared object file"
    assert any("torch_npu not importable" in r for r in info.reasons)


def test_npu_with_bf16_chooses_npu_hccl_bf16(fake_machine):
    fake_machine(npu_importable=True, npu_count=8, bf16=True, cuda=True)  # NPU wins over CUDA
    info = device.detect()
    assert (info.kind, info.device, info.count, info.backend, info.dtype) == (
        "npu",
        "npu:0",
        8,
        "hccl",
        "bfloat16",
    )
    assert info.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert info.torch_npu_version == "2.13.0"


def test_npu_without_bf16_falls_back_to_fp16(fake_machine):
    fake_machine(npu_importable=True, npu_count=1, bf16=False)
    info = device.detect()
    assert info.dtype == "float16" and "910A" in info.dtype_reason


def test_torch_npu_importable_but_no_card_uses_cuda_then_cpu(fake_machine):
    fake_machine(npu_importable=True, npu_count=0, cuda=True, cuda_bf16=False)
    info = device.detect()
    assert (info.kind, info.backend, info.dtype, info.visible_devices_env) == (
        "cuda",
        "nccl",
        "float16",
        "CUDA_VISIBLE_DEVICES",
    )
    assert any("no NPU is visible" in r for r in info.reasons)


def test_prefer_and_env_override(fake_machine, monkeypatch):
    fake_machine(npu_importable=True, npu_count=2, cuda=False)
    assert device.detect(prefer="cpu").kind == "cpu"
    monkeypatch.setenv("KIT_DEVICE", "cpu")
    assert device.detect().kind == "cpu"
    with pytest.raises(RuntimeError, match="CUDA requested"):
        device.detect(prefer="cuda")
    with pytest.raises(ValueError, match="not one of npu, cuda, cpu"):
        device.detect(prefer="tpu")


def test_get_device_uses_local_rank(fake_machine, monkeypatch):
    fake_machine(npu_importable=False, cuda=False)
    assert device.get_device() == torch.device("cpu")


def test_transfer_to_npu_is_a_noop_without_torch_npu(fake_machine):
    fake_machine(npu_importable=False)
    assert device.enable_transfer_to_npu() is False


def test_real_machine_has_no_torch_npu():
    device.torch_npu_import.cache_clear()
    mod, err = device.torch_npu_import()
    assert mod is None and "torch_npu" in err
    assert device.detect().kind == "cpu"
