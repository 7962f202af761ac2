"""Operator keys: named Ed25519 key pairs that sign receipt ids, and the key file they live in.

The signed message, exactly (69 bytes):

    b"training-ledger/receipt-signature/v1" || 0x00 || the receipt id's 32 raw BLAKE3 digest bytes

(the id ``blake3:<64 hex>`` without its prefix, hex-decoded). The NUL makes the domain provably disjoint from every
other thing a ledger key may sign: a C2SP signed-note text forbids control characters, a DSSE PAE starts with
"DSSEv1 " and a cosignature/v1 message with "cosignature/v1\\n", so no signature can be carried from one to another.

Keys are those of :mod:`ledger.note`, so one operator key signs receipts and the log's checkpoints alike:
  key id       the signed-note key id, SHA-256(name || 0x0A || 0x01 || public key)[:4], written as 8 hex digits
  public key   the verifier key string ``<name>+<key id>+base64(0x01 || 32-byte public key)``
  key file     one line, the signer key string ``PRIVATE+KEY+<name>+<key id>+base64(0x01 || 32-byte seed)`` and LF,
               created with O_CREAT|O_EXCL and mode 0600 (never overwritten, never widened); a key file that group
               or others may access in any way is refused, as ssh refuses one.
"""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger import digests
from ledger.note import ALG_ED25519, Signer, Verifier, ed25519_public_key, ed25519_verify
from ledger.transparency_errors import KeyFileExposed, MalformedKey, SignatureInvalid, UnknownKey

RECEIPT_SIGNATURE_DOMAIN = b"training-ledger/receipt-signature/v1\x00"
KEY_FILE_MODE = 0o600


def generate_key(name: str) -> Signer:
    """A new Ed25519 operator key named ``name`` (a signed-note key name, e.g. ``operator.example/alice``)."""
    return Signer.generate(name, ALG_ED25519)


def save_private_key(signer: Signer, path: str | os.PathLike[str]) -> Path:
    """Write the key to a new file of mode 0600; an existing file (or symlink) at ``path`` is never replaced."""
    path = Path(path)
    data = (signer.key() + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, KEY_FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)  # no half-written key left behind
        raise
    os.close(fd)
    return path


def load_private_key(path: str | os.PathLike[str]) -> Signer:
    """Read a key file written by :func:`save_private_key`; refuse it if group or others have any access."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # the mode of what was opened, not of a path that could be swapped meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise MalformedKey(f"{os.fspath(path)} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileExposed(os.fspath(path), mode=stat.S_IMODE(st.st_mode))
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(4096)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedKey(f"{os.fspath(path)} is not a key file (not ASCII)") from None
    line = text.removesuffix("\n")
    if "\n" in line or "\r" in line:
        raise MalformedKey(f"{os.fspath(path)} is not a key file (one line)")
    return Signer.from_key(line)


def public_key(signer: Signer) -> str:
    """The verifier key string to hand to auditors."""
    return signer.verifier.key()


def load_public_key(vkey: str) -> Verifier:
    """Parse a verifier key string (its key id is checked against the key)."""
    verifier = Verifier.from_key(vkey)
    if verifier.alg != ALG_ED25519:
        raise MalformedKey("an operator key is an Ed25519 (type 0x01) key", expected=ALG_ED25519,
                           actual=verifier.alg)
    return verifier


def receipt_message(receipt_id: str) -> bytes:
    """The exact bytes signed for a receipt: domain || 0x00 || 32 raw digest bytes."""
    return RECEIPT_SIGNATURE_DOMAIN + bytes.fromhex(digests.digest_hex(digests.check_digest(receipt_id, "receipt id")))


@dataclass(frozen=True)
class ReceiptSignature:
    """An operator's signature over one receipt id; ``key`` is the key label ``name+<8 hex key id>``."""

    receipt: str
    key: str
    signature: bytes

    def to_dict(self) -> dict[str, str]:
        return {"receipt": self.receipt, "key": self.key, "sig": base64.b64encode(self.signature).decode()}

    @classmethod
    def from_dict(cls, data: Any) -> ReceiptSignature:
        if not isinstance(data, dict) or set(data) != {"receipt", "key", "sig"}:
            raise MalformedKey("a receipt signature has exactly receipt, key and sig",
                               expected=["key", "receipt", "sig"], actual=repr(data)[:80])
        if not all(isinstance(v, str) for v in data.values()):
            raise MalformedKey("receipt signature fields are strings", actual=repr(data)[:80])
        try:
            sig = base64.b64decode(data["sig"].encode("ascii"), validate=True)
        except ValueError:
            raise MalformedKey("sig is not base64", actual=data["sig"][:80]) from None
        return cls(digests.check_digest(data["receipt"], "receipt id"), data["key"], sig)


def sign_receipt(signer: Signer, receipt_id: str) -> ReceiptSignature:
    """Sign a receipt id with an operator key."""
    if signer.alg != ALG_ED25519:
        raise MalformedKey("receipts are signed with an Ed25519 (type 0x01) key", expected=ALG_ED25519,
                           actual=signer.alg)
    return ReceiptSignature(receipt_id, signer.verifier.label, signer.private_key.sign(receipt_message(receipt_id)))


def verify_receipt_signature(signature: ReceiptSignature, verifiers: Verifier | Iterable[Verifier]) -> Verifier:
    """Check a receipt signature against trusted operator keys; returns the key that signed it.

    Raises UnknownKey if no trusted key has its label, SignatureInvalid if that key's signature does not verify.
    """
    trusted = [verifiers] if isinstance(verifiers, Verifier) else list(verifiers)
    by_label = {v.label: v for v in trusted if v.alg == ALG_ED25519}
    verifier = by_label.get(signature.key)
    if verifier is None:
        raise UnknownKey(f"receipt {signature.receipt}", expected=sorted(by_label), actual=[signature.key])
    message = receipt_message(signature.receipt)
    if not ed25519_verify(ed25519_public_key(verifier.public_key), signature.signature, message):
        raise SignatureInvalid(f"receipt {signature.receipt}", key=signature.key, actual=signature.signature,
                               receipt=signature.receipt)
    return verifier
