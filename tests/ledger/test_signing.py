"""Operator keys and receipt signatures (ledger/signing.py): key-file modes, exact message bytes, domain separation."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ledger import dsse, note, signing
from ledger.errors import InputError, MalformedDigest, UnsafeFile, VerificationError
from ledger.transparency_errors import KeyFileExposed, MalformedKey, MalformedNote, SignatureInvalid, UnknownKey

RID = "blake3:" + "5e" * 32
OTHER = "blake3:" + "5f" * 32


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """Even with umask 000 a key file is created 0600."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_key_file_is_created_0600(tmp_path: Path, permissive_umask: None) -> None:
    key = signing.generate_key("operator.example/alice")
    path = signing.save_private_key(key, tmp_path / "alice.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert text == key.key() + "\n" and text.startswith("PRIVATE+KEY+operator.example/alice+")
    loaded = signing.load_private_key(path)
    assert loaded.key() == key.key()
    assert signing.sign_receipt(loaded, RID) == signing.sign_receipt(key, RID)  # Ed25519 is deterministic


def test_an_existing_file_or_symlink_is_never_replaced(tmp_path: Path) -> None:
    key = signing.generate_key("a")
    path = tmp_path / "a.key"
    path.write_text("keep me\n")
    with pytest.raises(FileExistsError):
        signing.save_private_key(key, path)
    assert path.read_text() == "keep me\n"
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(FileExistsError):
        signing.save_private_key(key, link)
    assert not (tmp_path / "elsewhere.key").exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o610, 0o601])
def test_a_key_file_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = signing.save_private_key(signing.generate_key("a"), tmp_path / "a.key")
    path.chmod(mode)
    with pytest.raises(KeyFileExposed) as info:
        signing.load_private_key(path)
    err = info.value
    assert isinstance(err, UnsafeFile) and isinstance(err, InputError)
    assert (err.expected, err.actual) == ("0600", f"{mode:04o}")
    assert f"mode {mode:04o}" in str(err) and "chmod 600" in str(err) and "\n" not in str(err)


def test_owner_only_modes_are_accepted(tmp_path: Path) -> None:
    key = signing.generate_key("a")
    path = signing.save_private_key(key, tmp_path / "a.key")
    path.chmod(0o400)
    assert signing.load_private_key(path).name == "a"
    path.chmod(0o600)
    path.write_text(key.key())  # a hand-edited file without its final newline still loads
    assert signing.load_private_key(path).key() == key.key()


def test_malformed_key_files_are_refused(tmp_path: Path) -> None:
    for content in (b"", b"not a key\n", b"\xff\xfe\n", (signing.generate_key("a").key() + "\nextra\n").encode(),
                    (signing.generate_key("a").key() + "\r\n").encode()):
        path = tmp_path / "bad.key"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, content)
        os.close(fd)
        with pytest.raises(MalformedKey):
            signing.load_private_key(path)
    (tmp_path / "dir.key").mkdir(mode=0o700)
    with pytest.raises(MalformedKey):
        signing.load_private_key(tmp_path / "dir.key")


def test_a_file_larger_than_a_key_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, signing.generate_key("a").key().encode() + b" " * signing.KEY_FILE_MAX)
    os.close(fd)
    with pytest.raises(MalformedKey, match=f"more than {signing.KEY_FILE_MAX} bytes"):
        signing.load_private_key(path)


def test_a_verifier_key_given_as_its_string_or_a_file(tmp_path: Path) -> None:
    key = signing.generate_key("operator.example/alice")
    vkey = signing.public_key(key)
    assert signing.load_verifier_key(vkey).key() == vkey
    path = tmp_path / "alice.pub"
    path.write_text(vkey + "\n")
    path.chmod(0o644)  # a public key may be readable by anyone
    assert signing.load_verifier_key(str(path)).key() == vkey
    witness = note.Signer.generate("witness.example", note.ALG_COSIGNATURE_V1)  # any algorithm: witnesses too
    assert signing.load_verifier_key(witness.verifier.key()).alg == note.ALG_COSIGNATURE_V1


def test_a_verifier_key_argument_that_is_neither_is_named(tmp_path: Path) -> None:
    cases = {
        "garbage": "'garbage' is neither a verifier key",
        "x" * 100_000: "(100,000 characters) is neither a verifier key",
        str(tmp_path / "missing.pub"): "missing.pub' is neither a verifier key",
        "a+b+c": "a verifier key is name+<8 hex digits>+base64",
    }
    binary = tmp_path / "binary.pub"
    binary.write_bytes(b"\x80\x04\x95 a pickle, not a key")
    cases[str(binary)] = "binary.pub is not a key file (not ASCII)"
    cases[str(tmp_path)] = "is not a regular file"
    os.mkfifo(tmp_path / "fifo")
    cases[str(tmp_path / "fifo")] = "fifo is not a regular file"  # and the open does not block
    private = signing.save_private_key(signing.generate_key("a"), tmp_path / "a.key")
    cases[str(private)] = "a.key: a private (signer) key, not a verifier key"
    for value, message in cases.items():
        with pytest.raises(MalformedKey) as info:
            signing.load_verifier_key(value)
        line = info.value.one_line()
        assert message in line and len(line) < 300, line
    secret = signing.generate_key("b").key()
    with pytest.raises(MalformedKey) as info:  # the secret half is never echoed, nor kept for --json
        signing.load_verifier_key(secret)
    # PRIVATE+KEY+<name>+<hash>+<base64>: split at most 4 times, as base64 has '+' of its own (and may end in one)
    assert secret.split("+", 4)[-1] not in repr(vars(info.value)) + str(info.value)


# ---------------------------------------------------------------------------------------- signed message


def test_the_signed_message_bytes() -> None:
    message = signing.receipt_message(RID)
    assert message == b"training-ledger/receipt-signature/v1\x00" + bytes.fromhex("5e" * 32)
    assert len(message) == 69
    with pytest.raises(MalformedDigest):
        signing.receipt_message("sha256:" + "5e" * 32)


def test_sign_and_verify() -> None:
    key = signing.generate_key("operator.example/alice")
    verifier = signing.load_public_key(signing.public_key(key))
    sig = signing.sign_receipt(key, RID)
    assert sig.key == f"operator.example/alice+{key.key_id:08x}"
    assert signing.verify_receipt_signature(sig, [verifier]) == verifier
    assert signing.ReceiptSignature.from_dict(sig.to_dict()) == sig
    # the signature of one receipt is not the signature of another
    with pytest.raises(SignatureInvalid) as info:
        signing.verify_receipt_signature(signing.ReceiptSignature(OTHER, sig.key, sig.signature), verifier)
    assert isinstance(info.value, VerificationError) and info.value.receipt == OTHER
    # a key the verifier does not trust, even under the same name
    impostor = signing.generate_key("operator.example/alice")
    with pytest.raises(UnknownKey):
        signing.verify_receipt_signature(signing.sign_receipt(impostor, RID), verifier)


def test_a_receipt_signature_verifies_as_nothing_else() -> None:
    key = signing.generate_key("operator.example/alice")
    sig = signing.sign_receipt(key, RID).signature
    public = Ed25519PublicKey.from_public_bytes(key.verifier.public_key)
    digest = bytes.fromhex("5e" * 32)
    for message in (digest, RID.encode(), b"training-ledger/receipt-signature/v1\n" + digest,
                    dsse.pae(dsse.PAYLOAD_TYPE_IN_TOTO, digest), dsse.pae("application/octet-stream", RID.encode()),
                    b"cosignature/v1\ntime 0\n" + digest):
        with pytest.raises(InvalidSignature):
            public.verify(sig, message)
    # and the message can never be a signed-note text, so a note signature by this key cannot be one either
    with pytest.raises(MalformedNote):
        note.check_text(signing.receipt_message(RID).decode("latin-1") + "\n")


def test_a_note_signature_does_not_verify_as_a_receipt_signature() -> None:
    key = signing.generate_key("operator.example/alice")
    note_sig = note.parse_note(note.sign_note(RID + "\n", key)).signatures[0].signature
    with pytest.raises(SignatureInvalid):
        signing.verify_receipt_signature(signing.ReceiptSignature(RID, key.verifier.label, note_sig), key.verifier)


def test_cosigner_keys_are_not_operator_keys() -> None:
    witness = note.Signer.generate("witness.example/w1", note.ALG_COSIGNATURE_V1)
    with pytest.raises(MalformedKey):
        signing.sign_receipt(witness, RID)
    with pytest.raises(MalformedKey):
        signing.load_public_key(witness.verifier.key())


def test_malformed_receipt_signature_records() -> None:
    good = signing.sign_receipt(signing.generate_key("a"), RID).to_dict()
    for bad in ({**good, "extra": "x"}, {k: v for k, v in good.items() if k != "sig"}, {**good, "sig": "!!"},
                {**good, "receipt": "blake3:zz"}, [good]):
        with pytest.raises((MalformedKey, MalformedDigest)):
            signing.ReceiptSignature.from_dict(bad)


def test_the_batch_message_is_the_specified_bytes() -> None:
    ids = [RID, OTHER, "blake3:" + "60" * 32]
    assert signing.batch_message(ids) == (b"training-ledger/receipt-batch-signature/v1\x00" + (3).to_bytes(4, "big")
                                          + bytes.fromhex("5e" * 32 + "5f" * 32 + "60" * 32))
    assert signing.batch_message([RID]) == signing.receipt_message(RID)  # a batch of one is the single message
    assert not signing.batch_message(ids).startswith(signing.RECEIPT_SIGNATURE_DOMAIN)
    for bad in ([], [RID, RID]):
        with pytest.raises(ValueError, match="distinct"):
            signing.batch_message(bad)
    with pytest.raises(MalformedDigest):
        signing.batch_message([RID, "blake3:" + "5F" * 32])


def test_a_batch_signature_verifies_only_over_its_ids_in_order() -> None:
    key = signing.generate_key("operator")
    ids = [RID, OTHER, "blake3:" + "60" * 32]
    [(chunk, sig)] = signing.sign_batch(key, ids)
    assert chunk == tuple(ids)
    for rid in ids:
        assert signing.verify_receipt_signature(signing.ReceiptSignature(rid, key.verifier.label, sig, chunk),
                                                key.verifier) == key.verifier
    for batch in (tuple(reversed(ids)), chunk[:2], (*chunk, "blake3:" + "61" * 32)):  # reordered, shrunk, grown
        with pytest.raises(SignatureInvalid):
            signing.verify_receipt_signature(signing.ReceiptSignature(RID, key.verifier.label, sig, batch),
                                             key.verifier)
    with pytest.raises(SignatureInvalid, match="does not verify"):  # a batch that does not name the receipt
        signing.verify_receipt_signature(signing.ReceiptSignature("blake3:" + "61" * 32, key.verifier.label, sig,
                                                                  chunk), key.verifier)
    with pytest.raises(SignatureInvalid):  # nor is a batch signature one over a receipt alone
        signing.verify_receipt_signature(signing.ReceiptSignature(RID, key.verifier.label, sig), key.verifier)
    assert signing.sign_batch(key, [RID]) == [((RID,), signing.sign_receipt(key, RID).signature)]
    many = ["blake3:" + f"{i:064x}" for i in range(signing.MAX_BATCH + 1)]
    assert [len(c) for c, _ in signing.sign_batch(key, many)] == [signing.MAX_BATCH, 1]


def test_a_batch_signature_round_trips_as_a_dict() -> None:
    key = signing.generate_key("operator")
    [(chunk, sig)] = signing.sign_batch(key, [RID, OTHER])
    batched = signing.ReceiptSignature(OTHER, key.verifier.label, sig, chunk)
    assert batched.to_dict()["batch"] == [RID, OTHER]
    assert signing.ReceiptSignature.from_dict(batched.to_dict()) == batched
    assert "batch" not in signing.sign_receipt(key, RID).to_dict()
    for bad in ("not a list", [1], ["sha256:" + "00" * 32]):
        with pytest.raises((MalformedKey, MalformedDigest)):
            signing.ReceiptSignature.from_dict({**batched.to_dict(), "batch": bad})
