"""``python -m tileattn``: the same command as the ``tileattn`` console script."""

from .tools.cli import main

raise SystemExit(main())
