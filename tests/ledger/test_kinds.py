"""Every receipt kind has its row in each table: a chain rule and a schema (ledger/kinds.py) and its checks
(verify/checks.py). The tables are checked against the enum, so a kind added to one place and not the others fails
here, and the checks here would catch a table that lost a row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from ledger import kinds, rules
from ledger.errors import RecordInvalid
from ledger.kinds import KINDS, Schema, Shape
from ledger.receipts import Kind, make_receipt
from tests.conftest import schema_fill
from verify.checks import CHECKS, check_schema


def missing_rows(kind_table: Mapping[Kind, Any], check_table: Mapping[Kind, Any]) -> dict[str, list[str]]:
    """What each kind lacks: a row in either table, a callable rule, a schema, a first check of its schema."""
    lacking: dict[str, list[str]] = {}
    for kind in Kind:
        problems = []
        spec = kind_table.get(kind)
        if spec is None:
            problems.append("no row in ledger/kinds.py")
        else:
            if not callable(spec.rule):
                problems.append("no chain rule")
            if not isinstance(spec.schema, Schema):
                problems.append("no measurement schema")
            if not spec.summary:
                problems.append("no summary")
        checks = check_table.get(kind)
        if not checks:
            problems.append("no checks in verify/checks.py")
        elif checks[0] is not check_schema:
            problems.append("its checks do not start with the schema check")
        if problems:
            lacking[kind.value] = problems
    return lacking


def test_every_kind_has_a_rule_a_schema_and_checks() -> None:
    assert missing_rows(KINDS, CHECKS) == {}
    assert set(KINDS) == set(CHECKS) == set(Kind)


@pytest.mark.parametrize("table", ["kinds", "checks"])
def test_a_kind_without_its_row_is_caught(table: str) -> None:
    kinds_t, checks_t = dict(KINDS), dict(CHECKS)
    (kinds_t if table == "kinds" else checks_t).pop(Kind.FAULT)
    assert "fault" in missing_rows(kinds_t, checks_t)
    bad = dict(KINDS)
    bad[Kind.NOTE] = kinds.KindSpec("a note", rules.no_rule, None)  # type: ignore[arg-type]
    assert missing_rows(bad, CHECKS) == {"note": ["no measurement schema"]}


@pytest.mark.parametrize("kind", [k.value for k in Kind])
def test_schema_filled_measurements_pass_and_each_missing_field_is_named(kind: str) -> None:
    filled = schema_fill(kind)
    kinds.spec(kind).schema.check(make_receipt(kind, measurements=filled))
    shapes = kinds.spec(kind).schema.shapes
    for name in (shapes[0].fields if shapes else ()):
        without = {k: v for k, v in filled.items() if k != name}
        with pytest.raises(RecordInvalid) as caught:
            kinds.spec(kind).schema.check(make_receipt(kind, measurements=without))
        assert caught.value.field == f"measurements.{name}" and caught.value.actual == "nothing"


def test_schema_types_are_json_types_and_bool_is_never_a_number() -> None:
    schema = Schema((Shape({"n": kinds.NUMBER, "flag": bool}),))
    schema.check(make_receipt("note", measurements={"n": 0, "flag": True}))
    schema.check(make_receipt("note", measurements={"n": 1.5, "flag": False}))
    with pytest.raises(RecordInvalid) as caught:
        schema.check(make_receipt("note", measurements={"n": True, "flag": False}))
    assert (caught.value.field, caught.value.expected) == ("measurements.n", "integer or number")
    with pytest.raises(RecordInvalid):
        schema.check(make_receipt("note", measurements={"n": 1, "flag": 1}))


def test_a_format_no_shape_knows_is_refused() -> None:
    with pytest.raises(RecordInvalid) as caught:
        kinds.spec("eval").schema.check(make_receipt("eval", measurements={"format": "someone-elses/9"}))
    assert caught.value.field == "measurements"


def test_kind_members_are_stored_as_plain_strings() -> None:
    r = make_receipt(Kind.NOTE, measurements={"x": 1})
    assert type(r.kind) is str and r.body == make_receipt("note", measurements={"x": 1}).body


def test_every_format_the_table_selects_is_named_where_writers_take_it() -> None:
    # Writers put formats in receipts from ledger/experiment/formats.py (and the key formats from ledger/rules.py):
    # a format only the table spells could be selected by no receipt a writer makes.
    from ledger.experiment import formats

    named = {v for k, v in vars(formats).items() if k.isupper() and isinstance(v, str)}
    named |= {rules.KEY_FORMAT, rules.KEY_REVOCATION_FORMAT}
    selected = {value for spec in KINDS.values() for shape in spec.schema.shapes for value in shape.when.values()}
    assert selected == named
