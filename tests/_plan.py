"""A dry run's plan, read by the tests of install.sh and the steps (tests/test_install.py, tests/test_specs.py)."""

from __future__ import annotations


def in_order(out: str, pieces: list[str]) -> None:
    """Every piece is in `out`, each after the one before it (the plan's order is the order things run)."""
    pos = 0
    for piece in pieces:
        found = out.find(piece, pos)
        assert found >= 0, f"{piece!r} missing (or out of order) in the plan:\n{out}"
        pos = found
