"""The wheel's build step: on Linux, the native kernels prebuilt for three levels of the compiler's
architecture (x86-64, or aarch64: a cross compiler in ``$CC`` builds the aarch64 wheel).

The project's metadata is in pyproject.toml; this file only adds the prebuilt libraries
(:mod:`tileattn.backends.native.prebuilt`) to the wheel's ``tileattn/backends/native/prebuilt/`` and
marks that wheel platform-specific (``py3-none-linux_<arch>``; ``scripts/build_wheel.sh`` repairs it
into a manylinux wheel with libgomp bundled). ``TILEATTN_PREBUILT`` decides:

* ``auto`` (default): prebuild on Linux when a C compiler for x86-64 or aarch64 takes all three flag
  sets of its architecture; otherwise
  (another platform, no compiler, an old compiler) the pure ``py3-none-any`` wheel, whose native
  engine compiles on first use, as the sdist always does
* ``1``: prebuild or fail (CI's ship check)
* ``0``: the pure wheel

Editable installs never prebuild: a checkout compiles on first use.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from pathlib import Path

import setuptools
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
ENV = "TILEATTN_PREBUILT"


def _prebuilt_module():
    """tileattn.backends.native.prebuilt without running tileattn/__init__.py, which imports torch (not
    in the build's environment): its parent packages stand in as bare module objects."""
    for name in ("tileattn", "tileattn.programs", "tileattn.backends", "tileattn.backends.native"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT.joinpath(*name.split(".")))]
            sys.modules[name] = package
    from tileattn.backends.native import prebuilt

    return prebuilt


@functools.lru_cache(maxsize=None)
def _plan():
    """The compiler command to prebuild with, or None for the pure wheel (with the reason printed)."""
    wanted = os.environ.get(ENV, "auto").strip().lower()
    if wanted not in ("auto", "1", "0"):
        raise SystemExit(f"{ENV}={wanted!r}; expected auto, 1 or 0")
    if wanted == "0":
        return None
    prebuilt = _prebuilt_module()
    find_compiler, BuildError = prebuilt.build.find_compiler, prebuilt.BuildError
    why = None
    if sys.platform != "linux":
        why = f"prebuilt libraries are for Linux, not {sys.platform}"
    else:
        try:
            cc = tuple(find_compiler())
            why = prebuilt.unbuildable(cc)
        except BuildError as exc:
            why = str(exc)
    if why is None:
        return cc
    if wanted == "1":
        raise SystemExit(f"{ENV}=1: {why}")
    print(f"tileattn: building the pure wheel (compile on first use): {why}", file=sys.stderr)
    return None


class BuildPy(build_py):
    def run(self):
        super().run()
        cc = None if self.editable_mode else _plan()
        if cc is not None:
            dest = Path(self.build_lib) / "tileattn" / "backends" / "native" / "prebuilt"
            built = _prebuilt_module().compile_all(dest, cc)
            print(f"tileattn: prebuilt native libraries {', '.join(built)} with {' '.join(cc)}", file=sys.stderr)


class EditableWheel(editable_wheel):
    def finalize_options(self):
        self.distribution.tileattn_editable = True
        super().finalize_options()


class Distribution(setuptools.Distribution):
    def has_ext_modules(self):
        """True for the platform wheel: its files install to platlib, as auditwheel requires."""
        return not getattr(self, "tileattn_editable", False) and _plan() is not None


class BdistWheel(bdist_wheel):
    def get_tag(self):
        if self.root_is_pure:
            return super().get_tag()
        # no Python extension: any CPython 3 loads the libraries; the architecture is the compiler's target
        return "py3", "none", "linux_" + _prebuilt_module().toolchain.target_arch(_plan()).name


setuptools.setup(distclass=Distribution,
                 cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel, "editable_wheel": EditableWheel})
