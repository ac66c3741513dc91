"""Run a script written for ``torch_npu`` unchanged: ``import torch_npu`` resolves to tileattn.

:func:`install` registers :mod:`tileattn.npu` as the module ``torch_npu`` and gives torch the
small device surface such scripts touch (what ``python -m tileattn.npu script.py`` does first):

* ``torch.npu``: ``is_available()`` (True: the "NPU" is tileattn on this machine's device),
  ``device_count``, ``current_device``, ``set_device``, ``synchronize``, ``manual_seed``,
  ``manual_seed_all``, ``empty_cache``, ``is_bf16_supported``, ``get_device_name`` and the memory
  counters (CUDA's when the target is a GPU, 0 on CPU). ``torch_npu.npu`` is the same object.
* ``Tensor.npu()`` and ``Module.npu()``: move to the target device (CUDA when available, else CPU;
  ``install(device=...)`` chooses).
* The NPU as a ``device=`` argument: ``"npu"``, ``"npu:<i>"`` and what ``torch.npu.current_device()``
  returns (an int, 0 on CPU) resolve to the target device wherever torch takes a device:
  ``torch.arange(n, device=torch.npu.current_device())``, ``torch.empty(..., device=f"npu:{i}")``,
  ``x.to("npu")``, ``module.to("npu")``. Done by a :class:`torch.overrides.TorchFunctionMode` that
  rewrites only those device arguments (every other call, plain ints such as ``device=0`` included,
  passes through untouched), active in the thread that called :func:`install` (torch keeps such
  modes per thread), and by ``Module.to``, whose device parsing no mode sees. The dialect's own ops
  run with the mode set aside (:func:`beside_stand_in`), so it costs them nothing.

Not provided, each raising an error that names it: other ``torch.npu``/``torch_npu`` attributes
and submodules (``torch_npu.contrib``, ``torch.npu.Stream``, ...), ``torch.device("npu")`` (a type
torch builds itself: it rejects the unknown device type, naming it), and NPU device arguments in
threads other than the installing one.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import re
import sys
import types
from typing import Optional

import torch
from torch.overrides import (
    TorchFunctionMode, _get_current_function_mode, _get_current_function_mode_stack, _pop_mode, _push_mode,
)

__all__ = ["install", "uninstall", "installed", "device"]

_STATE = {}


def device() -> torch.device:
    """The device ``.npu()`` moves tensors to while installed (CUDA if available, else CPU)."""
    if "device" in _STATE:
        return _STATE["device"]
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _cuda() -> bool:
    return device().type == "cuda"


class NpuIndex(int):
    """What ``torch.npu.current_device()`` returns: an int (the NPU's index, as torch_npu's), which
    the device stand-in recognises as the NPU when it is passed as a ``device=`` (a plain int means
    CUDA to torch)."""


_NPU_DEVICE = re.compile(r"npu(?::(\d+))?\Z")


def resolve(dev):
    """``dev`` as the device it stands for: the target device for an NPU device ("npu", "npu:<i>", an
    :class:`NpuIndex`), keeping the index on CUDA; anything else unchanged."""
    if isinstance(dev, NpuIndex):
        index = int(dev)
    elif isinstance(dev, str) and _NPU_DEVICE.match(dev):
        index = _NPU_DEVICE.match(dev).group(1)
        index = None if index is None else int(index)
    else:
        return dev
    target = device()
    if target.type != "cuda" or index is None:
        return target
    return torch.device("cuda", index)


class _NpuDevices(TorchFunctionMode):
    """Rewrites NPU device arguments (keyword ``device=``, or the first positional argument of
    ``Tensor.to``) to the target device; every other call passes through untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs and "device" in kwargs:
            kwargs = dict(kwargs, device=resolve(kwargs["device"]))
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], resolve(args[1])) + tuple(args[2:])
        return func(*args, **(kwargs or {}))


def _module_to(self, *args, **kwargs):
    if "device" in kwargs:
        kwargs["device"] = resolve(kwargs["device"])
    return _STATE["saved"]["Module.to"](self, *(resolve(a) for a in args), **kwargs)


def beside_stand_in(op):
    """``op`` (a dialect op: every tensor it makes lives on its inputs' device) run with the device
    stand-in's mode off while it is the innermost mode: each torch call inside would otherwise pay
    the mode's Python dispatch (an attention call made about 1.6x slower)."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        mode = _STATE.get("mode")
        if mode is None or _get_current_function_mode() is not mode:
            return op(*args, **kwargs)
        _pop_mode()
        try:
            return op(*args, **kwargs)
        finally:
            _push_mode(mode)

    return run


def _remove_mode(mode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack, leaving the modes pushed above it."""
    if not any(m is mode for m in _get_current_function_mode_stack()):
        raise RuntimeError("tileattn.npu.uninstall() must run in the thread that called install(): the NPU "
                           "device stand-in is a torch-function mode of that thread.")
    above = []
    while True:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


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
        return NpuIndex(torch.cuda.current_device() if _cuda() else 0)

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


def install(dialect, device: Optional[str] = None) -> None:
    """Make ``import torch_npu`` resolve to ``dialect`` (the :mod:`tileattn.npu` package, which passes
    itself, so this module never imports its package) and give torch the ``torch.npu`` surface
    described in the module docstring. ``device``: where ``.npu()`` moves tensors (default: CUDA when
    available, else CPU). Idempotent; :func:`uninstall` undoes it."""
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
        "Module.to": torch.nn.Module.to,
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
    torch.nn.Module.to = _module_to
    mode = _NpuDevices()
    _push_mode(mode)
    _STATE["mode"] = mode
    _STATE["installed"] = True


def uninstall(dialect) -> None:
    """Undo :func:`install`: restore what ``torch_npu``, ``torch.npu``, ``Tensor.npu``, ``Module.npu``
    and ``Module.to`` were before, and end the device stand-in (from the thread that installed it)."""
    if not installed():
        return
    _remove_mode(_STATE["mode"])
    del _STATE["mode"]
    saved = _STATE.pop("saved")
    sys.meta_path.remove(_STATE.pop("finder"))
    for name, key in (("torch_npu", "module"), ("torch_npu.npu", "module_npu")):
        if saved[key] is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved[key]
    for obj, attr, key in ((torch, "npu", "torch.npu"), (torch.Tensor, "npu", "Tensor.npu"),
                           (torch.nn.Module, "npu", "Module.npu"), (torch.nn.Module, "to", "Module.to")):
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
