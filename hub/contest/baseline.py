"""The contest baseline, as the hub links it: the code lives in the package, ``tileattn/tools/contest_baseline.py``.

``tileattn contest score`` must find its baseline in an installed tileattn, with no repository
checkout around, so the file moved into the package; this one re-exports it so that
``tileattn contest score hub/contest/baseline.py`` and the hub's links keep working. Start your
submission from ``tileattn/tools/contest_baseline.py``.
"""

from tileattn.tools.contest_baseline import attention  # noqa: F401
