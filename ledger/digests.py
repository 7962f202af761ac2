"""The canonical encoding and every digest the ledger uses.

This is the one module that defines bytes-to-identity. Writers (runners) and checkers (verify) both import it;
nothing else may build canonical bytes or call BLAKE3 for an identity. The format is specified in
``docs/receipts.md``; a change here is a change of that document and of ``ENCODING_VERSION``.

Canonical JSON (version 1) is UTF-8 JSON with:
* objects whose keys are strings, sorted by code point (= by UTF-8 bytes), no duplicates;
* no insignificant whitespace;
* strings escaped as Python's ``json`` does with ``ensure_ascii=False``: ``\\"``, ``\\\\``, ``\\b \\f \\n \\r \\t``,
  other U+0000..U+001F as ``\\u00xx`` (lowercase hex), everything else as raw UTF-8; lone surrogates rejected;
* integers in decimal, within signed 64 bits;
* floats finite only, written as Python's ``repr`` (shortest round-trip decimal, always with ``.`` or ``e``), so a
  float is exact and never confused with an integer;
* ``true``, ``false``, ``null``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import blake3

from ledger.errors import MalformedDigest, NonCanonical

ALGORITHM: Final = "blake3"
ENCODING_VERSION: Final = 1
DIGEST_HEX_LEN: Final = 64
_PREFIX: Final = f"{ALGORITHM}:"
_DIGEST_RE: Final = re.compile(r"^blake3:[0-9a-f]{64}$")
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**63 - 1

# Domain separation: every kind of digest uses BLAKE3's derive_key mode with its own context string, so bytes
# hashed as one kind can never collide with another kind. Plain BLAKE3 (no context) is reserved for the raw
# bytes of files and tensor data, so those digests equal what `b3sum` prints.
_CONTEXT_BASE: Final = "content-addressed-training-ledger 2026-11 v1 "
DOMAINS: Final = ("receipt", "tensor", "component", "state", "prepared", "selection", "document", "json")


def _context(domain: str) -> str:
    if domain not in DOMAINS:
        raise ValueError(f"unknown digest domain {domain!r}; known: {', '.join(DOMAINS)}")
    return _CONTEXT_BASE + domain


JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]


# ----------------------------------------------------------------------------------------------- encoding


def _check_value(value: Any, path: str) -> None:
    """Reject anything canonical JSON cannot represent exactly (before json.dumps can coerce it)."""
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise NonCanonical(f"{path}: string is not valid Unicode (lone surrogate)") from exc
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise NonCanonical(f"{path}: integer {value} outside signed 64-bit range")
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise NonCanonical(f"{path}: {value!r} is not a finite number")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise NonCanonical(f"{path}: object key {key!r} is not a string")
            _check_value(key, f"{path}.<key>")
            _check_value(item, f"{path}.{key}")
        return
    raise NonCanonical(f"{path}: {type(value).__name__} has no canonical JSON form")


def canonical_bytes(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes; raise NonCanonical for anything without an exact encoding."""
    _check_value(value, "$")
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


# ------------------------------------------------------------------------------------------------ parsing


def _reject_constant(token: str) -> Any:
    raise NonCanonical(f"{token} is not allowed")


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.loads`` object hook: an object with a key twice is an error, not a silent last-one-wins."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise NonCanonical(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_float(token: str) -> float:
    value = float(token)
    if repr(value) != token:
        raise NonCanonical(f"float {token} is not in shortest round-trip form ({value!r})")
    return value


def parse_canonical(data: bytes) -> Any:
    """Parse canonical JSON bytes. Anything that would not re-encode to exactly ``data`` is an error."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NonCanonical(f"not UTF-8 at byte {exc.start}") from exc
    try:
        value = json.loads(
            text, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant, parse_float=_parse_float
        )
    except json.JSONDecodeError as exc:
        raise NonCanonical(f"not JSON: {exc.msg} at char {exc.pos}") from exc
    except (ValueError, RecursionError) as exc:  # an integer of over 4,300 digits; nesting ~1,000 deep
        raise NonCanonical(f"out of range: {str(exc)[:80]}") from exc
    again = canonical_bytes(value)
    if again != data:
        at = next((i for i, (a, b) in enumerate(zip(again, data, strict=False)) if a != b), min(len(again), len(data)))
        raise NonCanonical(f"not canonical: differs from its canonical form at byte {at}")
    return value


# ------------------------------------------------------------------------------------------------ digests


def format_digest(raw: bytes) -> str:
    return _PREFIX + raw.hex()


def is_digest(text: object) -> bool:
    return isinstance(text, str) and _DIGEST_RE.fullmatch(text) is not None


def check_digest(text: object, what: str = "digest") -> str:
    """Return ``text`` if it is a well-formed ``blake3:<64 hex>``; raise MalformedDigest naming ``what``."""
    if not is_digest(text):
        raise MalformedDigest(what, text)
    assert isinstance(text, str)
    return text


def digest_hex(digest: str) -> str:
    return check_digest(digest)[len(_PREFIX) :]


def digest_bytes(domain: str, data: bytes | memoryview) -> str:
    """Domain-separated digest of ``data``."""
    hasher = blake3.blake3(derive_key_context=_context(domain))
    hasher.update(data)
    return format_digest(hasher.digest())


def digest_json(domain: str, value: Any) -> str:
    """Domain-separated digest of the canonical encoding of ``value``."""
    return digest_bytes(domain, canonical_bytes(value))


def raw_digest(data: bytes | memoryview, *, threads: bool = True) -> str:
    """Plain BLAKE3 of raw bytes (files, tensor data): equal to what ``b3sum`` prints."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    hasher.update(data)
    return format_digest(hasher.digest())


def file_digest(path: str | Any) -> str:
    """Plain BLAKE3 of a file's bytes, read through mmap with multi-threaded hashing (equals ``b3sum``)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return format_digest(hasher.digest())


def receipt_id(body: bytes) -> str:
    """A receipt's id: the receipt-domain digest of its canonical bytes."""
    return digest_bytes("receipt", body)


# ------------------------------------------------------------------------------------------ composite digests
# Every composite digest of the system, in one place: writers (runners) and checkers (verify, an independent
# verifier following docs/receipts.md section 3) compute them with these functions and nothing else.


def tensor_digest(name: str, dtype: str, shape: Sequence[int], data: str) -> str:
    """The tensor digest: commits to name, dtype, shape and the data digest of its raw bytes."""
    return digest_json("tensor", {"name": name, "dtype": dtype, "shape": list(shape), "data": data})


def component_digest(component: str, tensors: Mapping[str, str], scalars: Mapping[str, Any]) -> str:
    """The component digest over its tensor digests (by name) and its scalars."""
    return digest_json("component", {"component": component, "tensors": dict(tensors), "scalars": dict(scalars)})


def state_digest(components: Mapping[str, str]) -> str:
    """The checkpoint (state) digest over its component digests."""
    return digest_json("state", {"components": dict(components)})


def prepared_digest(artifacts: Mapping[str, str]) -> str:
    """The `prepared` digest: commits to every artifact of the prepare step (data, tokenizer, seed, config)."""
    return digest_json("prepared", dict(artifacts))


def selection_digest(artifacts: Mapping[str, str]) -> str:
    """The `selection` digest: commits to the evaluation selection and the retention probes."""
    return digest_json("selection", dict(artifacts))


DOCUMENT_KEYS: Final = ("family", "variant", "prompt", "answer", "fields")


def document_digest(body: Mapping[str, Any]) -> str:
    """A task document's or retention probe's digest (domain ``document``) over its body (for a task document,
    exactly the DOCUMENT_KEYS)."""
    return digest_json("document", dict(body))


def text_digest(text: str) -> str:
    """The digest of a prompt or output text: plain BLAKE3 of its UTF-8 bytes (what ``b3sum`` prints)."""
    return raw_digest(text.encode("utf-8"))


def binding_digest(binding: Mapping[str, Any]) -> str:
    """The digest of a rank's binding (who ran it where, with which software)."""
    return digest_json("json", dict(binding))
