"""Running code written for torch_npu unchanged: tileattn.npu.install() and ``python -m tileattn.npu``."""

import os
import subprocess
import sys

import pytest
import torch

import tileattn.npu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "npu_scripts")


@pytest.fixture
def installed():
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
    tileattn.npu.install(device="cpu")
    try:
        yield
    finally:
        tileattn.npu.uninstall()


def test_install_makes_torch_npu_importable_and_gives_device_placement(installed):
    import torch_npu

    assert torch_npu is tileattn.npu and tileattn.npu.installed()
    from torch_npu import npu_fusion_attention, npu_fused_infer_attention_score  # noqa: F401
    assert torch.npu.is_available() and torch.npu.device_count() == 1 and torch.npu.current_device() == 0
    torch.npu.set_device(0)
    torch.npu.synchronize()
    torch.npu.manual_seed(3)
    assert torch_npu.npu.is_available()
    x = torch.randn(3).npu()
    assert x.device.type == "cpu"
    layer = torch.nn.Linear(2, 2).npu()
    assert layer.weight.device.type == "cpu"
    with pytest.raises(AttributeError, match="torch.npu.Stream is not provided"):
        torch.npu.Stream  # noqa: B018
    with pytest.raises(ImportError, match="'torch_npu.contrib' is not provided"):
        import torch_npu.contrib  # noqa: F401
    with pytest.raises(AttributeError, match="does not provide 'npu_rotary_mul'"):
        torch_npu.npu_rotary_mul  # noqa: B018


def test_uninstall_restores_everything():
    tileattn.npu.install()
    tileattn.npu.uninstall()
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu") and not hasattr(torch.Tensor, "npu")
    with pytest.raises(ModuleNotFoundError):
        import torch_npu  # noqa: F401


def test_python_m_runs_transformers_npu_flash_attention_unchanged():
    """transformers' own NPU flash-attention integration on a tiny Llama, torch_npu faked by
    tileattn: padding (TND), no padding (BSND), decode with the KV cache, a training step, for
    SPARSE_MODE 3 and 2 (tests/npu_scripts/hf_llama_npu_fa2.py prints each check)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-m", "tileattn.npu", os.path.join(SCRIPTS, "hf_llama_npu_fa2.py")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok") and proc.stdout.count("sparse modes") == 2, proc.stdout


def test_python_m_usage():
    proc = subprocess.run([sys.executable, "-m", "tileattn.npu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage: python -m tileattn.npu" in proc.stderr
