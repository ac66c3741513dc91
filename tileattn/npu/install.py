"""Run a script written for ``torch_npu`` unchanged: ``import torch_npu`` resolves to tileattn.

:func:`install` registers :mod:`tileattn.npu` as the module ``torch_npu`` and gives torch the
small device surface such scripts touch (what ``python -m tileattn.npu script.py`` does first):

* ``torch.npu``: ``is_available()`` (True: the "NPU" is tileattn on this machine's device),
  ``device_count``, ``current_device``, ``set_device``, ``synchronize``, ``manual_seed``,
  ``manual_seed_all``, ``empty_cache``, ``is_bf16_supported``, ``get_device_name`` and the memory
  counters (CUDA's when the target is a GPU, 0 on CPU). ``torch_npu.npu`` is the same object.
* ``Tensor.npu()`` and ``Module.npu()``: move to the target device (CUDA when available, else CPU;
  ``install(device=...)`` chooses).

Not provided, each raising an error that names it: other ``torch.npu``/``torch_npu`` attributes
and submodules (``torch_npu.contrib``, ``torch.npu.Stream``, ...), and ``"npu"`` device strings
(``torch.device("npu")``, ``.to("npu")``): torch itself rejects an unknown device type, naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Optional

import torch

__all__ = ["install", "uninstall", "installed", "device"]

_STATE = {}


def device() -> torch.device:
    """The device ``.npu()`` moves tensors to while installed (CUDA if available, else CPU)."""
    if "device" in _STATE:
        return _STATE["device"]
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _cuda() -> bool:
    return device().type == "cuda"


class _NpuDeviceModule(types.ModuleType):
    """``torch.npu`` for a machine without an NPU: the calls scripts make to place work."""

    def __init__(self):
        super().__init__("torch.npu", "torch.npu provided by tileattn.npu.install(): the NPU is tileattn on "
                                      "this machine's CPU or GPU.")

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return torch.cuda.device_count() if _cuda() else 1

    @staticmethod
    def current_device() -> int:
        return torch.cuda.current_device() if _cuda() else 0

    @staticmethod
    def set_device(dev) -> None:
        """Accepts an index, "npu:i" or a device; device placement follows :func:`device`."""

    @staticmethod
    def synchronize(dev=None) -> None:
        if _cuda():
            torch.cuda.synchronize()

    @staticmethod
    def manual_seed(seed) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def empty_cache() -> None:
        if _cuda():
            torch.cuda.empty_cache()

    @staticmethod
    def is_bf16_supported() -> bool:
        return True

    @staticmethod
    def get_device_name(dev=None) -> str:
        return f"tileattn ({device()})"

    @staticmethod
    def memory_allocated(dev=None) -> int:
        return torch.cuda.memory_allocated() if _cuda() else 0

    @staticmethod
    def max_memory_allocated(dev=None) -> int:
        return torch.cuda.max_memory_allocated() if _cuda() else 0

    @staticmethod
    def reset_peak_memory_stats(dev=None) -> None:
        if _cuda():
            torch.cuda.reset_peak_memory_stats()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"torch.npu.{name} is not provided by tileattn.npu.install(), which gives torch.npu only device "
            "placement (is_available, device_count, current_device, set_device, synchronize, manual_seed, "
            "empty_cache, ...); run this part on an Ascend NPU or remove the call.")


class _RefuseSubmodules(importlib.abc.MetaPathFinder):
    """``import torch_npu.<x>`` for a submodule tileattn does not provide: a clear ImportError."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torch_npu.") and fullname != "torch_npu.npu":
            raise ImportError(
                f"module '{fullname}' is not provided by tileattn.npu.install(): tileattn stands in for torch_npu's "
                "attention ops and torch_npu.npu only; run this import on an Ascend NPU or remove it.",
                name=fullname)
        return None


def _tensor_npu(self, device_=None, non_blocking=False, **kwargs):
    return self.to(device(), non_blocking=non_blocking)


def _module_npu(self, device_=None):
    return self.to(device())


def install(device: Optional[str] = None) -> None:
    """Make ``import torch_npu`` resolve to :mod:`tileattn.npu` and give torch the ``torch.npu``
    surface described in the module docstring. ``device``: where ``.npu()`` moves tensors
    (default: CUDA when available, else CPU). Idempotent; :func:`uninstall` undoes it."""
    import tileattn.npu as dialect

    if device is not None:
        _STATE["device"] = torch.device(device)
    if installed():
        return
    shim = _NpuDeviceModule()
    _STATE["saved"] = {
        "module": sys.modules.get("torch_npu"),
        "module_npu": sys.modules.get("torch_npu.npu"),
        "torch.npu": getattr(torch, "npu", None),
        "Tensor.npu": getattr(torch.Tensor, "npu", None),
        "Module.npu": getattr(torch.nn.Module, "npu", None),
    }
    finder = _RefuseSubmodules()
    _STATE["finder"] = finder
    sys.meta_path.insert(0, finder)
    sys.modules["torch_npu"] = dialect
    sys.modules["torch_npu.npu"] = shim
    dialect.npu = shim
    torch.npu = shim
    torch.Tensor.npu = _tensor_npu
    torch.nn.Module.npu = _module_npu
    _STATE["installed"] = True


def uninstall() -> None:
    """Undo :func:`install`: restore what ``torch_npu``, ``torch.npu``, ``Tensor.npu`` and
    ``Module.npu`` were before."""
    import tileattn.npu as dialect

    if not installed():
        return
    saved = _STATE.pop("saved")
    sys.meta_path.remove(_STATE.pop("finder"))
    for name, key in (("torch_npu", "module"), ("torch_npu.npu", "module_npu")):
        if saved[key] is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved[key]
    for obj, attr, key in ((torch, "npu", "torch.npu"), (torch.Tensor, "npu", "Tensor.npu"),
                           (torch.nn.Module, "npu", "Module.npu")):
        if saved[key] is None:
            if attr in vars(obj):
                delattr(obj, attr)
        else:
            setattr(obj, attr, saved[key])
    dialect.__dict__.pop("npu", None)
    _STATE.pop("device", None)
    _STATE.pop("installed", None)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _STATE.get("installed", False)
