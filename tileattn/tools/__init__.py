"""Tooling around the operator: the ``tileattn`` command (:mod:`.cli`), benchmarks (:mod:`.bench`,
:mod:`.decode_bench`), measurement and tuning (:mod:`.measure`, :mod:`.tuning`) and the hub's contest.
Nothing in the core or the dialects imports this package."""
