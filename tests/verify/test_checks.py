"""verify/checks.py: the kinds' checks are imported when they first run; every one the table names exists."""

from __future__ import annotations

from verify import checks


def test_every_check_the_table_names_is_a_function() -> None:
    assert len(checks.IMPORTED_LATER) >= 10
    for module, name in checks.IMPORTED_LATER:
        assert callable(checks.resolve(module, name)), (module, name)


def test_a_check_keeps_its_name() -> None:
    names = {c.__name__ for kind_checks in checks.CHECKS.values() for c in kind_checks}
    assert {"check_schema", "eval_check", "check_report_page", "check_rank_comparison"} <= names
