"""Receipts (ledger/receipts.py): construction, exact parsing, and every malformed shape rejected by field."""

from __future__ import annotations

from typing import Any

import pytest

from ledger import digests
from ledger.errors import MalformedReceipt, NonCanonical
from ledger.receipts import FIELDS, KINDS, SCHEMA_VERSION, Kind, Receipt, a_kind, make_receipt, parse_receipt

D1 = digests.raw_digest(b"one")
D2 = digests.raw_digest(b"two")
D3 = digests.raw_digest(b"three")


def full_receipt() -> Receipt:
    return make_receipt(
        "checkpoint", run="run-a", rank=3, step=40, prepared=D1, selection=D2, parents=[D3, D1],
        artifacts={"state": D2, "model": D3}, measurements={"loss": 0.25, "tokens": 4096, "note": "é"},
    )


def valid_document() -> dict[str, Any]:
    return full_receipt().to_document()


def test_body_has_exactly_the_documented_fields() -> None:
    doc = digests.parse_canonical(full_receipt().body)
    assert sorted(doc) == sorted(FIELDS)
    assert doc["v"] == SCHEMA_VERSION == 1
    assert doc["alg"] == "blake3"


@pytest.mark.parametrize(("kind", "phrase"), [("eval", "an eval"), ("arm-summary", "an arm-summary"),
                                              ("audit", "an audit"), ("checkpoint", "a checkpoint"),
                                              ("train-end", "a train-end")])
def test_a_kind_takes_the_article_its_first_letter_wants(kind: str, phrase: str) -> None:
    assert a_kind(kind) == phrase


def test_id_is_receipt_digest_of_body() -> None:
    r = full_receipt()
    assert r.id == digests.receipt_id(r.body)
    assert digests.is_digest(r.id)


def test_make_receipt_sorts_and_dedups_parents() -> None:
    a = make_receipt("note", parents=[D3, D1, D3, D2, D1])
    assert a.parents == tuple(sorted({D1, D2, D3}))
    b = make_receipt("note", parents=[D1, D2, D3])
    assert a == b and a.id == b.id


def test_make_receipt_accepts_receipt_objects_as_parents() -> None:
    p1 = make_receipt("note", measurements={"i": 1})
    p2 = make_receipt("note", measurements={"i": 2})
    child = make_receipt("note", parents=[p2, p1.id, p1])
    assert child.parents == tuple(sorted({p1.id, p2.id}))


def test_from_bytes_round_trip() -> None:
    r = full_receipt()
    back = Receipt.from_bytes(r.body)
    assert back == r
    assert back.body == r.body and back.id == r.id
    assert back.to_document() == r.to_document()
    assert dict(back.artifacts) == {"state": D2, "model": D3}
    assert back.measurements["loss"] == 0.25


def test_from_bytes_without_keeping_the_body_encodes_the_same_bytes_when_asked() -> None:
    """keep_body=False (the verifier, which holds many receipts): the same receipt, its body encoded again on demand
    to exactly the parsed bytes, which the receipt does not hold until then."""
    r = full_receipt()
    data = bytes(r.body)
    back = Receipt.from_bytes(data, keep_body=False)
    assert "body" not in back.__dict__
    assert back == r and back.to_document() == r.to_document()
    assert back.body == data and back.body is not data and back.id == r.id


def test_equality_and_hash_follow_the_body() -> None:
    a = make_receipt("note", run="r", measurements={"x": 1})
    b = make_receipt("note", run="r", measurements={"x": 1})
    c = make_receipt("note", run="r", measurements={"x": 1.0})
    assert a == b and hash(a) == hash(b)
    assert a != c and a.id != c.id
    assert len({a, b, c}) == 2


def test_every_kind_constructs() -> None:
    ids = {make_receipt(kind).id for kind in KINDS}
    assert len(ids) == len(KINDS)


def test_unencodable_measurement_fails_at_the_writer() -> None:
    with pytest.raises(NonCanonical):
        make_receipt("note", measurements={"loss": float("nan")})
    with pytest.raises(NonCanonical):
        make_receipt("note", measurements={"big": 2**64})


def _body(doc: dict[str, Any]) -> bytes:
    return digests.canonical_bytes(doc)


def _mutated(**changes: Any) -> dict[str, Any]:
    doc = valid_document()
    for key, value in changes.items():
        if value is _DELETE:
            del doc[key]
        else:
            doc[key] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": _DELETE}, "fields"),
        ({"measurements": _DELETE}, "fields"),
        ({"extra": 1}, "fields"),
        ({"v": 2}, "v:"),
        ({"v": True}, "v:"),
        ({"v": "1"}, "v:"),
        ({"alg": "sha256"}, "alg:"),
        ({"kind": "training"}, "kind:"),
        ({"kind": None}, "kind:"),
        ({"run": ""}, "run:"),
        ({"run": "a b"}, "run:"),
        ({"run": "run\n"}, "run:"),
        ({"run": 5}, "run:"),
        ({"rank": -1}, "rank:"),
        ({"rank": True}, "rank:"),
        ({"rank": 1.0}, "rank:"),
        ({"step": 1.5}, "step:"),
        ({"step": "10"}, "step:"),
        ({"step": -3}, "step:"),
        ({"prepared": "blake3:abc"}, "prepared:"),
        ({"prepared": D1 + "\n"}, "prepared:"),
        ({"selection": D1.upper()}, "selection:"),
        ({"parents": D1}, "parents:"),
        ({"parents": ["blake3:" + "0" * 63]}, "parents:"),
        ({"parents": sorted([D1, D2], reverse=True)}, "parents:"),
        ({"parents": [D1, D1]}, "parents:"),
        ({"parents": [*sorted([D1, D2, D3])[1:], min(D1, D2, D3)]}, "parents:"),
        ({"parents": [*sorted([D1, D2]), max(D1, D2)]}, "parents:"),
        ({"prepared": 7}, "prepared:"),
        ({"rank": -(2**62)}, "rank:"),
        ({"artifacts": [D1]}, "artifacts:"),
        ({"artifacts": {"model": "blake3:zz"}}, "artifacts.model:"),
        ({"artifacts": {"bad name": D1}}, "artifacts:"),
        ({"artifacts": {"": D1}}, "artifacts:"),
        ({"measurements": [1, 2]}, "measurements:"),
    ],
)
def test_malformed_shapes_rejected_naming_the_field(changes: dict[str, Any], field: str) -> None:
    doc = _mutated(**changes)
    with pytest.raises(MalformedReceipt) as info:
        Receipt.from_bytes(_body(doc))
    assert f"malformed receipt: {field}" in str(info.value)
    assert info.value.exit_code == 2
    with pytest.raises(MalformedReceipt):
        Receipt.from_document(doc)


def test_a_verdict_does_not_depend_on_what_was_validated_before() -> None:
    """The memo of well-formed strings is per pattern: a run or artifact name seen first (and remembered) is still
    not a digest where a digest is required."""
    for name in ("abc", "run-7", "blake3:not-hex"):
        Receipt.from_bytes(_body(_mutated(run=name, artifacts={name: D1})))  # well-formed as names
        for field in ("prepared", "selection"):
            with pytest.raises(MalformedReceipt, match=f"malformed receipt: {field}: expected null or blake3"):
                Receipt.from_bytes(_body(_mutated(**{field: name})))


def test_missing_and_extra_fields_are_listed() -> None:
    with pytest.raises(MalformedReceipt, match=r"missing \['step'\], unexpected \['steps'\]"):
        Receipt.from_document({**{k: v for k, v in valid_document().items() if k != "step"}, "steps": 1})


def test_non_object_bodies_rejected() -> None:
    for body in (b"[]", b"1", b'"receipt"', b"null"):
        with pytest.raises(MalformedReceipt, match="not a JSON object"):
            Receipt.from_bytes(body)


def test_constructor_validates_too() -> None:
    with pytest.raises(MalformedReceipt, match="kind"):
        make_receipt("bogus")
    with pytest.raises(MalformedReceipt, match="rank"):
        make_receipt("note", rank=-1)
    with pytest.raises(MalformedReceipt, match="step"):
        make_receipt("note", step=2.0)  # type: ignore[arg-type]
    with pytest.raises(MalformedReceipt, match="parents"):
        Receipt(kind="note", parents=(D2, D1))


def test_from_bytes_rejects_non_canonical_receipt_bytes() -> None:
    body = full_receipt().body
    with pytest.raises(NonCanonical):
        Receipt.from_bytes(body.replace(b'"kind":', b'"kind": '))
    with pytest.raises(NonCanonical):
        Receipt.from_bytes(body + b"\n")


def test_parse_receipt_tolerates_exactly_one_trailing_newline() -> None:
    r = full_receipt()
    assert parse_receipt(r.body) == r
    assert parse_receipt(r.body + b"\n") == r
    for bad in (r.body + b"\n\n", r.body + b"\r\n", r.body + b" \n", b"\n" + r.body):
        with pytest.raises(NonCanonical):
            parse_receipt(bad)


@pytest.mark.parametrize("receipt", [
    full_receipt(),
    make_receipt("note"),
    make_receipt("eval", run="eval/x", measurements={"nested": {"a": [1, 2.5, None, {"b": "c"}]}, "flag": True}),
], ids=["full", "bare", "nested"])
def test_parsing_builds_what_the_validating_constructor_builds(receipt: Receipt) -> None:
    """from_bytes validates once and builds the receipt without __post_init__: the same fields, of the same types,
    whose canonical bytes are the parsed ones."""
    parsed = Receipt.from_bytes(receipt.body)
    names = ("kind", "run", "rank", "step", "prepared", "selection", "parents", "artifacts", "measurements")
    built = Receipt(**{name: getattr(parsed, name) for name in names})
    for name in names:
        assert getattr(parsed, name) == getattr(built, name) == getattr(receipt, name), name
        assert type(getattr(parsed, name)) is type(getattr(built, name)), name
    assert parsed.to_document() == digests.parse_canonical(receipt.body)
    assert digests.canonical_bytes(parsed.to_document()) == receipt.body == parsed.body
    assert set(vars(parsed)) <= {*names, "body", "id"}  # the parsed dict's constants (v, alg) are not attributes
    assert parsed.id == receipt.id and Receipt.from_document(parsed.to_document()) == receipt
    assert type(Receipt.from_document({**parsed.to_document(), "kind": Kind(receipt.kind)}).kind) is str
