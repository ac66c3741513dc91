"""Old public import paths of modules that moved (``tileattn.npu`` -> ``tileattn.dialects.npu``, ...):
the old name is the same module object, submodules included, so state and monkeypatching are shared."""

import importlib
import pkgutil
import sys


def alias(old: str, new: str) -> None:
    """Make ``old`` (the module being imported) the module ``new`` in ``sys.modules``."""
    module = importlib.import_module(new)
    sys.modules[old] = module
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if not info.name.startswith("__"):
            sys.modules[f"{old}.{info.name}"] = importlib.import_module(f"{new}.{info.name}")
