"""Print the native builds (avx2, generic) that this CPU and compiler can run, other than the one the
engine picks anyway: one per line, nothing when there is no native engine here. scripts/ci_matrix.sh
runs the kernels' hub chapter under each; tests/test_native_build.py runs this file, so a renamed
function fails the suite instead of CI's last stage."""

from tileattn.backends.native import kernels
from tileattn.programs import toolchain


def other_builds() -> list:
    ok, _ = kernels.available()
    if not ok:
        return []  # no native engine here: the cpu engine serves, and there is nothing to add
    try:
        cc = tuple(toolchain.find_compiler())
    except toolchain.BuildError:
        return []  # a prebuilt library serves, and no other build can be compiled
    default = kernels.build_info()["isa"]
    return [isa for isa in ("avx2", "generic") if isa != default and isinstance(toolchain.variant(cc, isa), tuple)]


if __name__ == "__main__":
    for isa in other_builds():
        print(isa)
