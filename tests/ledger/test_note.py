"""C2SP signed notes, checkpoints and cosignatures (ledger/note.py), against Go's sumdb/note vector."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger import note
from ledger.errors import InputError, VerificationError
from ledger.transparency_errors import (
    CosignatureQuorum,
    LogOriginMismatch,
    MalformedCheckpoint,
    MalformedKey,
    MalformedNote,
    SignatureInvalid,
    UnknownKey,
)


def require_vectors(sub: str) -> Path:
    """shared/vectors/<sub> beside the checkout, else under $LEDGER_SHARED_DIR; skip if absent, fail under CI."""
    for base in (Path(__file__).resolve().parents[3] / "shared", os.environ.get("LEDGER_SHARED_DIR")):
        if base and (Path(base) / "vectors" / sub).is_dir():
            return Path(base) / "vectors" / sub
    message = f"shared/vectors/{sub} not found (set LEDGER_SHARED_DIR)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def vector() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((require_vectors("signed-note") / "peterneumann.json").read_text())
    return data


# ------------------------------------------------------------------------------------- the Go vector


def test_vector_keys_parse_and_reencode(vector: dict[str, Any]) -> None:
    signer = note.Signer.from_key(vector["signer_key"])
    verifier = note.Verifier.from_key(vector["verifier_key"])
    assert f"{signer.key_id:08x}" == f"{verifier.key_id:08x}" == "c74f20a3"
    assert signer.key() == vector["signer_key"]
    assert verifier.key() == vector["verifier_key"] == signer.verifier.key()
    assert "+" in vector["signer_key"].split("+", 4)[4]  # the base64 part itself has a '+'


def test_vector_signs_byte_for_byte(vector: dict[str, Any]) -> None:
    signer = note.Signer.from_key(vector["signer_key"])
    signed = note.sign_note(vector["text"], signer)
    assert signed == vector["note"].encode()
    assert signed.decode().endswith("\n\n" + vector["signature_line"])
    assert note.NoteSignature(signer.name, signer.key_id, signer.sign(vector["text"].encode())).line() == \
        vector["signature_line"]
    assert vector["signature_line"].startswith("\u2014 PeterNeumann ")


def test_vector_verifies(vector: dict[str, Any]) -> None:
    verifier = note.Verifier.from_key(vector["verifier_key"])
    opened = note.open_note(vector["note"].encode(), [verifier])
    assert opened.text == vector["text"]
    assert [s.label for s in opened.verified] == ["PeterNeumann+c74f20a3"]
    assert opened.unverified == ()
    assert note.parse_note(vector["note"]).encode() == vector["note"].encode()


def test_tampered_text_is_rejected(vector: dict[str, Any]) -> None:
    verifier = note.Verifier.from_key(vector["verifier_key"])
    tampered = vector["note"].replace("answer", "Answer")
    with pytest.raises(SignatureInvalid) as info:
        note.open_note(tampered, [verifier])
    assert isinstance(info.value, VerificationError) and "PeterNeumann+c74f20a3" in str(info.value)


def test_tampered_signature_is_rejected(vector: dict[str, Any]) -> None:
    verifier = note.Verifier.from_key(vector["verifier_key"])
    sig = note.parse_note(vector["note"]).signatures[0]
    bad = note.NoteSignature(sig.name, sig.key_id, bytes([sig.signature[0] ^ 1]) + sig.signature[1:])
    with pytest.raises(SignatureInvalid):
        note.open_note(note.Note(vector["text"], (bad,)).encode(), [verifier])


def test_wrong_key_is_unknown(vector: dict[str, Any]) -> None:
    other_same_name = note.Signer.generate("PeterNeumann").verifier  # same name, other key id: ignored
    other = note.Signer.generate("EnochRoot").verifier
    with pytest.raises(UnknownKey) as info:
        note.open_note(vector["note"], [other_same_name, other])
    assert info.value.actual == ["PeterNeumann+c74f20a3"]
    with pytest.raises(UnknownKey):
        note.open_note(vector["note"], [])


def test_unknown_signatures_are_ignored_but_kept(vector: dict[str, Any]) -> None:
    """Go's doc example: EnochRoot re-signs; a verifier knowing only PeterNeumann still accepts."""
    enoch = note.Signer.generate("EnochRoot")
    both = note.sign_note(note.parse_note(vector["note"]), enoch)
    assert both.decode().startswith(vector["note"])  # existing signatures stay first
    opened = note.open_note(both, [note.Verifier.from_key(vector["verifier_key"])])
    assert [s.name for s in opened.verified] == ["PeterNeumann"]
    assert [s.name for s in opened.unverified] == ["EnochRoot"]
    opened = note.open_note(both, [enoch.verifier, note.Verifier.from_key(vector["verifier_key"])])
    assert [s.name for s in opened.verified] == ["PeterNeumann", "EnochRoot"]


def test_a_failing_known_signature_rejects_even_with_a_valid_one(vector: dict[str, Any]) -> None:
    enoch = note.Signer.generate("EnochRoot")
    forged = note.NoteSignature("EnochRoot", enoch.key_id, bytes(64))
    data = note.Note(vector["text"], (*note.parse_note(vector["note"]).signatures, forged)).encode()
    with pytest.raises(SignatureInvalid):
        note.open_note(data, [note.Verifier.from_key(vector["verifier_key"]), enoch.verifier])
    # the same forged line by a key nobody trusts is ignored
    assert note.open_note(data, [note.Verifier.from_key(vector["verifier_key"])]).unverified == (forged,)


def test_resigning_replaces_the_same_keys_signature(vector: dict[str, Any]) -> None:
    signer = note.Signer.from_key(vector["signer_key"])
    again = note.sign_note(note.parse_note(vector["note"]), signer)
    assert again == vector["note"].encode()


def test_missing_signatures_are_malformed(vector: dict[str, Any]) -> None:
    for data in (vector["text"], vector["text"] + "\n", vector["text"] + "\n\n"):
        with pytest.raises(MalformedNote) as info:
            note.parse_note(data)
        assert isinstance(info.value, InputError)
    with pytest.raises(MalformedNote):
        note.Note(vector["text"]).encode()


LINE = ("\u2014 PeterNeumann "
        "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=")


@pytest.mark.parametrize("block", [
    LINE,                                       # no final newline
    "- PeterNeumann x08go/ZJkuBS9UG=\n",        # hyphen, not em dash
    "\u2014PeterNeumann " + LINE[15:] + "\n",   # no space after the dash
    "\u2014 PeterNeumann\n",                    # no signature
    "\u2014 PeterNeumann \n",                   # empty signature
    "\u2014 Peter+Neumann " + LINE[15:] + "\n",  # '+' in the name
    "\u2014  " + LINE[15:] + "\n",              # empty name
    "\u2014 PeterNeumann AAAAAA==\n",           # shorter than key id + signature
    "\u2014 PeterNeumann x08go/ZJ!uBS9UG=\n",   # not base64
    "\u2014 PeterNeumann " + LINE[15:-1] + "\n",  # bad padding
    "\u2014 PeterNeumann AAAAAAB=\n",           # non-canonical base64 (stray low bits)
    LINE + "\n" + "garbage\n",                  # a non-signature line
    LINE + "\n\u2014 a AAAAAAA=\n\n",           # a trailing blank line
])
def test_malformed_signature_lines_are_rejected(vector: dict[str, Any], block: str) -> None:
    with pytest.raises(MalformedNote):
        note.parse_note(vector["text"] + "\n" + block)


@pytest.mark.parametrize("data", [
    b"text\x01\n\n" + LINE.encode() + b"\n",     # control character
    b"text\r\n\n" + LINE.encode() + b"\n",       # CR
    b"text\xff\n\n" + LINE.encode() + b"\n",     # not UTF-8
])
def test_malformed_text_is_rejected(data: bytes) -> None:
    with pytest.raises(MalformedNote):
        note.parse_note(data)


def test_signing_refuses_texts_that_would_not_open() -> None:
    signer = note.Signer.generate("example.com/log")
    for text in ("no newline", "", "tab\there\n", "\ud800\n"):
        with pytest.raises(MalformedNote):
            note.sign_note(text, signer)


def test_too_many_signatures_are_refused() -> None:
    signer = note.Signer.generate("a")
    one = note.parse_note(note.sign_note("t\n", signer)).signatures[0]
    assert len(note.parse_note(note.Note("t\n", (one,) * 100).encode()).signatures) == 100
    with pytest.raises(MalformedNote, match="too many"):
        note.parse_note(note.Note("t\n", (one,) * 101).encode())


def test_text_may_contain_blank_lines() -> None:
    signer = note.Signer.generate("quasimodo.example/salvatore")
    text = "Ognuno sta solo sul cuor della terra\ntrafitto da un raggio di sole:\n\ned \u00e8 subito sera.\n"
    assert note.open_note(note.sign_note(text, signer), [signer.verifier]).text == text


# ------------------------------------------------------------------------------------------ key strings


@pytest.mark.parametrize("vkey", [
    "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # key id does not match
    "PeterNeumann+C74F20A3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # upper-case hex
    "PeterNeumann+c74f20a3",                                               # no key
    "PeterNeumann+c74f20a3+AhpcDQcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # unknown type 0x02
    "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10T=",  # bad base64 / length
    "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # space in the name
    "rekor.sigstore.dev+12345678+THIS_IS_NOT_BASE64!",
])
def test_malformed_verifier_keys(vkey: str) -> None:
    with pytest.raises(MalformedKey):
        note.Verifier.from_key(vkey)


def test_signer_key_errors_never_echo_the_secret(vector: dict[str, Any]) -> None:
    secret = vector["signer_key"].split("+", 4)[4]
    for bad in (vector["signer_key"].replace("c74f20a3", "00000000"), "PRIVATE+KEY+x+1234567+" + secret,
                vector["signer_key"].replace("PRIVATE", "PUBLIC")):
        with pytest.raises(MalformedKey) as info:
            note.Signer.from_key(bad)
        assert secret not in str(info.value) and secret not in repr(info.value.__dict__)


def test_cosignature_verifier_key_from_go() -> None:
    """A type-0x04 vkey from transparency-dev/formats' tests: its key id recomputes."""
    vkey = "remora.n621.de+da77ade7+BOvN63jn/bLvkieywe8R6UYAtVtNbZpXh34x7onlmtw2"
    v = note.Verifier.from_key(vkey)
    assert v.alg == note.ALG_COSIGNATURE_V1 and v.key() == vkey


def test_generated_keys_round_trip() -> None:
    for alg in (note.ALG_ED25519, note.ALG_COSIGNATURE_V1):
        s = note.Signer.generate("witness.example/w1", alg)
        assert note.Signer.from_key(s.key()).key() == s.key()
        assert note.Verifier.from_key(s.verifier.key()) == s.verifier
    a = note.Signer.generate("same")
    assert note.Signer("same", a.private_key, note.ALG_COSIGNATURE_V1).key_id != a.key_id  # type in the key id


# ------------------------------------------------------------------------------------------- checkpoints


SOFA = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"


def test_checkpoint_round_trip() -> None:
    cp = note.parse_checkpoint(SOFA)
    assert (cp.origin, cp.size, cp.extensions) == ("example.com/behind-the-sofa", 20852163, ())
    assert cp.root == base64.b64decode("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=")
    assert note.format_checkpoint(cp) == SOFA == cp.text()
    ext = note.Checkpoint("log.example/x", 0, bytes(32), ("ext one", "\u00e9xt two"))
    assert note.parse_checkpoint(note.format_checkpoint(ext)) == ext


@pytest.mark.parametrize("text", [
    SOFA[:-1],                                             # no final newline
    "example.com/behind-the-sofa\n20852163\n",             # two lines
    "\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",   # empty origin
    SOFA.replace("20852163", "020852163"),                 # leading zero
    SOFA.replace("20852163", "+20852163"),
    SOFA.replace("20852163", " 20852163"),
    SOFA.replace("20852163", "2085216\uff13"),             # a non-ASCII digit
    SOFA.replace("20852163", "18446744073709551616"),      # 2^64
    SOFA.replace("20852163", "-1"),
    SOFA.replace("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=", "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I"),
    SOFA.replace("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=", "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2J="),
    SOFA.replace("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=", "AAAA"),  # 3-byte root
    SOFA.replace("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=", "CsUYapGGPo4dkMgIAUqom_Xajj7h2fB2MPA3j2jxq2I="),
    SOFA + "\n",                                           # empty extension line
    SOFA + "ext\n\nmore\n",
    SOFA.replace("\n", "\r\n"),
])
def test_checkpoint_parsing_is_strict(text: str) -> None:
    with pytest.raises(MalformedCheckpoint):
        note.parse_checkpoint(text)


def test_signed_checkpoint_with_witness_cosignatures() -> None:
    log = note.Signer.generate("example.com/log")
    w1 = note.Signer.generate("witness.example/w1", note.ALG_COSIGNATURE_V1)
    w2 = note.Signer.generate("witness.example/w2", note.ALG_COSIGNATURE_V1)
    cp = note.Checkpoint("example.com/log", 42, bytes(range(32)))
    signed = note.sign_checkpoint(cp, log)
    cosigned = note.cosign_checkpoint(signed, log.verifier, w1, timestamp=1679315147)
    cosigned = note.cosign_checkpoint(cosigned, log.verifier, w2, timestamp=1679315148)
    assert cosigned.startswith(signed)
    got = note.verify_checkpoint(cosigned, log.verifier, witnesses=[w1.verifier, w2.verifier], quorum=2,
                                 origin="example.com/log")
    assert got.checkpoint == cp
    assert [(s.name, s.timestamp) for s in got.cosignatures] == [("witness.example/w1", 1679315147),
                                                                ("witness.example/w2", 1679315148)]
    # clients that know only the log ignore the cosignatures
    assert note.verify_checkpoint(cosigned, log.verifier).cosignatures == ()
    with pytest.raises(CosignatureQuorum):
        note.verify_checkpoint(cosigned, log.verifier, witnesses=[w1.verifier], quorum=2)
    with pytest.raises(LogOriginMismatch):
        note.verify_checkpoint(cosigned, log.verifier, origin="example.com/other")
    # a checkpoint only witnesses signed is not the log's
    with pytest.raises(UnknownKey):
        note.verify_checkpoint(note.sign_checkpoint(cp, w1, timestamp=1), log.verifier, witnesses=[w1.verifier])
    # a changed tree size breaks both the log's signature and the cosignatures
    forged = cosigned.replace(b"\n42\n", b"\n43\n")
    with pytest.raises(SignatureInvalid):
        note.verify_checkpoint(forged, log.verifier)
    with pytest.raises(SignatureInvalid):
        note.open_note(forged, [w1.verifier])


def test_cosignature_bytes_follow_tlog_cosignature() -> None:
    """timestamp (8 bytes, big-endian) || Ed25519 over "cosignature/v1\\ntime <t>\\n" || checkpoint body."""
    seed = bytes(range(32))
    w = note.Signer("witness.example/w1", Ed25519PrivateKey.from_private_bytes(seed), note.ALG_COSIGNATURE_V1)
    sig = note.parse_note(note.sign_note(SOFA, w, timestamp=1679315147)).signatures[0]
    expected = Ed25519PrivateKey.from_private_bytes(seed).sign(
        b"cosignature/v1\ntime 1679315147\n" + SOFA.encode())
    assert sig.signature == (1679315147).to_bytes(8, "big") + expected
    # the spec's example line carries the same timestamp bytes after its key id
    assert base64.b64decode("jWbPPwAAAABkGFDL")[4:] == (1679315147).to_bytes(8, "big")
    # a plain Ed25519 verifier of the same key has another key id, so it never checks a cosignature
    plain = note.Verifier(w.name, w.verifier.public_key, note.ALG_ED25519)
    with pytest.raises(UnknownKey):
        note.open_note(note.sign_note(SOFA, w, timestamp=5), [plain])
    short = note.NoteSignature(w.name, w.key_id, sig.signature[8:])
    with pytest.raises(SignatureInvalid):
        note.open_note(note.Note(SOFA, (short,)).encode(), [w.verifier])
    with pytest.raises(ValueError):
        note.sign_note(SOFA, w)  # a cosignature needs a timestamp


def test_a_repeated_signature_line_is_kept_once_when_cosigning() -> None:
    """Go's note.Open drops a repeated signature by one key and note.Sign writes what Open kept: a witness does not
    copy a duplicated line into what it cosigns (the duplicate still verifies, as in Go)."""
    log = note.Signer.generate("example.com/log")
    w = note.Signer.generate("witness.example/w", note.ALG_COSIGNATURE_V1)
    signed = note.sign_checkpoint(note.Checkpoint("example.com/log", 7, bytes(32)), log)
    line = signed[signed.rindex(b"\n\n") + 2:]
    doubled = signed + line
    assert note.verify_checkpoint(doubled, log.verifier).checkpoint.size == 7
    cosigned = note.cosign_checkpoint(doubled, log.verifier, w, timestamp=1)
    assert cosigned.count(line) == 1 and cosigned.startswith(signed)
