"""Built-in engines. Importing this package registers them with :mod:`tileattn.core.dispatch`."""

from . import cpu, native, reference_backend  # noqa: F401

try:  # The Triton engine needs the triton package; without it, it is simply not registered.
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
