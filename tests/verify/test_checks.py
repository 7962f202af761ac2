"""verify/checks.py: the kinds' checks are imported when they first run; every one the table names exists; a kind
checked by its schema alone costs no context."""

from __future__ import annotations

import pytest

from ledger.errors import RecordInvalid
from ledger.receipts import make_receipt
from verify import checks
from verify.context import KindCheckContext


def test_every_check_the_table_names_is_a_function() -> None:
    assert len(checks.IMPORTED_LATER) >= 10
    for module, name in checks.IMPORTED_LATER:
        assert callable(checks.resolve(module, name)), (module, name)


def test_a_check_keeps_its_name() -> None:
    names = {c.__name__ for kind_checks in checks.CHECKS.values() for c in kind_checks}
    assert {"check_schema", "eval_check", "check_report_page", "check_rank_comparison"} <= names


def _no_context() -> KindCheckContext:
    raise AssertionError("a context was built for a check that reads the receipt alone")


def test_a_kind_checked_by_its_schema_alone_needs_no_context() -> None:
    """run_checks builds no context for a note or a checkpoint (most receipts of a long ledger), and the schema is
    still checked: a checkpoint receipt missing a field fails without one."""
    assert checks.schema_alone("note") and checks.schema_alone("checkpoint")
    assert checks.run_checks(make_receipt("note", measurements={"anything": 1}), _no_context) == []
    with pytest.raises(RecordInvalid, match="measurements.losses"):
        checks.run_checks(make_receipt("checkpoint", measurements={"arm": "a", "world": 2, "files": {}}), _no_context)


def test_a_kind_with_checks_beyond_its_schema_gets_its_context() -> None:
    """An arm summary's figures are recomputed from its ancestry: the context is asked for."""
    assert not checks.schema_alone("arm-summary")
    receipt = make_receipt("arm-summary", measurements={
        "arm": "a", "world": 2, "ranks": [], "max_rank_active_seconds": 1.0, "max_rank_loop_seconds": 1.0,
        "total_sent_bytes": 0, "parameter_digest": "x", "ratios": {}})
    asked: list[bool] = []

    def context() -> KindCheckContext:
        asked.append(True)
        raise LookupError("the context was asked for")

    with pytest.raises(LookupError):
        checks.run_checks(receipt, context)
    assert asked == [True]
