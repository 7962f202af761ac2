"""Canonical JSON and digests (ledger/digests.py): exact encoding rules, strict parsing, domain separation."""

from __future__ import annotations

import ast
import math
import re
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import blake3
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import digests
from ledger.errors import MalformedDigest, NonCanonical

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
CONTEXT = "content-addressed-training-ledger 2026-11 v1 "


def enc(value: Any) -> bytes:
    return digests.canonical_bytes(value)


def typed(value: Any) -> Any:
    """A comparison key that tells bool/int/float apart and compares floats by repr (so -0.0 != 0.0)."""
    if value is None or isinstance(value, (bool, str)):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, list):
        return ("list", [typed(v) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((k, typed(v)) for k, v in value.items()))
    raise TypeError(type(value))


# ----------------------------------------------------------------------------------------- encoding rules


def test_keys_sorted_by_code_point_including_non_ascii() -> None:
    # U+FFFF sorts before U+1F600 by code point (and by UTF-8 bytes), but after it in UTF-16 order.
    value = {"b": 1, "\U0001f600": 2, "a": 3, "\uffff": 4, "é": 5, "Z": 6, "": 7}
    expected = ('{"":7,"Z":6,"a":3,"b":1,"é":5,"\uffff":4,"\U0001f600":2}').encode()
    assert enc(value) == expected
    assert digests.parse_canonical(expected) == value


def test_no_whitespace_and_nested_containers() -> None:
    assert enc({"a": [1, {"c": None, "b": True}], "z": []}) == b'{"a":[1,{"b":true,"c":null}],"z":[]}'
    assert enc({}) == b"{}"
    assert enc([]) == b"[]"
    assert enc((1, 2)) == b"[1,2]"


def test_string_escapes() -> None:
    text = '"\\\b\f\n\r\t\x00\x1f\x7f/é\u2028\U0001f600'
    expected = b'"\\"\\\\\\b\\f\\n\\r\\t\\u0000\\u001f\x7f/\xc3\xa9\xe2\x80\xa8\xf0\x9f\x98\x80"'
    assert enc(text) == expected
    assert digests.parse_canonical(expected) == text


def test_integers_within_int64_only() -> None:
    assert enc(INT64_MAX) == b"9223372036854775807"
    assert enc(INT64_MIN) == b"-9223372036854775808"
    assert enc(0) == b"0"
    for bad in (INT64_MAX + 1, INT64_MIN - 1, 10**30):
        with pytest.raises(NonCanonical, match="64-bit"):
            enc(bad)
        with pytest.raises(NonCanonical):
            enc({"nested": [bad]})
    with pytest.raises(NonCanonical):
        digests.parse_canonical(b"9223372036854775808")


def test_bool_is_not_int() -> None:
    assert enc(True) == b"true"
    assert enc(False) == b"false"
    assert enc(1) == b"1"
    assert digests.digest_json("json", {"a": True}) != digests.digest_json("json", {"a": 1})
    parsed = digests.parse_canonical(b"[true,1,false,0]")
    assert [type(v) for v in parsed] == [bool, int, bool, int]


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.0, b"1.0"), (0.1, b"0.1"), (-0.0, b"-0.0"), (1e100, b"1e+100"), (1e-07, b"1e-07"),
     (123456789.125, b"123456789.125"), (5e-324, b"5e-324"), (1.7976931348623157e308, b"1.7976931348623157e+308")],
)
def test_floats_written_as_repr(value: float, text: bytes) -> None:
    assert enc(value) == text
    back = digests.parse_canonical(text)
    assert isinstance(back, float) and repr(back) == repr(value)


def test_float_distinguished_from_int() -> None:
    assert enc(1.0) != enc(1)
    assert isinstance(digests.parse_canonical(b"1"), int)
    assert isinstance(digests.parse_canonical(b"1.0"), float)
    assert digests.digest_json("json", [1.0]) != digests.digest_json("json", [1])
    assert digests.digest_json("json", 0.0) != digests.digest_json("json", -0.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_rejected(bad: float) -> None:
    with pytest.raises(NonCanonical, match="finite"):
        enc(bad)
    with pytest.raises(NonCanonical):
        enc({"m": [1, bad]})


def test_lone_surrogates_rejected() -> None:
    with pytest.raises(NonCanonical, match="surrogate"):
        enc("a\ud800b")
    with pytest.raises(NonCanonical, match="surrogate"):
        enc({"\udc00": 1})
    with pytest.raises(NonCanonical):
        digests.parse_canonical(b'"\\ud800"')


@pytest.mark.parametrize("key", [1, None, 1.5, True, (1, 2)])
def test_non_string_keys_rejected(key: Any) -> None:
    # json.dumps would silently turn 1 into "1" (colliding with a real "1" key); we refuse instead.
    with pytest.raises(NonCanonical, match="not a string"):
        enc({key: "x"})


@pytest.mark.parametrize("bad", [b"bytes", {1, 2}, Decimal("1.5"), object()])
def test_other_types_rejected(bad: Any) -> None:
    with pytest.raises(NonCanonical, match="no canonical JSON form"):
        enc({"k": bad})


# ------------------------------------------------------------------------------------------ strict parsing


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": 1}', b' {"a":1}', b'{"a":1}\n', b'{"a":1} ', b"[1, 2]", b'{"a" :1}', b'\t"x"',  # whitespace
        b'{"b":1,"a":2}', b'{"\xc3\xa9":1,"z":2}',  # unsorted keys
        b'{"a":1,"a":1}', b'{"a":1,"a":2}',  # duplicate keys
        b"1.50", b"1e5", b"1E5", b"1e100", b"1.0e+100", b"0.10", b"1.", b".5", b"-0.10", b"100000.00",  # floats
        b"NaN", b"Infinity", b"-Infinity", b"[NaN]", b'{"a":Infinity}',  # non-finite tokens
        b"-0", b"01", b"+1", b"1_000",  # integers
        b'"\xff"', b'"\xc0\xaf"', b'"\xed\xa0\x80"', b"\xef\xbb\xbf{}",  # invalid UTF-8 / BOM
        b'"\\u0041"', b'"\\/"', b'"\\u00e9"', b'"\\u000A"', b'"\\u000a"', b'"\\u001F"',  # non-canonical escapes
        b'"\\ud83d\\ude00"', b'{"\\u0061":1}',
        b"", b"{", b"nul", b"True", b"'a'",  # not JSON at all
    ],
)
def test_parse_rejects_non_canonical(data: bytes) -> None:
    with pytest.raises(NonCanonical):
        digests.parse_canonical(data)


def test_parse_duplicate_key_message() -> None:
    with pytest.raises(NonCanonical, match="duplicate key 'a'"):
        digests.parse_canonical(b'{"a":1,"a":1}')


def test_parse_accepts_canonical() -> None:
    assert digests.parse_canonical(b"-0.0") == 0.0 and repr(digests.parse_canonical(b"-0.0")) == "-0.0"
    assert digests.parse_canonical(b"1e+100") == 1e100
    assert digests.parse_canonical(b"100000.0") == 1e5
    assert digests.parse_canonical(b'"\\u001f"') == "\x1f"
    assert digests.parse_canonical(b"-9223372036854775808") == INT64_MIN


# ------------------------------------------------------------------------------------- digests and domains


def test_digest_format() -> None:
    d = digests.digest_json("json", {"a": 1})
    assert digests.is_digest(d) and d.startswith("blake3:") and len(d) == len("blake3:") + 64
    assert digests.check_digest(d) == d
    assert digests.digest_hex(d) == d.removeprefix("blake3:")


@pytest.mark.parametrize(
    "bad",
    ["blake3:" + "a" * 63, "blake3:" + "a" * 65, "blake3:" + "A" * 64, "sha256:" + "a" * 64, "a" * 64,
     "blake3:" + "a" * 64 + "\n", " blake3:" + "a" * 64, "blake3:" + "g" * 64, None, 7, b"blake3:" + b"a" * 64],
)
def test_malformed_digests(bad: object) -> None:
    assert not digests.is_digest(bad)
    with pytest.raises(MalformedDigest) as info:
        digests.check_digest(bad, "parents[0]")
    assert info.value.exit_code == 2
    assert "parents[0]" in str(info.value)


def test_domains_separate_identical_bytes() -> None:
    data = b'{"a":1}'
    seen = {digests.digest_bytes(domain, data) for domain in digests.DOMAINS}
    seen.add(digests.raw_digest(data))
    assert len(seen) == len(digests.DOMAINS) + 1


def test_domain_is_blake3_derive_key_with_documented_context() -> None:
    # Pins the on-disk identity: a change to the context strings changes every id ever issued.
    body = b'{"x":[1,2.5]}'
    for domain in digests.DOMAINS:
        expected = blake3.blake3(body, derive_key_context=CONTEXT + domain).hexdigest()
        assert digests.digest_bytes(domain, body) == "blake3:" + expected


def test_receipt_id_is_not_plain_blake3_of_body() -> None:
    body = enc({"kind": "note"})
    assert digests.receipt_id(body) == digests.digest_bytes("receipt", body)
    assert digests.receipt_id(body) != "blake3:" + blake3.blake3(body).hexdigest()
    assert digests.receipt_id(body) != digests.digest_bytes("json", body)


def test_unknown_domain_rejected() -> None:
    with pytest.raises(ValueError, match="unknown digest domain"):
        digests.digest_bytes("receipts", b"")


@pytest.mark.parametrize("size", [0, 1, 1024, 1025, 3 * 1024 * 1024 + 7])
def test_raw_and_file_digest_equal_plain_blake3(tmp_path: Path, size: int) -> None:
    data = bytes((i * 31 + 7) % 251 for i in range(size))
    expected = "blake3:" + blake3.blake3(data).hexdigest()
    assert digests.raw_digest(data) == expected
    assert digests.raw_digest(data, threads=False) == expected
    assert digests.raw_digest(memoryview(data)) == expected
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert digests.file_digest(path) == expected
    assert digests.file_digest(str(path)) == expected


@pytest.mark.skipif(shutil.which("b3sum") is None, reason="b3sum is not installed")
def test_file_digest_equals_b3sum(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"ledger\n" * 100_000)
    out = subprocess.run(["b3sum", "--no-names", str(path)], check=True, capture_output=True, text=True).stdout
    assert digests.file_digest(path) == "blake3:" + out.strip()


# ---------------------------------------------------------------------------------------- property tests

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=INT64_MIN, max_value=INT64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_roundtrip_is_byte_exact(value: Any) -> None:
    data = enc(value)
    parsed = digests.parse_canonical(data)
    assert typed(parsed) == typed(value)
    assert enc(parsed) == data


@settings(max_examples=200, deadline=None)
@given(json_values, st.data())
def test_single_byte_mutation_never_aliases(value: Any, data: st.DataObject) -> None:
    original = enc(value)
    index = data.draw(st.integers(min_value=0, max_value=len(original) - 1), label="index")
    new_byte = data.draw(st.integers(min_value=0, max_value=255).filter(lambda b: b != original[index]))
    mutated = original[:index] + bytes([new_byte]) + original[index + 1 :]
    try:
        parsed = digests.parse_canonical(mutated)
    except NonCanonical:
        return
    # It parsed: then it is a different document of a different value, with a different digest.
    assert enc(parsed) == mutated
    assert typed(parsed) != typed(value)
    assert digests.digest_json("json", parsed) != digests.digest_json("json", value)


def _leaf_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every scalar and every empty container (so each value has at least one)."""
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in _leaf_paths(v, (*path, i))]
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _leaf_paths(v, (*path, k))]
    return [path]


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [(_replace(v, rest, new) if i == head else v) for i, v in enumerate(value)]
    return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


@settings(max_examples=200, deadline=None)
@given(json_values, st.data())
def test_changing_any_leaf_changes_digest(value: Any, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(_leaf_paths(value)), label="path")
    old = _get(value, path)
    new = data.draw(leaves.filter(lambda v: typed(v) != typed(old)), label="new")
    changed = _replace(value, path, new)
    assert digests.digest_json("json", changed) != digests.digest_json("json", value)


# ------------------------------------------------------------- the fast encoder and parser against the reference
# canonical_bytes and parse_canonical take a fast path and fall back to the reference for anything it cannot vouch
# for; every test below holds both to the same bytes, the same values and the same errors.

SPEC = Path(__file__).resolve().parents[2] / "docs" / "receipts.md"


def _outcome(fn: Any, arg: Any) -> tuple[str, Any]:
    """What ``fn(arg)`` does: ("ok", typed value or bytes) or ("error", exception type and message)."""
    try:
        out = fn(arg)
    except (NonCanonical, TypeError, ValueError) as exc:
        return "error", (type(exc).__name__, str(exc))
    return "ok", out if isinstance(out, bytes) else typed(out)


def assert_encoders_agree(value: Any) -> None:
    assert _outcome(digests.canonical_bytes, value) == _outcome(digests.canonical_bytes_reference, value)


def assert_parsers_agree(data: bytes) -> None:
    assert _outcome(digests.parse_canonical, data) == _outcome(digests.parse_canonical_reference, data)


# Values the fast path must hand to the reference: out-of-range integers, NaN and infinities, lone surrogates,
# non-string keys, tuples, subclasses, other types, and depth at and beyond the limit.
class _Str(str):
    pass


class _Int(int):
    pass


class _Dict(dict[str, object]):
    pass


hostile_leaves = (
    leaves
    | st.integers()
    | st.floats()
    | st.text(alphabet=st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=3)
    | st.sampled_from([_Str("s"), _Int(3), True, b"x", Decimal("1.5"), 10**19, -(2**63), 2**63 - 1, 2**63,
                       -(2**63) - 1, float("nan"), -0.0, 1e16, 5e-324, "\udc80", "\x00\x1f\"\\"])
)
hostile_values = st.recursive(
    hostile_leaves,
    lambda children: (st.lists(children, max_size=4) | st.lists(children, max_size=3).map(tuple)
                      | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3) | st.none() | st.booleans()
                                        | st.floats(allow_nan=False, width=16), children, max_size=4)
                      | st.dictionaries(st.text(max_size=3), children, max_size=3).map(_Dict)),
    max_leaves=16,
)


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_fast_encoder_gives_the_reference_bytes(value: Any) -> None:
    assert digests.canonical_bytes(value) == digests.canonical_bytes_reference(value)


@settings(max_examples=500, deadline=None)
@given(hostile_values)
def test_fast_encoder_agrees_with_the_reference_on_anything(value: Any) -> None:
    assert_encoders_agree(value)


def _nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [255, 256, 257, 300, 1500])
def test_fast_encoder_and_parser_agree_at_the_depth_limit(depth: int) -> None:
    value = _nested(depth)
    assert_encoders_agree(value)
    text = ("[" * depth + "]" * depth).encode()
    assert_parsers_agree(text)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    assert_encoders_agree(cyclic)


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_fast_parser_gives_the_reference_values(value: Any) -> None:
    data = digests.canonical_bytes_reference(value)
    assert typed(digests.parse_canonical(data)) == typed(digests.parse_canonical_reference(data))


@settings(max_examples=500, deadline=None)
@given(json_values, st.data())
def test_fast_parser_agrees_on_mutated_bytes(value: Any, data: st.DataObject) -> None:
    original = digests.canonical_bytes_reference(value)
    index = data.draw(st.integers(min_value=0, max_value=len(original) - 1), label="index")
    new_byte = data.draw(st.integers(min_value=0, max_value=255), label="byte")
    assert_parsers_agree(original[:index] + bytes([new_byte]) + original[index + 1 :])
    cut = data.draw(st.integers(min_value=0, max_value=len(original)), label="cut")
    assert_parsers_agree(original[:cut])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet='[]{}",:0123456789.-+eE\\ntrufalsu\u00e9 ', max_size=30).map(
    lambda s: s.encode("utf-8", "surrogatepass")))
def test_fast_parser_agrees_on_arbitrary_bytes(data: bytes) -> None:
    assert_parsers_agree(data)


@pytest.mark.parametrize("data", [
    b"9223372036854775807", b"-9223372036854775808", b"9223372036854775808", b"-9223372036854775809",
    b"[1234567890123456789012]", b'{"a":-99999999999999999999}', b'"blake3:1234567890123456789012345678901234567890"',
    b'{"a:1234567890123456789012":1}', b"0.00012345678901234567", b'{"a":1,"a":1}', b'{"a":1e400}', b"[NaN]",
    b'"\\ud800"', b'"\\ud83d\\ude00"', b"\xef\xbb\xbf{}", b"-0", b"1E5", b" 1", b"[1,]", b"",
])
def test_fast_parser_agrees_on_edge_cases(data: bytes) -> None:
    assert_parsers_agree(data)


def test_orjson_writes_every_code_point_as_the_specification() -> None:
    """The parser's orjson path trusts orjson's string escapes: every code point but the surrogates, in one string
    (escaping is per character), is written as the reference writes it, and parses back on the fast path."""
    text = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF)
    data = digests.canonical_bytes_reference({"s": text, text[:300]: [text[-300:]]})
    assert orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS) == data
    assert digests._orjson_round_trip(data) == {"s": text, text[:300]: [text[-300:]]}


def _floats_of_every_exponent() -> list[float]:
    out = []
    for exponent in range(-1074, 1024):
        for mantissa in (1.0, 1.1, 1.5, 1.9999999999999998, 1.2345678901234567, 1.7976931348623157):
            value = math.ldexp(mantissa, exponent)
            if math.isfinite(value) and value != 0.0:
                out += [value, -value]
    return [*out, 0.0, -0.0, 5e-324, 1e-4, 1e-5, 9.999999999999999e-5, 1e16, 9999999999999998.0]


def test_fast_parser_agrees_on_floats_of_every_exponent() -> None:
    """Where orjson writes a float differently (below 1e-4: "0.00001", "1e-7"), its text is not canonical and must
    not pass the fast path; repr's text must parse. Both against the reference, for floats of every exponent."""
    for value in _floats_of_every_exponent():
        for text in {repr(value).encode(), orjson.dumps(value)}:
            for data in (text, b'{"x":[' + text + b"]}"):
                assert_parsers_agree(data)
        assert digests.parse_canonical(repr(value).encode()) == value


def test_a_receipt_body_takes_the_orjson_path() -> None:
    """The speed of scanning a ledger rests on this: a typical receipt is vouched for by orjson alone."""
    from ledger.receipts import make_receipt

    body = make_receipt("note", run="r", step=3, measurements={"loss": 2.5, "lr": 0.0003, "phase": "train"}).body
    assert digests._orjson_round_trip(body) == digests.parse_canonical_reference(body)


def _spec_blocks(label: str) -> list[dict[str, str]]:
    """The records of the page's ```example-<label> blocks (format: docs/receipts.md section 8)."""
    out: list[dict[str, str]] = []
    for body in re.findall(rf"^```example-{label}\n(.*?)^```$", SPEC.read_text(encoding="utf-8"), flags=re.S | re.M):
        rec: dict[str, str] = {}
        for line in [*body.split("\n"), ""]:
            if not line.strip():
                if rec:
                    out.append(rec)
                rec = {}
                continue
            key, _, value = line.partition(": ")
            rec[key] = rec.get(key, "") + value if key == "hex" else value
    return out


def test_spec_vectors_agree_on_both_paths() -> None:
    canonical = _spec_blocks("canonical")
    assert len(canonical) >= 2
    for rec in canonical:
        value = ast.literal_eval(rec["input"])
        for encode in (digests.canonical_bytes, digests.canonical_bytes_reference):
            assert encode(value).hex() == rec["hex"]
        for parse in (digests.parse_canonical, digests.parse_canonical_reference):
            assert typed(parse(bytes.fromhex(rec["hex"]))) == typed(value)
    floats = re.search(r"^```example-floats\n(.*?)^```$", SPEC.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert floats is not None
    for line in floats.group(1).split("\n"):
        if line.strip():
            hexfloat, text = line.split()
            value = float.fromhex(hexfloat)
            for encode in (digests.canonical_bytes, digests.canonical_bytes_reference):
                assert encode(value) == text.encode() and encode([value]) == f"[{text}]".encode()
            assert repr(digests.parse_canonical(text.encode())) == repr(value)
    receipts = _spec_blocks("receipt")
    assert len(receipts) >= 3
    for rec in receipts:
        body = rec["body"].encode()
        assert digests.canonical_bytes(digests.parse_canonical(body)) == body
        assert_parsers_agree(body)
    rejected = [r for r in _spec_blocks("noncanonical") if r.get("as", "json") == "json"]
    assert len(rejected) >= 10
    for rec in rejected:
        data = bytes.fromhex(rec["hex"]) if "hex" in rec else rec["bytes"].encode("utf-8")
        for parse in (digests.parse_canonical, digests.parse_canonical_reference):
            with pytest.raises(NonCanonical) as info:
                parse(data)
            assert str(info.value) == rec["error"]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12) | hostile_leaves, st.text(max_size=6) | hostile_leaves,
       st.lists(st.integers(min_value=0, max_value=2**40) | hostile_leaves, max_size=4)
       | st.lists(st.integers(), max_size=3).map(tuple), st.text(max_size=70) | hostile_leaves)
def test_tensor_digest_fast_path_is_the_general_encoding(name: Any, dtype: Any, shape: Any, data: Any) -> None:
    def general() -> str:
        return digests.digest_bytes("tensor", digests.canonical_bytes_reference(
            {"name": name, "dtype": dtype, "shape": list(shape), "data": data}))

    assert _outcome(lambda _: digests.tensor_digest(name, dtype, shape, data), None) == _outcome(
        lambda _: general(), None)


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, min_size=1, max_size=6), st.data())
def test_lines_parsed_at_once_are_the_lines_parsed_one_by_one(values: list[Any], data: st.DataObject) -> None:
    lines = [digests.canonical_bytes_reference(v) for v in values]
    if data.draw(st.booleans(), label="mutate"):
        i = data.draw(st.integers(0, len(lines) - 1), label="line")
        at = data.draw(st.integers(0, len(lines[i])), label="at")
        lines[i] = lines[i][:at] + data.draw(st.sampled_from([b",", b"[", b"]", b" ", b"1", b'"', b"\\"]),
                                               label="byte") + lines[i][at:]
    one_by_one = [_outcome(digests.parse_canonical, line) for line in lines]
    at_once = digests.parse_canonical_lines(lines)
    if at_once is None:  # the caller parses line by line
        return
    assert all(kind == "ok" for kind, _ in one_by_one)
    assert [typed(v) for v in at_once] == [value for _, value in one_by_one]


@pytest.mark.parametrize("lines", [[b"1,2", b"3"], [b"[1", b"2]", b"3"], [b""], [b'{"a":1}', b""],
                                   [b"[" * 300 + b"]" * 300], [b"9223372036854775808"], [b'"\\ud800"'],
                                   [b"1", b"1e5"]])
def test_lines_that_are_not_each_one_canonical_value_are_left_to_the_line_parser(lines: list[bytes]) -> None:
    assert digests.parse_canonical_lines(lines) is None


def test_lines_holding_a_digest_that_starts_with_19_decimal_digits_are_still_parsed_at_once() -> None:
    # after its colon such a digest looks like a long integer to the byte scan; the lines are then checked one by
    # one, not all left to the line parser
    digest = "blake3:" + "1234567890" * 2 + "ab" * 22
    lines = [digests.canonical_bytes({"model": digest, "step": step}) for step in range(3)]
    assert digests.parse_canonical_lines(lines) == [{"model": digest, "step": step} for step in range(3)]
    assert digests.parse_canonical_lines([*lines, b"4611686018427387904"]) == [  # 19 digits, within the limits
        *[{"model": digest, "step": step} for step in range(3)], 2**62]
    assert digests.parse_canonical_lines([*lines, b"9223372036854775808"]) is None  # beyond: to the line parser


@pytest.mark.parametrize(("data", "says"), [
    (b'{"a":1e400}', "float 1e400 is out of range"),
    (b'{"a":' + b"9" * 5001 + b"}", "an integer of more than 4,300 digits"),
    (b'{"a":1.' + b"1" * 100_000 + b"}", "(100,002 characters) is not in shortest round-trip form"),
    (b'{"a":"x\x01"}', "Invalid control character at char 7"),
])
def test_parse_errors_say_what_is_wrong_in_a_short_line(data: bytes, says: str) -> None:
    """Overflowing floats are out of range (not 'not in shortest form (inf)'), a long number is shortened, Python's
    integer-conversion limit is stated whole, json's 'at' is not doubled."""
    for parse in (digests.parse_canonical, digests.parse_canonical_reference):
        with pytest.raises(NonCanonical) as info:
            parse(data)
        assert says in str(info.value) and len(str(info.value)) < 200, str(info.value)
