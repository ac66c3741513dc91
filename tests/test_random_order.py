"""The suite's own random test order (tests/conftest.py): files shuffled, the tests of each file
shuffled, the seed from TILEATTN_TEST_SEED (or the UTC date) printed at the end so that an order can
be replayed (the same seed gives the same order)."""

from __future__ import annotations

import pytest

import conftest


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


class _Config:
    def __init__(self, seed):
        self.stash = pytest.Stash()
        self.stash[conftest._SEED_KEY] = seed


def _order(seed, nodeids):
    items = [_Item(n) for n in nodeids]
    conftest.pytest_collection_modifyitems(_Config(seed), items)
    return [i.nodeid for i in items]


NODEIDS = [f"tests/test_{f}.py::test_{t}" for f in "abcd" for t in range(6)]


def test_a_seed_gives_one_order_and_keeps_each_files_tests_together():
    first = _order(7, NODEIDS)
    assert first == _order(7, NODEIDS) and sorted(first) == sorted(NODEIDS)
    assert first != NODEIDS and first != _order(8, NODEIDS)
    files = [n.split("::")[0] for n in first]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(runs) == len(set(runs)) == 4, f"a file's tests are split: {runs}"
    within = [n for n in first if n.startswith("tests/test_a.py")]
    assert within != sorted(within), "the tests of a file are shuffled too"


def test_no_seed_keeps_the_files_own_order():
    assert _order(None, NODEIDS) == NODEIDS


@pytest.mark.parametrize("value, expected", [("", "date"), ("42", 42), ("none", None), ("NONE", None)])
def test_the_seed_comes_from_the_environment_or_the_date(value, expected, monkeypatch):
    monkeypatch.setenv(conftest.SEED_ENV, value)
    got = conftest._order_seed()
    if expected == "date":
        assert 20200101 <= got <= 29991231
    else:
        assert got == expected


def test_a_bad_seed_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(conftest.SEED_ENV, "tomorrow")
    with pytest.raises(pytest.UsageError, match="TILEATTN_TEST_SEED='tomorrow'"):
        conftest._order_seed()


def test_the_run_ends_with_the_seed_that_replays_it():
    lines = []

    class Reporter:
        write_line = staticmethod(lines.append)

    conftest.pytest_terminal_summary(Reporter(), _Config(3))
    conftest.pytest_terminal_summary(Reporter(), _Config(None))
    assert lines == ["tileattn: tests in random order, seed 3 (replay: TILEATTN_TEST_SEED=3)",
                     "tileattn: tests in the files' own order (TILEATTN_TEST_SEED=none)"]
