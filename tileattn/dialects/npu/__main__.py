"""``python -m tileattn.npu script.py [args...]`` (or ``-m module [args...]``): run a program written
for torch_npu with :func:`tileattn.npu.install` in effect, unchanged."""

import os
import runpy
import sys

from . import install

_USAGE = "usage: python -m tileattn.npu SCRIPT.py [ARGS...] | -m MODULE [ARGS...]"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(_USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
