"""An independent verifier written only from docs/receipts.md, compared with the library.

The section "Independent implementation" below imports nothing from ``ledger`` or ``verify``: it encodes canonical
JSON (floats by the algorithm of the spec's section 1.5, with exact rational arithmetic, never ``repr``), derives
digests with the ``blake3`` package, computes receipt ids and the prepared/selection digests, checks receipt
shapes and a subset of the chain rules, and reads a ledger straight from SQLite with ``sqlite3``. The tests then
compare it with the library on hypothesis-generated values and receipts, on the float vectors and edge cases of
the spec, and on a ledger the library wrote. Agreement shows the page is enough to write a verifier.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import struct
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# ======================================================================= Independent implementation (spec only)

CONTEXT = "content-addressed-training-ledger 2026-11 v1 "  # spec section 2.2
RECEIPT_KEYS = ("alg", "artifacts", "kind", "measurements", "parents", "prepared", "rank", "run", "selection",
                "step", "v")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,199}")
DIGEST = re.compile(r"blake3:[0-9a-f]{64}")
SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


class Rejected(Exception):
    """The independent implementation refuses a value or a byte string."""


def spec_float(x: float) -> str:
    """Section 1.5: shortest round-trip digits (closest, ties to even), then positional or scientific notation."""
    if math.isnan(x) or math.isinf(x):
        raise Rejected("not finite")
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    a = abs(x)
    v = Fraction(a)  # exact
    e10 = len(str(v.numerator)) - len(str(v.denominator))  # estimate, then fix: 10^E <= V < 10^(E+1)
    while Fraction(10) ** e10 > v:
        e10 -= 1
    while Fraction(10) ** (e10 + 1) <= v:
        e10 += 1
    for p in range(1, 18):
        unit = Fraction(10) ** (e10 - p + 1)
        lo = (v.numerator * unit.denominator) // (v.denominator * unit.numerator)
        candidates = [lo] if lo * unit == v else [lo, lo + 1]
        # A correctly rounded decimal -> binary64 conversion (Python's float() of a decimal string is one).
        trips = [n for n in candidates if float(f"{n}e{e10 - p + 1}") == a]
        if trips:
            break
    else:  # pragma: no cover - 17 digits always round-trip
        raise AssertionError(x)
    if len(trips) == 2:
        d0, d1 = abs(trips[0] * unit - v), abs(trips[1] * unit - v)
        n = trips[0] if d0 < d1 else trips[1] if d1 < d0 else next(t for t in trips if t % 2 == 0)
    else:
        n = trips[0]
    s = str(n)
    exp = (e10 - p + 1) + len(s) - 1
    digits = s.rstrip("0") or "0"
    if -4 <= exp < 16:
        if exp >= 0:
            body = digits[: exp + 1].ljust(exp + 1, "0") + "." + (digits[exp + 1 :] or "0")
        else:
            body = "0." + "0" * (-exp - 1) + digits
    else:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        body = f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return sign + body


def spec_string(text: str) -> str:
    """Section 1.3."""
    out = ['"']
    for ch in text:
        cp = ord(ch)
        if 0xD800 <= cp <= 0xDFFF:
            raise Rejected("lone surrogate")
        if cp in SHORT_ESCAPES:
            out.append(SHORT_ESCAPES[cp])
        elif cp < 0x20:
            out.append(f"\\u{cp:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def spec_encode(value: Any) -> bytes:
    """Canonical JSON v1 bytes (sections 1.1-1.5)."""

    def enc(v: Any) -> str:
        if v is None:
            return "null"
        if v is True:
            return "true"
        if v is False:
            return "false"
        if isinstance(v, int):
            if not -(2**63) <= v <= 2**63 - 1:
                raise Rejected("integer out of range")
            return str(v)
        if isinstance(v, float):
            return spec_float(v)
        if isinstance(v, str):
            return spec_string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(enc(item) for item in v) + "]"
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise Rejected("non-string key")
            members = sorted((k.encode("utf-8", "surrogatepass"), spec_string(k), enc(item)) for k, item in v.items())
            return "{" + ",".join(f"{key}:{item}" for _, key, item in members) + "}"  # sorted by UTF-8 bytes
        raise Rejected(f"no canonical form for {type(v).__name__}")

    return enc(value).encode("utf-8")


def spec_decode(data: bytes) -> Any:
    """Section 1.6: strict decode, re-encode, compare. Raises Rejected for anything non-canonical."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in items}) != len(items):
            raise Rejected("duplicate key")
        return dict(items)

    def constant(token: str) -> Any:
        raise Rejected(token)

    try:
        text = data.decode("utf-8")
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Rejected(str(exc)) from exc
    if spec_encode(value) != data:
        raise Rejected("not canonical")
    return value


def spec_digest(domain: str, data: bytes) -> str:
    """Section 2.2: BLAKE3 derive_key with the domain's context string."""
    return "blake3:" + blake3.blake3(data, derive_key_context=CONTEXT + domain).hexdigest()


def spec_raw(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def spec_receipt_id(body: bytes) -> str:
    return spec_digest("receipt", body)


def spec_check_receipt(body: bytes) -> dict[str, Any]:
    """Sections 1.6 and 3.1-3.2: the body is canonical and has the receipt shape; returns the document."""
    doc = spec_decode(body)
    if not isinstance(doc, dict) or tuple(sorted(doc)) != RECEIPT_KEYS:
        raise Rejected("fields")
    if type(doc["v"]) is not int or doc["v"] != 1 or doc["alg"] != "blake3" or not isinstance(doc["kind"], str):
        raise Rejected("v/alg/kind")
    if doc["run"] is not None and not (isinstance(doc["run"], str) and NAME.fullmatch(doc["run"])):
        raise Rejected("run")
    for key in ("rank", "step"):
        if doc[key] is not None and not (type(doc[key]) is int and doc[key] >= 0):
            raise Rejected(key)
    for key in ("prepared", "selection"):
        if doc[key] is not None and not (isinstance(doc[key], str) and DIGEST.fullmatch(doc[key])):
            raise Rejected(key)
    parents = doc["parents"]
    if not isinstance(parents, list) or not all(isinstance(p, str) and DIGEST.fullmatch(p) for p in parents):
        raise Rejected("parents")
    if parents != sorted(set(parents)):
        raise Rejected("parents order")
    arts = doc["artifacts"]
    if not isinstance(arts, dict) or not all(NAME.fullmatch(k) and isinstance(d, str) and DIGEST.fullmatch(d)
                                             for k, d in arts.items()):
        raise Rejected("artifacts")
    if not isinstance(doc["measurements"], dict):
        raise Rejected("measurements")
    return doc


def spec_verify_ledger(db: Path) -> int:
    """Integrity and the general chain rules of a whole SQLite ledger, from sections 4.1, 4.2 and 5.1."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT id, body FROM receipts ORDER BY seq").fetchall()
    finally:
        conn.close()
    docs: dict[str, dict[str, Any]] = {}
    for rid, body in rows:
        if spec_receipt_id(bytes(body)) != rid:
            raise Rejected(f"{rid}: id does not recompute")
        docs[rid] = spec_check_receipt(bytes(body))
    for rid, doc in docs.items():
        for p in doc["parents"]:
            if p not in docs:
                raise Rejected(f"{rid}: parent {p} missing")
            if doc["kind"] != "prepare" and docs[p]["prepared"] != doc["prepared"]:
                raise Rejected(f"{rid}: parent {p} has another prepared digest")
            if None not in (docs[p]["selection"], doc["selection"]) and docs[p]["selection"] != doc["selection"]:
                raise Rejected(f"{rid}: parent {p} has another selection digest")
        if doc["kind"] == "prepare" and doc["prepared"] != spec_digest("prepared", spec_encode(doc["artifacts"])):
            raise Rejected(f"{rid}: prepared digest")
        if doc["kind"] == "selection" and doc["selection"] != spec_digest("selection", spec_encode(doc["artifacts"])):
            raise Rejected(f"{rid}: selection digest")
        spec_kind_rule(rid, doc, [docs[p] for p in doc["parents"]])
    return len(docs)


STATE_KINDS = ("train-start", "checkpoint", "restore")
MODEL_KINDS = ("prepare", "checkpoint", "train-end")
IDENTICAL_REPLICA_ARMS = ("single", "ddp-four")  # section 4.2, arm-summary


def spec_kind_rule(rid: str, doc: dict[str, Any], parents: list[dict[str, Any]]) -> None:
    """Section 4.2, kind by kind, as the page states each rule."""
    kind, m = doc["kind"], doc["measurements"]

    def needs(*fields: str) -> None:
        if any(doc[f] is None for f in fields):
            raise Rejected(f"{rid}: {kind} needs {fields}")

    def one(kinds: tuple[str, ...]) -> dict[str, Any]:
        found = [p for p in parents if p["kind"] in kinds]
        if len(found) != 1:
            raise Rejected(f"{rid}: {kind} cites {len(found)} of {kinds}")
        return found[0]

    def previous_state(strict_after_checkpoint: bool) -> None:
        prev = one(STATE_KINDS)
        if prev["rank"] != doc["rank"] or prev["run"] != doc["run"]:
            raise Rejected(f"{rid}: previous state of another rank or run")
        strict = strict_after_checkpoint and prev["kind"] == "checkpoint"
        if not (doc["step"] > prev["step"] if strict else doc["step"] >= prev["step"]):
            raise Rejected(f"{rid}: steps must increase")

    def model_source() -> None:
        src = one(MODEL_KINDS)
        if "model" not in doc["artifacts"] or src["artifacts"].get("model") != doc["artifacts"]["model"]:
            raise Rejected(f"{rid}: model differs from its source")

    if kind == "prepare":
        if doc["rank"] is not None or doc["step"] is not None or doc["selection"] is not None or parents:
            raise Rejected(f"{rid}: prepare fields")
    elif kind == "selection":
        needs("prepared", "selection")
        one(("prepare",))
    elif kind in ("contract", "train-start"):
        needs("prepared", *(("run", "rank", "step") if kind == "train-start" else ()))
        one(("prepare",))
    elif kind == "checkpoint":
        needs("prepared", "run", "rank", "step")
        previous_state(True)
        if "state" not in doc["artifacts"]:
            raise Rejected(f"{rid}: checkpoint without state")
    elif kind == "train-end":
        needs("prepared", "run", "rank", "step")
        previous_state(False)
    elif kind == "restore":
        needs("prepared", "run", "rank", "step")
        ck = one(("checkpoint",))
        if (ck["step"], ck["rank"], ck["run"]) != (doc["step"], doc["rank"], doc["run"]):
            raise Rejected(f"{rid}: restore of another step, rank or run")
        for name in ("state", "config"):
            if name in doc["artifacts"] and doc["artifacts"][name] != ck["artifacts"].get(name):
                raise Rejected(f"{rid}: restored {name} of another lineage")
    elif kind == "eval":
        needs("prepared", "selection")
        one(("selection",))
        model_source()
    elif kind == "quality":
        needs("prepared")
        one(("contract",))
        if sorted({p["kind"] for p in parents} - {"contract"}) != ["comparison"]:
            raise Rejected(f"{rid}: quality cites other kinds")
    elif kind == "replica":
        needs("prepared")
        model_source()
    elif kind == "arm-summary":
        ends = [p for p in parents if p["kind"] == "train-end" and p["run"] == doc["run"]]
        if not ends:
            raise Rejected(f"{rid}: arm summary without train-ends")
        if m.get("arm") in IDENTICAL_REPLICA_ARMS and len({e["artifacts"].get("model") for e in ends}) != 1:
            raise Rejected(f"{rid}: ranks of {m.get('arm')} ended with different models")
        first = min(ends, key=lambda e: e["rank"] or 0)
        if "model" in doc["artifacts"] and doc["artifacts"]["model"] != first["artifacts"].get("model"):
            raise Rejected(f"{rid}: summary model is not its lowest rank's")
    elif kind == "comparison" and m.get("format") == "ledger-recovery-rank/1":
        for name in ("uninterrupted_receipt", "recovered_receipt"):
            cited = [p for p in parents if spec_receipt_id(spec_encode(p)) == m.get(name)]
            if len(cited) != 1 or cited[0]["kind"] != "train-end" or cited[0]["rank"] != m.get("rank"):
                raise Rejected(f"{rid}: {name} is not a cited train-end of its rank")
    elif kind == "comparison" and m.get("format") == "ledger-recovery/1":
        faults = [p for p in parents if p["kind"] == "fault"]
        ranks = [p for p in parents if p["kind"] == "comparison"
                 and p["measurements"].get("format") == "ledger-recovery-rank/1"]
        if len(faults) != 1 or not ranks:
            raise Rejected(f"{rid}: recovery summary parents")
        f = faults[0]["measurements"]
        passed = all(all(p["measurements"][k] for k in ("contents_exactly_equal", "file_hashes_equal",
                                                          "binding_equal", "trajectory_equal")) for p in ranks)
        claims = {"killed_rank": f.get("killed_rank"), "last_observed_step_before_kill": f.get("last_observed_step"),
                  "restore_step": f.get("restore_step"), "failed_group_seconds": f.get("failed_group_seconds"),
                  "all_rank_state_and_trajectory_comparisons_passed": passed}
        if any(m.get(k) != v for k, v in claims.items()):
            raise Rejected(f"{rid}: recovery summary differs from its parents")
    elif kind == "audit":
        needs("prepared")
        one(("contract",))
    elif kind == "settlement":
        needs("prepared")
        audit = one(("audit",))
        if any(m.get(k) != audit["measurements"].get(k) for k in ("contracts", "tokens_issued")):
            raise Rejected(f"{rid}: settlement differs from its audit")
    elif kind == "serve-phase":
        needs("prepared")
        named = sorted(str(e) for e in m.get("endpoints", []))
        if (any(p["kind"] != "replica" for p in parents) or not parents
                or sorted(str(p["measurements"].get("endpoint")) for p in parents) != named):
            raise Rejected(f"{rid}: serve-phase must cite exactly the replicas of its endpoints")
        if not {"request_log", "request_set"} <= set(doc["artifacts"]):
            raise Rejected(f"{rid}: serve-phase without its request log or request set")
    elif kind == "serve-summary":
        needs("prepared")
        one(("contract",))
        if sorted(str(p["measurements"].get("phase")) for p in parents if p["kind"] == "serve-phase") != [
                "failure", "four", "single"]:
            raise Rejected(f"{rid}: serve-summary must cite one serve-phase per phase")
    elif kind == "report":
        needs("prepared")
        audit = one(("audit",))
        if spec_receipt_id(spec_encode(audit)) not in one(("settlement",))["parents"]:
            raise Rejected(f"{rid}: report's settlement is not its audit's")
        if "html" not in doc["artifacts"]:
            raise Rejected(f"{rid}: report without its page")


# ====================================================================================== comparison with ledger

from ledger import digests  # noqa: E402  (the library, only for comparison from here on)
from ledger.digests import prepared_digest, selection_digest  # noqa: E402
from ledger.errors import LedgerError  # noqa: E402
from ledger.receipts import KINDS, make_receipt, parse_receipt  # noqa: E402
from ledger.store import Store  # noqa: E402
from tests.conftest import build_chain  # noqa: E402


def library_outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except LedgerError:
        return "rejected", None


def spec_outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Rejected:
        return "rejected", None


SPECIAL_FLOATS = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e16, 1e15,
                  9999999999999998.0, 1e-4, 1e-5, 0.1, 0.3, 1 / 3, 2.0**53, 2.0**50 + 0.25, 2.0**50 + 0.75,
                  2.0**-1017, 2.0**-1007, 123456789012345680.0, 1e22, 1e23]
POWERS_OF_TWO = [2.0**e for e in range(-1074, 1024, 7)]


def test_floats_match_on_edges_and_powers_of_two() -> None:
    for x in SPECIAL_FLOATS + POWERS_OF_TWO + [math.nextafter(p, 0.0) for p in POWERS_OF_TWO]:
        assert spec_encode(x) == digests.canonical_bytes(x), x.hex()


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_match(x: float) -> None:
    assert spec_encode(x) == digests.canonical_bytes(x)


@given(st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_floats_from_random_bits_match(bits: int) -> None:
    x = struct.unpack("<d", struct.pack("<Q", bits))[0]
    assert spec_outcome(lambda: spec_encode(x)) == library_outcome(lambda: digests.canonical_bytes(x))


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)  # includes out-of-range integers: both must reject
    | st.floats()  # includes NaN and infinities: both must reject
    | st.text(alphabet=st.characters(exclude_categories=()), max_size=12)  # includes lone surrogates
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=25,
)
# Values that have a canonical form, weighted to the interesting ones (escapes, non-ASCII, floats, -0.0).
valid_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(max_codepoint=0x7F) | st.characters(), max_size=12)
)
valid_values = st.recursive(
    valid_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_values_encode_and_digest_alike(value: Any) -> None:
    ours = spec_outcome(lambda: spec_encode(value))
    theirs = library_outcome(lambda: digests.canonical_bytes(value))
    assert ours == theirs
    if ours[0] == "ok":
        body = ours[1]
        assert spec_digest("json", body) == digests.digest_json("json", value)
        assert spec_receipt_id(body) == digests.receipt_id(body)
        assert spec_encode(spec_decode(body)) == body
        assert digests.canonical_bytes(digests.parse_canonical(body)) == body


def _mutations(body: bytes) -> list[bytes]:
    """Small edits of canonical bytes, mostly non-canonical: spaces, a newline, swapped case, reformatted numbers."""
    out = [b" " + body, body + b"\n", body.replace(b",", b", ", 1), body.replace(b":", b": ", 1), body.upper(),
           body.replace(b"e+", b"e", 1), body.replace(b"e-0", b"e-", 1), body.replace(b".0", b".00", 1),
           body.replace(b"\\u00", b"\\u00".upper(), 1), body.replace(b"0.", b"-0.", 1)]
    return [m for m in out if m != body]


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_parsing_accepts_and_rejects_alike(value: Any) -> None:
    ok, body = spec_outcome(lambda: spec_encode(value))
    if ok != "ok":
        return
    for candidate in [body, *_mutations(body)]:
        ours = spec_outcome(lambda: spec_encode(spec_decode(candidate)))  # noqa: B023
        theirs = library_outcome(lambda: digests.canonical_bytes(digests.parse_canonical(candidate)))  # noqa: B023
        assert ours == theirs, candidate


NONCANONICAL = [b'{"a": 1}', b'{"b":1,"a":2}', b'{"a":1,"a":2}', b"[1e5]", b"[1.10]", b"[NaN]", b"[Infinity]",
                b"[-0]", b"[1e400]", b"[9223372036854775808]", b'"\\u00e9"', b'"\\u001F"', b'"\\/"',
                b'"\\ud800"', b'"\\ud83d\\ude00"', b'"\xff"', b"\xef\xbb\xbf{}", b"1" * 5000, b"[" * 2000]


def test_noncanonical_inputs_rejected_by_both() -> None:
    for data in NONCANONICAL:
        assert spec_outcome(lambda: spec_decode(data))[0] == "rejected", data  # noqa: B023
        assert library_outcome(lambda: digests.parse_canonical(data))[0] == "rejected", data  # noqa: B023


digests_st = st.binary(min_size=1, max_size=8).map(spec_raw)
names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,12}\Z")


@st.composite
def receipt_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "kind": draw(st.sampled_from(sorted(KINDS))),
        "run": draw(st.none() | names),
        "rank": draw(st.none() | st.integers(0, 2**63 - 1)),
        "step": draw(st.none() | st.integers(0, 2**63 - 1)),
        "prepared": draw(st.none() | digests_st),
        "selection": draw(st.none() | digests_st),
        "parents": draw(st.lists(digests_st, max_size=4)),
        "artifacts": draw(st.dictionaries(names, digests_st, max_size=4)),
        "measurements": draw(st.dictionaries(st.text(max_size=8), valid_values, max_size=4)),
    }


@settings(max_examples=200, deadline=None)
@given(receipt_fields())
def test_receipts_alike(fields: dict[str, Any]) -> None:
    receipt = make_receipt(**fields)
    doc = {**fields, "v": 1, "alg": "blake3", "parents": sorted(set(fields["parents"]))}
    body = spec_encode(doc)
    assert body == receipt.body
    assert spec_receipt_id(body) == receipt.id
    assert spec_check_receipt(body) == receipt.to_document()
    assert spec_digest("prepared", spec_encode(fields["artifacts"])) == prepared_digest(fields["artifacts"])
    assert spec_digest("selection", spec_encode(fields["artifacts"])) == selection_digest(fields["artifacts"])


def test_malformed_receipts_rejected_by_both() -> None:
    good = make_receipt("note", parents=[spec_raw(b"a"), spec_raw(b"b")]).body
    first, second = sorted([spec_raw(b"a"), spec_raw(b"b")])
    bad = [good.replace(b'"v":1', b'"v":1.0'), good.replace(b'"v":1', b'"v":true'),
           good.replace(b'"alg":"blake3"', b'"alg":"BLAKE3"'), good.replace(b'"run":null', b'"run":"a b"'),
           good.replace(b'"rank":null', b'"rank":-1'), good.replace(b'"step":null', b'"step":1.0'),
           good.replace(b'"prepared":null', b'"prepared":"blake3:00"'), good.replace(b'"kind":"note"', b'"kind":[]'),
           good.replace(first.encode() + b'","' + second.encode(), second.encode() + b'","' + first.encode()),
           good.replace(b'"artifacts":{}', b'"artifacts":{" x":"' + first.encode() + b'"}'),
           good.replace(b'"measurements":{}', b'"measurements":null')]
    for body in bad:
        assert body != good
        assert spec_outcome(lambda: spec_check_receipt(body))[0] == "rejected", body  # noqa: B023
        assert library_outcome(lambda: parse_receipt(body))[0] == "rejected", body  # noqa: B023
    assert spec_check_receipt(good) == parse_receipt(good).to_document()


def test_a_ledger_the_library_wrote(tmp_path: Path) -> None:
    """Read the SQLite file with sqlite3 only; every id, shape, parent link and prepared digest checks out."""
    db = tmp_path / "ledger.db"
    chains = [build_chain(run=f"run-{i}", rank=i, salt=str(i % 2)) for i in range(3)]
    with Store.open(db, create=True) as store:
        for c in chains:
            store.append_many(c.receipts())
        expected = store.count()
    assert spec_verify_ledger(db) == expected > 10
    # Tampering with one byte of one body is caught by the independent verifier too.
    conn = sqlite3.connect(db)
    with conn:
        rid, body = conn.execute("SELECT id, body FROM receipts WHERE kind = 'checkpoint' AND step = 2").fetchone()
        conn.execute("UPDATE receipts SET body = ? WHERE id = ?", (bytes(body).replace(b'"step":2', b'"step":3'), rid))
    conn.close()
    with pytest.raises(Rejected, match="id does not recompute"):
        spec_verify_ledger(db)


def test_the_per_kind_rules_agree_with_the_library_on_forgeries(tmp_path: Path) -> None:
    """Each section 4.2 rule added for tamper cases: the independent verifier and the library's chain rules reject
    the same forged receipts (a settlement that pays more than its audit, a restore into another run)."""
    from ledger import chain
    from ledger.errors import ChainBroken

    c = build_chain()
    contract = c.contract
    audit = make_receipt("audit", run="audit", prepared=c.prepared, parents=[contract],
                         measurements={"format": "ledger-audit/1", "contracts": {"quality": False}, "tokens_issued": 0})
    honest = make_receipt("settlement", run="audit", prepared=c.prepared, parents=[audit],
                          measurements={"format": "ledger-settlement/1", "contracts": {"quality": False},
                                        "tokens_issued": 0, "rule": "r"})
    forged = make_receipt("settlement", run="audit", prepared=c.prepared, parents=[audit],
                          measurements={**honest.measurements, "tokens_issued": 9})
    restore = make_receipt("restore", run="other-run", rank=c.checkpoints[0].rank, step=c.checkpoints[0].step,
                           prepared=c.prepared, parents=[c.checkpoints[0]])
    table = {r.id: r for r in [*c.receipts(), audit]}
    spec_kind_rule(honest.id, honest.to_document(), [audit.to_document()])
    chain.check_receipt(honest, table)
    for bad, parent in ((forged, audit), (restore, c.checkpoints[0])):
        with pytest.raises(Rejected):
            spec_kind_rule(bad.id, bad.to_document(), [parent.to_document()])
        with pytest.raises(ChainBroken):
            chain.check_receipt(bad, table)


@pytest.mark.slow
def test_a_whole_experiment_passes_the_independent_verifier(tiny_experiment: Any) -> None:
    """The session's tiny experiment (every kind the main job writes) read with sqlite3 only."""
    count = spec_verify_ledger(tiny_experiment.db)
    with Store.open(tiny_experiment.db) as store:
        assert count == store.count() > 80
        kinds = {s.receipt.kind for s in store.find()}
    assert kinds >= {"prepare", "selection", "contract", "train-start", "checkpoint", "train-end", "arm-summary",
                     "fault", "restore", "comparison", "eval", "quality", "replica", "serve-phase", "serve-summary",
                     "audit", "settlement", "report", "key"}
