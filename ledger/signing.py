"""Operator keys: named Ed25519 key pairs that sign receipt ids, and the key file they live in.

A receipt appended alone is signed over exactly (69 bytes):

    b"training-ledger/receipt-signature/v1" || 0x00 || the receipt id's 32 raw BLAKE3 digest bytes

(the id ``blake3:<64 hex>`` without its prefix, hex-decoded). Receipts appended together (2 to MAX_BATCH of them,
in log order) share one signature over:

    b"training-ledger/receipt-batch-signature/v1" || 0x00 || u32 n (big-endian) || n times the 32 raw id bytes

so a batched append pays one Ed25519 signature per MAX_BATCH receipts instead of one each (benchmarks/README.md,
log_bench). Each of those receipts stores the same signature; the receipts it signs are the ones the ledger stores
it with (tlog.signed_together), and a receipt removed from or added to that set makes the signature fail for all.
A batch of one is the single message: there is one message per set of ids.

The NULs make both domains provably disjoint from every other thing a ledger key may sign: a C2SP signed-note text
forbids control characters, a DSSE PAE starts with "DSSEv1 " and a cosignature/v1 message with "cosignature/v1\\n",
and the two domains differ before their NUL, so no signature can be carried from one to another.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger import digests
from ledger.errors import InputError, quoted
from ledger.note import ALG_ED25519, Signer, Verifier, ed25519_public_key, ed25519_verify
from ledger.transparency_errors import KeyFileExposed, MalformedKey, SignatureInvalid, UnknownKey

RECEIPT_SIGNATURE_DOMAIN = b"training-ledger/receipt-signature/v1\x00"
BATCH_SIGNATURE_DOMAIN = b"training-ledger/receipt-batch-signature/v1\x00"
MAX_BATCH = 1024  # receipts per batch signature: bounds what verifying one of them reads (32 KiB of ids)
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


KEY_FILE_MAX = 4096  # bytes: a key line is under 200; a larger file is not a key file, and is not read whole


def _key_line(path: str | os.PathLike[str], *, private: bool) -> str:
    """The one line of a key file: a regular file (a FIFO cannot block the open) of at most KEY_FILE_MAX ASCII bytes
    holding one non-empty line (a final LF allowed). A private key's file is refused if group or others have any
    access to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # the mode of what was opened, not of a path that could be swapped meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise MalformedKey(f"{os.fspath(path)} is not a regular file")
        if private and st.st_mode & 0o077:
            raise KeyFileExposed(os.fspath(path), mode=stat.S_IMODE(st.st_mode))
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(KEY_FILE_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > KEY_FILE_MAX:
        raise MalformedKey(f"{os.fspath(path)} is not a key file (more than {KEY_FILE_MAX} bytes)")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedKey(f"{os.fspath(path)} is not a key file (not ASCII)") from None
    line = text.removesuffix("\n")
    if "\n" in line or "\r" in line:
        raise MalformedKey(f"{os.fspath(path)} is not a key file (one line)")
    if not line:
        raise MalformedKey(f"{os.fspath(path)} is empty, not a key file")
    return line


def load_private_key(path: str | os.PathLike[str]) -> Signer:
    """Read a key file written by :func:`save_private_key`; refuse it if group or others have any access."""
    line = _key_line(path, private=True)
    try:
        return Signer.from_key(line)
    except MalformedKey as exc:  # say which file: the key string itself is secret and never shown
        what = "a public (verifier) key, not a private one" if not line.startswith("PRIVATE+KEY+") else exc.detail
        raise MalformedKey(f"{os.fspath(path)}: {what}") from None


def load_verifier_key(value: str) -> Verifier:
    """A verifier key of any algorithm (an operator's, a witness's) given as its key string or as a file holding
    one, as ``--log-key`` and ``--witness-key`` take it: an existing path is read as a key file."""
    if os.path.lexists(value):
        line = _key_line(value, private=False)
        try:
            return Verifier.from_key(line)
        except MalformedKey as exc:
            raise MalformedKey(f"{value}: {exc.detail}") from None
    if "+" not in value:
        raise MalformedKey(f"{quoted(value)} is neither a verifier key (<name>+<8 hex digits>+<base64>) nor a file "
                           "holding one")
    return Verifier.from_key(value)


def operator_key(signer: Signer, what: str, *, given: str | None = None) -> Signer:
    """``signer`` if it is an Ed25519 operator key. A witness's key (cosignature/v1) signs cosignatures and nothing
    else: given to sign ``what`` (receipts, log heads, ...) it is refused, InputError (exit 2), before anything is
    signed or appended. ``given`` names where it came from (default: the key's name)."""
    if signer.alg != ALG_ED25519:
        raise InputError(f"{given or f'key {signer.name}'} is a witness (cosignature/v1) key: {what} are signed with "
                         "an Ed25519 operator key")
    return signer


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


def raw_id(receipt_id: str) -> bytes:
    """The 32 digest bytes of a receipt id, which must be exactly ``blake3:`` and 64 lowercase hex digits."""
    if not digests.is_digest(receipt_id):
        digests.check_digest(receipt_id, "receipt id")  # raises MalformedDigest, naming what is wrong
    return bytes.fromhex(receipt_id[7:])


def receipt_message(receipt_id: str) -> bytes:
    """The exact bytes signed for a receipt: domain || 0x00 || 32 raw digest bytes."""
    return RECEIPT_SIGNATURE_DOMAIN + raw_id(receipt_id)


def batch_message(ids: Sequence[str]) -> bytes:
    """The exact bytes signed for receipts signed together, in log order: one id is :func:`receipt_message`."""
    if len(ids) == 1:
        return receipt_message(ids[0])
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"a batch signature signs distinct receipts, got {len(ids)} ids, {len(set(ids))} distinct")
    return b"".join([BATCH_SIGNATURE_DOMAIN, len(ids).to_bytes(4, "big"), *map(raw_id, ids)])


@dataclass(frozen=True)
class ReceiptSignature:
    """An operator's signature over one receipt id, or over ``batch``, the ids signed together with it (log order;
    empty, or the receipt alone: signed alone); ``key`` is the key label ``name+<8 hex key id>``."""

    receipt: str
    key: str
    signature: bytes
    batch: tuple[str, ...] = ()

    @property
    def signed_ids(self) -> tuple[str, ...]:
        return self.batch or (self.receipt,)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"receipt": self.receipt, "key": self.key,
                               "sig": base64.b64encode(self.signature).decode()}
        if len(self.batch) > 1:
            out["batch"] = list(self.batch)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ReceiptSignature:
        if not isinstance(data, dict) or not {"receipt", "key", "sig"} <= set(data) <= {"receipt", "key", "sig",
                                                                                         "batch"}:
            raise MalformedKey("a receipt signature has receipt, key and sig (and batch if signed with others)",
                               expected=["batch?", "key", "receipt", "sig"], actual=repr(data)[:80])
        batch = data.get("batch", [])
        if not all(isinstance(data[k], str) for k in ("receipt", "key", "sig")) or not (
                isinstance(batch, list) and all(isinstance(v, str) for v in batch)):
            raise MalformedKey("receipt signature fields are strings, batch a list of them", actual=repr(data)[:80])
        try:
            sig = base64.b64decode(data["sig"].encode("ascii"), validate=True)
        except ValueError:
            raise MalformedKey("sig is not base64", actual=data["sig"][:80]) from None
        return cls(digests.check_digest(data["receipt"], "receipt id"), data["key"], sig,
                   tuple(digests.check_digest(v, "receipt id") for v in batch))


def sign_receipt(signer: Signer, receipt_id: str) -> ReceiptSignature:
    """Sign a receipt id with an operator key."""
    if signer.alg != ALG_ED25519:
        raise MalformedKey("receipts are signed with an Ed25519 (type 0x01) key", expected=ALG_ED25519,
                           actual=signer.alg)
    return ReceiptSignature(receipt_id, signer.verifier.label, signer.private_key.sign(receipt_message(receipt_id)))


def sign_batch(signer: Signer, ids: Sequence[str]) -> list[tuple[tuple[str, ...], bytes]]:
    """Sign receipts appended together, in log order: one signature per MAX_BATCH of them, each with the ids it signs
    (:func:`batch_message`; a chunk of one gets :func:`sign_receipt`'s bytes)."""
    if signer.alg != ALG_ED25519:
        raise MalformedKey("receipts are signed with an Ed25519 (type 0x01) key", expected=ALG_ED25519,
                           actual=signer.alg)
    sign = signer.private_key.sign
    chunks = [tuple(ids[i:i + MAX_BATCH]) for i in range(0, len(ids), MAX_BATCH)]
    return [(chunk, sign(batch_message(chunk))) for chunk in chunks]


def verify_receipt_signature(signature: ReceiptSignature, verifiers: Verifier | Iterable[Verifier]) -> Verifier:
    """Check a receipt signature against trusted operator keys; returns the key that signed it.

    Raises UnknownKey if no trusted key has its label, SignatureInvalid if that key's signature does not verify
    over the receipt (alone, or with its batch, which must name it).
    """
    trusted = [verifiers] if isinstance(verifiers, Verifier) else list(verifiers)
    by_label = {v.label: v for v in trusted if v.alg == ALG_ED25519}
    verifier = by_label.get(signature.key)
    if verifier is None:
        raise UnknownKey(f"receipt {signature.receipt}", expected=sorted(by_label), actual=[signature.key])
    if signature.receipt not in signature.signed_ids:
        raise SignatureInvalid(f"receipt {signature.receipt}", key=signature.key,
                               expected=f"a batch naming {signature.receipt}",
                               actual=f"a batch of {len(signature.batch)} others", receipt=signature.receipt)
    message = batch_message(signature.signed_ids)
    if not ed25519_verify(ed25519_public_key(verifier.public_key), signature.signature, message):
        # A batch's signature fails for all its receipts when one was removed, added or reordered: say it is one.
        batch = f" (a batch signature, over it and {len(signature.batch) - 1} other receipt(s) stored with it)"
        raise SignatureInvalid(f"receipt {signature.receipt}" + (batch if len(signature.batch) > 1 else ""),
                               key=signature.key, actual=signature.signature, receipt=signature.receipt)
    return verifier
