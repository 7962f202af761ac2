"""DSSE v1 envelopes (github.com/secure-systems-lab/dsse) signed with Ed25519, and in-toto Statement v1 payloads.

A signature covers PAE(payloadType, payload) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body (LEN = ASCII
decimal byte length, no leading zeros), never the payload alone, so a payload cannot be re-read as another type.
Envelope JSON: ``{"payload": b64, "payloadType": str, "signatures": [{"keyid": str, "sig": b64}]}``. Verifiers
accept standard and URL-safe base64 (protocol.md requires both).

``keyid`` is an unauthenticated hint (the spec forbids security decisions on it): a signature whose keyid names a
trusted key is tried against that key, any other against every trusted key. An envelope verifies when signatures by
at least ``threshold`` distinct trusted keys verify; the ledger uses the operator's note key label
(``name+8-hex-key-id``, see :mod:`ledger.note`) as keyid. Interoperates with ``securesystemslib.dsse.Envelope``.

Statements: ``_type`` https://in-toto.io/Statement/v1, ``subject`` [{name, digest: {sha256, blake3}}] (lowercase
hex), ``predicateType`` URI, ``predicate`` object; payloadType ``application/vnd.in-toto+json``. We serialise them as
compact JSON with sorted keys so the same statement always yields the same payload bytes.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ledger.note import ed25519_verify
from ledger.transparency_errors import MalformedEnvelope, SignatureInvalid, UnknownKey

if TYPE_CHECKING:  # cryptography is imported when a signature is checked (ledger/note.py says why)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PAYLOAD_TYPE_IN_TOTO = "application/vnd.in-toto+json"
STATEMENT_V1 = "https://in-toto.io/Statement/v1"
MAX_SIGNATURES = 64
MAX_ENVELOPE_BYTES = 64 << 20  # an attestation of one receipt; a file beyond this is not one we wrote or read
_HEX_LENGTHS = {"sha256": 64, "blake3": 64}
_HEX = re.compile(r"[0-9a-f]+")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: the exact bytes a signature covers."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(t), t, len(payload), payload)


def _b64decode(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise MalformedEnvelope(f"{what} is not a base64 string", actual=type(text).__name__)
    alphabet = b"-_" if ("-" in text or "_" in text) else b"+/"
    padded = text + "=" * (-len(text) % 4)
    try:
        return base64.b64decode(padded.encode("ascii"), altchars=alphabet, validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise MalformedEnvelope(f"{what} is not base64", expected="standard or URL-safe base64",
                                actual=text[:80]) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise MalformedEnvelope(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _reject_constant(token: str) -> Any:
    raise MalformedEnvelope(f"JSON constant {token} is not allowed")


def _loads(data: bytes | str, what: str) -> Any:
    if len(data) > MAX_ENVELOPE_BYTES:
        raise MalformedEnvelope(f"{what} is larger than {MAX_ENVELOPE_BYTES:,} bytes")
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MalformedEnvelope(f"{what} is not JSON: {e}") from None


@dataclass(frozen=True)
class Signature:
    """One DSSE signature: the keyid hint (may be empty) and the raw signature bytes."""

    keyid: str
    sig: bytes


@dataclass(frozen=True)
class Envelope:
    """A DSSE envelope: the payload bytes, their type, and the signatures over PAE(type, payload)."""

    payload: bytes
    payload_type: str
    signatures: tuple[Signature, ...] = ()

    def pae(self) -> bytes:
        return pae(self.payload_type, self.payload)

    def to_dict(self) -> dict[str, Any]:
        def sig(s: Signature) -> dict[str, str]:
            out = {"keyid": s.keyid} if s.keyid else {}
            return {**out, "sig": base64.b64encode(s.sig).decode()}

        return {"payload": base64.b64encode(self.payload).decode(), "payloadType": self.payload_type,
                "signatures": [sig(s) for s in self.signatures]}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: object) -> Envelope:
        """Decode an envelope strictly: exactly payload, payloadType, signatures; each signature keyid? and sig."""
        if not isinstance(data, dict):
            raise MalformedEnvelope("an envelope is a JSON object", actual=type(data).__name__)
        if set(data) != {"payload", "payloadType", "signatures"}:
            raise MalformedEnvelope("an envelope has exactly payload, payloadType and signatures",
                                    expected=["payload", "payloadType", "signatures"], actual=sorted(data))
        payload_type, sigs = data["payloadType"], data["signatures"]
        if not isinstance(payload_type, str) or not payload_type:
            raise MalformedEnvelope("payloadType is a non-empty string", actual=repr(payload_type)[:80])
        if not isinstance(sigs, list) or len(sigs) > MAX_SIGNATURES:
            raise MalformedEnvelope(f"signatures is a list of at most {MAX_SIGNATURES}",
                                    actual=len(sigs) if isinstance(sigs, list) else type(sigs).__name__)
        parsed = []
        for i, s in enumerate(sigs):
            if not isinstance(s, dict) or "sig" not in s or not set(s) <= {"keyid", "sig"}:
                raise MalformedEnvelope(f"signature {i} is an object with sig and an optional keyid",
                                        actual=sorted(s) if isinstance(s, dict) else type(s).__name__)
            keyid = s.get("keyid", "")
            if not isinstance(keyid, str):
                raise MalformedEnvelope(f"signature {i}: keyid is a string", actual=type(keyid).__name__)
            parsed.append(Signature(keyid, _b64decode(s["sig"], f"signature {i}")))
        return cls(_b64decode(data["payload"], "payload"), payload_type, tuple(parsed))

    @classmethod
    def from_json(cls, data: bytes | str) -> Envelope:
        return cls.from_dict(_loads(data, "envelope"))


def sign_envelope(payload_type: str, payload: bytes, keys: Mapping[str, Ed25519PrivateKey]) -> Envelope:
    """Sign PAE(payload_type, payload) with each key; ``keys`` maps keyid hint to private key."""
    if not keys:
        raise ValueError("sign_envelope needs at least one key")
    message = pae(payload_type, payload)
    return Envelope(payload, payload_type, tuple(Signature(k, key.sign(message)) for k, key in keys.items()))


def verify_envelope(envelope: Envelope, keys: Mapping[str, Ed25519PublicKey], *, threshold: int = 1,
                    payload_type: str | None = None) -> tuple[str, ...]:
    """Check that signatures by at least ``threshold`` distinct trusted keys verify over PAE; returns their keyids.

    Raises SignatureInvalid (a signature hinting at a trusted key fails, and the threshold is not met) or UnknownKey
    (no signature is by a trusted key); MalformedEnvelope for a payload type other than ``payload_type``.
    """
    if threshold < 1 or threshold > len(keys):
        raise ValueError(f"threshold must be between 1 and the number of keys ({len(keys)}), got {threshold}")
    message = envelope.pae()
    accepted: dict[str, None] = {}
    failed: list[str] = []
    for s in envelope.signatures:
        candidates = [s.keyid] if s.keyid in keys else list(keys)
        for keyid in candidates:
            if not ed25519_verify(keys[keyid], s.sig, message):
                continue
            accepted.setdefault(keyid)
            break
        else:
            if s.keyid in keys:
                failed.append(s.keyid)
    if len(accepted) >= threshold:
        if payload_type is not None and envelope.payload_type != payload_type:
            raise MalformedEnvelope("unexpected payloadType", expected=payload_type, actual=envelope.payload_type)
        return tuple(accepted)
    if failed:
        raise SignatureInvalid(f"DSSE envelope ({len(accepted)} of {threshold} required signatures valid)",
                               key=", ".join(failed), expected=threshold, actual=len(accepted))
    raise UnknownKey("DSSE envelope", expected=sorted(keys), actual=[s.keyid for s in envelope.signatures])


# ---------------------------------------------------------------------------------------- in-toto Statement v1


def _digest_set(digest: Mapping[str, object], where: str) -> dict[str, str]:
    if not isinstance(digest, Mapping) or not digest:
        raise MalformedEnvelope(f"{where}: digest is a non-empty object", actual=repr(digest)[:80])
    out = {}
    for alg, value in digest.items():
        want = _HEX_LENGTHS.get(alg)
        if not isinstance(value, str) or not _HEX.fullmatch(value) or (want and len(value) != want):
            raise MalformedEnvelope(f"{where}: digest {alg} is not lowercase hex", expected=f"{want or 'any'} digits",
                                    actual=repr(value)[:80])
        out[alg] = value
    return out


def subject(name: str, *, sha256: str | None = None, blake3: str | None = None) -> dict[str, Any]:
    """A Statement subject; digests in lowercase hex (a ledger digest ``blake3:<hex>`` is accepted as is)."""
    digest = {}
    for alg, value in (("sha256", sha256), ("blake3", blake3)):
        if value is not None:
            digest[alg] = value.removeprefix(f"{alg}:")
    if not isinstance(name, str) or not name:
        raise MalformedEnvelope("a subject name is a non-empty string", actual=repr(name)[:80])
    return {"name": name, "digest": _digest_set(digest, f"subject {name!r}")}


def statement(subjects: Iterable[Mapping[str, Any]], predicate_type: str,
              predicate: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An in-toto Statement v1 (checked as :func:`parse_statement` would)."""
    out: dict[str, Any] = {"_type": STATEMENT_V1, "subject": [dict(s) for s in subjects],
                           "predicateType": predicate_type}
    if predicate is not None:
        out["predicate"] = dict(predicate)
    return _check_statement(out)


def statement_bytes(stmt: Mapping[str, Any]) -> bytes:
    """Compact JSON with sorted keys: one statement, one payload."""
    try:
        return json.dumps(stmt, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise MalformedEnvelope(f"the statement is not JSON-serialisable: {e}") from None


def _check_statement(stmt: object) -> dict[str, Any]:
    if not isinstance(stmt, dict):
        raise MalformedEnvelope("a statement is a JSON object", actual=type(stmt).__name__)
    if stmt.get("_type") != STATEMENT_V1:
        raise MalformedEnvelope("not an in-toto Statement v1", expected=STATEMENT_V1, actual=stmt.get("_type"))
    subjects = stmt.get("subject")
    if not isinstance(subjects, list) or not subjects:
        raise MalformedEnvelope("subject is a non-empty list", actual=repr(subjects)[:80])
    for i, s in enumerate(subjects):
        if not isinstance(s, dict) or not isinstance(s.get("name"), str) or "digest" not in s:
            raise MalformedEnvelope(f"subject {i} is an object with name and digest", actual=repr(s)[:80])
        _digest_set(s["digest"], f"subject {i}")
    if not isinstance(stmt.get("predicateType"), str) or not stmt["predicateType"]:
        raise MalformedEnvelope("predicateType is a non-empty string", actual=repr(stmt.get("predicateType"))[:80])
    if "predicate" in stmt and not isinstance(stmt["predicate"], dict):
        raise MalformedEnvelope("predicate is an object", actual=type(stmt["predicate"]).__name__)
    return stmt


def parse_statement(payload: bytes) -> dict[str, Any]:
    """Parse a Statement v1 payload strictly (UTF-8 JSON, no duplicate keys, required fields and types)."""
    return _check_statement(_loads(payload, "statement payload"))


def sign_statement(stmt: Mapping[str, Any], keys: Mapping[str, Ed25519PrivateKey]) -> Envelope:
    """A DSSE envelope of type application/vnd.in-toto+json carrying the statement."""
    return sign_envelope(PAYLOAD_TYPE_IN_TOTO, statement_bytes(_check_statement(dict(stmt))), keys)


def open_statement(envelope: Envelope, keys: Mapping[str, Ed25519PublicKey], *, threshold: int = 1
                   ) -> dict[str, Any]:
    """Verify the envelope (in that order: signatures, payload type, parse, as protocol.md says) and return the
    statement."""
    verify_envelope(envelope, keys, threshold=threshold, payload_type=PAYLOAD_TYPE_IN_TOTO)
    return parse_statement(envelope.payload)
