"""DSSE v1 envelopes and in-toto Statements (ledger/dsse.py), with securesystemslib as the independent side."""

from __future__ import annotations

import base64
import json
import os
from types import ModuleType
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from ledger import dsse
from ledger.errors import InputError, VerificationError
from ledger.transparency_errors import MalformedEnvelope, SignatureInvalid, UnknownKey

HELLO_TYPE = "http://example.com/HelloWorld"


def securesystemslib() -> ModuleType:
    """securesystemslib >= 1.6 (a test dependency); skipped when absent, except under CI where it must be there."""
    try:
        import securesystemslib as ssl
        import securesystemslib.dsse  # noqa: F401
        import securesystemslib.exceptions  # noqa: F401
        import securesystemslib.signer  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("securesystemslib is not installed (pip install 'securesystemslib>=1.6,<2')")
        pytest.skip("securesystemslib is not installed")
    return ssl


def test_pae_bytes_match_the_protocol_example() -> None:
    assert dsse.pae(HELLO_TYPE, b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    assert dsse.pae("", b"") == b"DSSEv1 0  0 "
    # lengths count UTF-8 bytes, not characters
    assert dsse.pae("t\u00e9", b"\x00\xff") == b"DSSEv1 3 t\xc3\xa9 2 \x00\xff"


def test_protocol_test_vector_signature_verifies_over_our_pae() -> None:
    """protocol.md's ECDSA P-256 example: its signature is over exactly the bytes our PAE produces."""
    x = 46950820868899156662930047687818585632848591499744589407958293238635476079160
    y = 5640078356564379163099075877009565129882514886557779369047442380624545832820
    public = ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    envelope = dsse.Envelope.from_json(json.dumps({
        "payload": "aGVsbG8gd29ybGQ=", "payloadType": HELLO_TYPE,
        "signatures": [{"sig": "A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZ"
                               "A=="}],
    }))
    raw = envelope.signatures[0].sig
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    public.verify(der, envelope.pae(), ec.ECDSA(hashes.SHA256()))
    assert envelope.signatures[0].keyid == ""


def test_round_trip_and_wrong_signature() -> None:
    key = Ed25519PrivateKey.generate()
    env = dsse.sign_envelope(HELLO_TYPE, b"hello world", {"op+0001": key})
    again = dsse.Envelope.from_json(env.to_json())
    assert again == env
    assert dsse.verify_envelope(again, {"op+0001": key.public_key()}) == ("op+0001",)
    # the payload is fine but the signature is someone else's
    other = Ed25519PrivateKey.generate()
    forged = dsse.Envelope(env.payload, env.payload_type,
                           (dsse.Signature("op+0001", other.sign(env.pae())),))
    with pytest.raises(SignatureInvalid) as info:
        dsse.verify_envelope(forged, {"op+0001": key.public_key()})
    assert isinstance(info.value, VerificationError)
    # a signature over the bare payload (no PAE) is refused
    bare = dsse.Envelope(env.payload, env.payload_type, (dsse.Signature("op+0001", key.sign(env.payload)),))
    with pytest.raises(SignatureInvalid):
        dsse.verify_envelope(bare, {"op+0001": key.public_key()})
    # the same signature does not carry over to another payload type
    retyped = dsse.Envelope(env.payload, "application/json", env.signatures)
    with pytest.raises(SignatureInvalid):
        dsse.verify_envelope(retyped, {"op+0001": key.public_key()})


def test_keyid_is_only_a_hint_and_threshold_counts_distinct_keys() -> None:
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trusted = {"a": a.public_key(), "b": b.public_key()}
    env = dsse.sign_envelope(HELLO_TYPE, b"x", {"wrong-hint": a})
    assert dsse.verify_envelope(env, trusted) == ("a",)
    twice = dsse.Envelope(env.payload, env.payload_type, env.signatures * 2)
    with pytest.raises(UnknownKey):  # the same key twice is one key; nothing hints at b
        dsse.verify_envelope(twice, trusted, threshold=2)
    both = dsse.sign_envelope(HELLO_TYPE, b"x", {"a": a, "b": b})
    assert set(dsse.verify_envelope(both, trusted, threshold=2)) == {"a", "b"}
    with pytest.raises(UnknownKey):
        dsse.verify_envelope(both, {"c": Ed25519PrivateKey.generate().public_key()})
    with pytest.raises(ValueError):
        dsse.verify_envelope(both, trusted, threshold=3)


def test_url_safe_and_unpadded_base64_are_accepted() -> None:
    key = Ed25519PrivateKey.generate()
    env = dsse.sign_envelope(HELLO_TYPE, b"\xfb\xff\xfe payload", {"k": key})
    d = env.to_dict()
    d["payload"] = base64.urlsafe_b64encode(env.payload).decode().rstrip("=")
    d["signatures"][0]["sig"] = base64.urlsafe_b64encode(env.signatures[0].sig).decode()
    assert dsse.Envelope.from_dict(d) == env


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("payload"),
    lambda d: d.update(extra=1),
    lambda d: d.update(payload="not base64!"),
    lambda d: d.update(payloadType=""),
    lambda d: d.update(payloadType=7),
    lambda d: d.update(signatures={}),
    lambda d: d.update(signatures=[{"keyid": "k"}]),
    lambda d: d.update(signatures=[{"sig": "AAAA", "keyid": 5}]),
    lambda d: d.update(signatures=[{"sig": "AAAA", "cert": "x"}]),
])
def test_malformed_envelopes_are_rejected(mutate: Any) -> None:
    d = dsse.sign_envelope(HELLO_TYPE, b"x", {"k": Ed25519PrivateKey.generate()}).to_dict()
    mutate(d)
    with pytest.raises(MalformedEnvelope) as info:
        dsse.Envelope.from_json(json.dumps(d))
    assert isinstance(info.value, InputError)


def test_duplicate_keys_and_non_json_are_rejected() -> None:
    for data in (b'{"payload":"","payload":"","payloadType":"t","signatures":[]}', b"[", b"\xff",
                 b'{"payload":"","payloadType":"t","signatures":[],"x":NaN}'):
        with pytest.raises(MalformedEnvelope):
            dsse.Envelope.from_json(data)


# ---------------------------------------------------------------------------------------------- statements

B3 = "blake3:" + "ab" * 32
SHA = "cd" * 32


def make_statement() -> dict[str, Any]:
    return dsse.statement([dsse.subject("model.safetensors", sha256=SHA, blake3=B3)],
                          "https://training-ledger.example/receipt/v1", {"receipt": B3, "step": 64})


def test_statement_shape_and_open() -> None:
    stmt = make_statement()
    assert stmt == {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "model.safetensors", "digest": {"sha256": SHA, "blake3": "ab" * 32}}],
        "predicateType": "https://training-ledger.example/receipt/v1",
        "predicate": {"receipt": B3, "step": 64},
    }
    key = Ed25519PrivateKey.generate()
    env = dsse.sign_statement(stmt, {"op": key})
    assert env.payload_type == "application/vnd.in-toto+json"
    assert env.payload == dsse.statement_bytes(stmt) == json.dumps(stmt, sort_keys=True, separators=(",", ":")).encode()
    assert dsse.open_statement(dsse.Envelope.from_json(env.to_json()), {"op": key.public_key()}) == stmt
    wrong_type = dsse.sign_envelope("application/json", env.payload, {"op": key})
    with pytest.raises(MalformedEnvelope, match="payloadType"):
        dsse.open_statement(wrong_type, {"op": key.public_key()})


@pytest.mark.parametrize("stmt", [
    {"_type": "https://in-toto.io/Statement/v0.1", "subject": [{"name": "a", "digest": {"sha256": SHA}}],
     "predicateType": "p"},
    {"_type": dsse.STATEMENT_V1, "subject": [], "predicateType": "p"},
    {"_type": dsse.STATEMENT_V1, "subject": [{"name": "a", "digest": {}}], "predicateType": "p"},
    {"_type": dsse.STATEMENT_V1, "subject": [{"name": "a", "digest": {"sha256": SHA.upper()}}], "predicateType": "p"},
    {"_type": dsse.STATEMENT_V1, "subject": [{"name": "a", "digest": {"sha256": SHA[:-2]}}], "predicateType": "p"},
    {"_type": dsse.STATEMENT_V1, "subject": [{"name": "a", "digest": {"sha256": SHA}}]},
    {"_type": dsse.STATEMENT_V1, "subject": [{"name": "a", "digest": {"sha256": SHA}}], "predicateType": "p",
     "predicate": [1]},
])
def test_malformed_statements_are_rejected(stmt: dict[str, Any]) -> None:
    with pytest.raises(MalformedEnvelope):
        dsse.parse_statement(json.dumps(stmt).encode())


# --------------------------------------------------------------------------------------- securesystemslib


def test_our_envelope_verifies_with_securesystemslib() -> None:
    ssl = securesystemslib()
    key = Ed25519PrivateKey.generate()
    ours = dsse.sign_statement(make_statement(), {"operator.example/alice+0a1b2c3d": key})
    theirs = ssl.dsse.Envelope.from_dict(json.loads(ours.to_json()))
    public = ssl.signer.SSlibKey.from_crypto(key.public_key(), keyid="operator.example/alice+0a1b2c3d")
    accepted = theirs.verify([public], 1)
    assert list(accepted) == ["operator.example/alice+0a1b2c3d"]
    assert theirs.pae() == ours.pae() and theirs.payload == ours.payload
    # and their side refuses our envelope once its payload changes
    tampered = json.loads(ours.to_json())
    tampered["payload"] = base64.b64encode(ours.payload.replace(b"64", b"65")).decode()
    with pytest.raises(ssl.exceptions.VerificationError):
        ssl.dsse.Envelope.from_dict(tampered).verify([public], 1)


def test_securesystemslib_envelope_verifies_with_ours() -> None:
    ssl = securesystemslib()
    key = Ed25519PrivateKey.generate()
    signer = ssl.signer.CryptoSigner(key)  # their signer, their default keyid
    payload = dsse.statement_bytes(make_statement())
    theirs = ssl.dsse.Envelope(payload, dsse.PAYLOAD_TYPE_IN_TOTO, {})
    theirs.sign(signer)
    ours = dsse.Envelope.from_json(json.dumps(theirs.to_dict()))
    keyid = signer.public_key.keyid
    public = key.public_key()
    assert dsse.open_statement(ours, {keyid: public}) == make_statement()
    # a bad signature in their envelope is rejected by ours
    d = theirs.to_dict()
    sig = bytearray(base64.b64decode(d["signatures"][0]["sig"]))
    sig[0] ^= 1
    d["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    with pytest.raises(SignatureInvalid):
        dsse.verify_envelope(dsse.Envelope.from_dict(d), {keyid: public})
