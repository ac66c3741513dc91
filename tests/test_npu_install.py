"""Running code written for torch_npu unchanged: tileattn.npu.install() and ``python -m tileattn.npu``."""

import os
import subprocess
import sys
import threading

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


def _outcome(call):
    try:
        result = call()
    except Exception as e:  # noqa: BLE001  (the outcome compared is the exception itself)
        return type(e), str(e)
    return result.device if isinstance(result, torch.Tensor) else next(result.parameters()).device


def test_the_npu_device_resolves_wherever_a_caller_passes_it(installed):
    """torch.npu.current_device(), "npu" and "npu:<i>" as device arguments land on the stand-in's device
    (MindSpeed's compute_qkv_index builds its index tensors with device=torch.npu.current_device())."""
    i = torch.npu.current_device()
    assert i == 0 and f"npu:{i}" == "npu:0"
    seq_ends = [5, 12]
    halves = [j for start, end in zip([0] + seq_ends, seq_ends) for j in range((start + end) // 2, end)]
    q_index = torch.tensor(halves, device=torch.npu.current_device())
    assert q_index.device.type == "cpu" and q_index.tolist() == [2, 3, 4, 8, 9, 10, 11]
    x = torch.arange(6.0).view(2, 3)
    made = [
        torch.arange(4, device=torch.npu.current_device()), torch.empty(2, 3, device=f"npu:{i}"),
        torch.zeros(2, device="npu"), torch.full((2,), 1.5, device="npu:0"), torch.randn(3, device="npu"),
        torch.zeros_like(x, device="npu"), x.new_ones(2, device="npu:0"), x.to("npu"), x.to("npu", torch.float64),
        x.to(device="npu:0", non_blocking=True), x.npu(),
    ]
    assert all(t.device.type == "cpu" for t in made)
    assert torch.equal(made[7], x) and made[8].dtype == torch.float64 and torch.equal(made[0], torch.arange(4))
    layer = torch.nn.Linear(2, 2).to("npu")
    layer = layer.to(device="npu:0", dtype=torch.float64)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float64


def test_device_arguments_that_are_not_the_npu_behave_as_without_install():
    """Plain ints (CUDA's index to torch), other device strings and malformed "npu" strings give
    exactly what torch gives them without the stand-in."""
    calls = [lambda: torch.arange(3, device=0), lambda: torch.zeros(2, device="cpu"),
             lambda: torch.ones(2).to("cpu", torch.float64), lambda: torch.ones(1).to("npu:x"),
             lambda: torch.ones(1, device="meta"), lambda: torch.nn.Linear(2, 2).to("cpu")]
    before = [_outcome(c) for c in calls]
    tileattn.npu.install(device="cpu")
    try:
        during = [_outcome(c) for c in calls]
    finally:
        tileattn.npu.uninstall()
    assert during == before


def test_the_dialects_own_ops_run_beside_the_device_stand_in(installed, monkeypatch):
    """An attention op does not pay the stand-in's per-call dispatch: its mode is set aside inside."""
    from torch.overrides import _get_current_function_mode

    seen = []
    real = tileattn.npu.inference.flash_attention

    def spy(*args, **kwargs):
        seen.append(_get_current_function_mode())
        return real(*args, **kwargs)

    monkeypatch.setattr(tileattn.npu.inference, "flash_attention", spy)
    q = torch.randn(1, 2, 8)
    tileattn.npu.npu_fused_infer_attention_score(q, q, q, num_heads=1, input_layout="BSH", scale=0.3)
    assert seen == [None] and _get_current_function_mode() is not None


def test_uninstall_restores_everything():
    from torch.overrides import _get_current_function_mode_stack

    modes, module_to = _get_current_function_mode_stack(), torch.nn.Module.to
    tileattn.npu.install()
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_outcome(tileattn.npu.uninstall)))
    thread.start()
    thread.join()
    assert errors and errors[0][0] is RuntimeError and "thread that called install()" in errors[0][1]
    assert tileattn.npu.installed()
    tileattn.npu.uninstall()
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu") and not hasattr(torch.Tensor, "npu")
    assert _get_current_function_mode_stack() == modes and torch.nn.Module.to is module_to
    with pytest.raises(ModuleNotFoundError):
        import torch_npu  # noqa: F401
    with pytest.raises(RuntimeError, match="npu"):
        torch.ones(1).to("npu")


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
