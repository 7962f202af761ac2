"""C2SP signed notes (c2sp.org/signed-note), tlog checkpoints (c2sp.org/tlog-checkpoint) and witness cosignatures.

A signed note is a text ending in a newline, a blank line, and one or more signature lines
``— <key name> <base64(4-byte key id || signature)>`` (U+2014 EM DASH, space). The whole note is UTF-8 without ASCII
control characters other than newline; the text is everything up to and including the newline before the LAST blank
line. Key id = SHA-256(name || 0x0A || type || public key)[:4], big-endian.

Keys use the strings of Go's golang.org/x/mod/sumdb/note, so keys and notes interoperate with Go tools:
  verifier key  ``<name>+<8 hex key id>+base64(type || 32-byte Ed25519 public key)``
  signer key    ``PRIVATE+KEY+<name>+<8 hex key id>+base64(type || 32-byte Ed25519 seed)``
(split at the first two / four ``+``: the base64 may itself contain ``+``).

Signature types:
  0x01  Ed25519 over the note text (signed-note).
  0x04  Ed25519 witness cosignature/v1 (c2sp.org/tlog-cosignature): the signature is an 8-byte big-endian POSIX
        timestamp followed by Ed25519 over ``"cosignature/v1\\ntime <decimal timestamp>\\n" || note text``. We
        implement this type rather than a plain second Ed25519 signature, so our checkpoints can be cosigned by, and
        checked like, those of other C2SP witnesses. Its verifier key is the standard vkey with type 0x04; its signer
        key uses the PRIVATE+KEY form with type 0x04 (our extension: the spec defines no private key string).

Verification (:func:`open_note`) follows the spec: signatures by unknown (name, key id) pairs are ignored; every
signature by a known key is verified and one that fails rejects the whole note (SignatureInvalid); a note with no
valid signature by a known key is rejected (UnknownKey). At most 100 signatures, as Go allows.

A checkpoint body is: origin line, tree size (ASCII decimal, no leading zeros), base64 root hash, then optional
non-empty extension lines. :func:`parse_checkpoint` refuses anything else, including non-canonical base64. A
witness cosigns only after checking consistency with the last checkpoint it saw: that check is the caller's (it needs
:mod:`ledger.merkle` and storage); :func:`cosign_checkpoint` only verifies the log's signature and signs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from ledger.transparency_errors import (
    CosignatureQuorum,
    LogOriginMismatch,
    MalformedCheckpoint,
    MalformedKey,
    MalformedNote,
    SignatureInvalid,
    UnknownKey,
)

# cryptography is imported only where a key is made or loaded or a signature made or checked: opening a Store, `ledger
# show` and `ledger --help` never need it, and it costs as much to import as the rest of the core (issue 11).
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG_ED25519 = 0x01
ALG_COSIGNATURE_V1 = 0x04
MAX_SIGNATURES = 100
MAX_NOTE_BYTES = 1 << 20  # a checkpoint with MAX_SIGNATURES signatures is a few KB; a file beyond this is not one
SIGNATURE_PREFIX = "\u2014 "  # EM DASH, SPACE
COSIGNATURE_HEADER = "cosignature/v1\n"
_ALGS = {ALG_ED25519: "Ed25519", ALG_COSIGNATURE_V1: "Ed25519 cosignature/v1"}
_MAX_TIMESTAMP = 2**63 - 1


# ------------------------------------------------------------------------------------------------- encoding


def b64decode_strict(text: str, what: str, error: type[MalformedNote] | type[MalformedKey] | type[MalformedCheckpoint]
                     ) -> bytes:
    """Standard base64 with padding, and canonical: one byte string has one accepted encoding (no malleability)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise error(f"{what} is not standard base64", expected="RFC 4648 base64", actual=text[:80]) from None
    if base64.b64encode(raw).decode() != text:
        raise error(f"{what} is not canonical base64", expected=base64.b64encode(raw).decode(), actual=text[:80])
    return raw


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def check_key_name(name: str) -> str:
    """A key name: non-empty, valid UTF-8, no Unicode space, no '+'."""
    if not isinstance(name, str) or not name or "+" in name or any(c.isspace() for c in name):
        raise MalformedKey("a key name is non-empty without spaces or '+'", expected="e.g. example.com/log",
                           actual=repr(name)[:80])
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedKey("a key name is valid UTF-8", actual=repr(name)[:80]) from None
    if any(ord(c) < 0x20 for c in name):
        raise MalformedKey("a key name has no control characters", actual=repr(name)[:80])
    return name


def key_id(name: str, alg: int, public_key: bytes) -> int:
    """SHA-256(name || 0x0A || alg || public key)[:4] as a big-endian uint32."""
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([alg]) + public_key).digest()
    return int.from_bytes(digest[:4], "big")


def _public_bytes(public_key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def ed25519_public_key(raw: bytes) -> Ed25519PublicKey:
    """The cryptography object of a raw 32-byte Ed25519 public key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(raw)


def ed25519_verify(public_key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature over ``message``."""
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _cosigned_message(text: bytes, timestamp: int) -> bytes:
    return f"{COSIGNATURE_HEADER}time {timestamp}\n".encode() + text


def _check_alg(alg: int) -> int:
    if alg not in _ALGS:
        raise MalformedKey("unknown signature type", expected=sorted(_ALGS), actual=alg)
    return alg


# --------------------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Verifier:
    """A public key with its name and signature type: checks signatures on notes."""

    name: str
    public_key: bytes
    alg: int = ALG_ED25519

    def __post_init__(self) -> None:
        check_key_name(self.name)
        _check_alg(self.alg)
        if len(self.public_key) != 32:
            raise MalformedKey("an Ed25519 public key is 32 bytes", expected=32, actual=len(self.public_key))

    @cached_property
    def key_id(self) -> int:
        return key_id(self.name, self.alg, self.public_key)

    @property
    def label(self) -> str:
        """``name+keyid``: how errors and listings name the key."""
        return f"{self.name}+{self.key_id:08x}"

    def key(self) -> str:
        """The verifier key string ``name+hexid+base64(type || public key)``."""
        return f"{self.label}+{_b64(bytes([self.alg]) + self.public_key)}"

    @classmethod
    def from_key(cls, vkey: str) -> Verifier:
        """Parse a verifier key string; its key id must match the name and key."""
        if vkey.strip().startswith("PRIVATE+KEY+"):  # never echoed: the secret half given where the public one goes
            raise MalformedKey("a private (signer) key, not a verifier key: give its public half (ledger keys export)")
        parts = vkey.strip().split("+", 2)
        if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{8}", parts[1]):
            raise MalformedKey("a verifier key is name+<8 hex digits>+base64", actual=vkey[:80])
        name, hex_id, b64 = parts
        raw = b64decode_strict(b64, "verifier key", MalformedKey)
        if len(raw) != 33:
            raise MalformedKey("a verifier key holds a type byte and a 32-byte key", expected=33, actual=len(raw))
        v = cls(name, raw[1:], _check_alg(raw[0]))
        if v.key_id != int(hex_id, 16):
            raise MalformedKey(f"verifier key {name}: key id does not match the key", expected=f"{v.key_id:08x}",
                               actual=hex_id)
        return v

    def verify(self, text: bytes, signature: bytes) -> int | None:
        """Check ``signature`` (the bytes after the key id) over ``text``. Returns the cosignature timestamp (0x04)
        or None (0x01); raises SignatureInvalid."""
        pub = ed25519_public_key(self.public_key)
        timestamp = None
        message = text
        if self.alg == ALG_COSIGNATURE_V1:
            if len(signature) != 8 + 64:
                raise SignatureInvalid("cosignature", key=self.label, expected="72 bytes", actual=len(signature))
            timestamp = int.from_bytes(signature[:8], "big")
            if timestamp > _MAX_TIMESTAMP:
                raise SignatureInvalid("cosignature timestamp", key=self.label, expected=f"<= {_MAX_TIMESTAMP}",
                                       actual=timestamp)
            message, signature = _cosigned_message(text, timestamp), signature[8:]
        if not ed25519_verify(pub, signature, message):
            raise SignatureInvalid("signed note", key=self.label, actual=signature)
        return timestamp


@dataclass(frozen=True, eq=False)
class Signer:
    """A private key with its name and signature type: signs notes. Keep :meth:`key` secret."""

    name: str
    private_key: Ed25519PrivateKey
    alg: int = ALG_ED25519

    def __post_init__(self) -> None:
        check_key_name(self.name)
        _check_alg(self.alg)

    @classmethod
    def generate(cls, name: str, alg: int = ALG_ED25519) -> Signer:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(name, Ed25519PrivateKey.generate(), alg)

    @cached_property
    def verifier(self) -> Verifier:
        # Worked out once per signer: deriving the public key and its key id cost as much as a signature.
        return Verifier(self.name, _public_bytes(self.private_key.public_key()), self.alg)

    @property
    def key_id(self) -> int:
        return self.verifier.key_id

    def key(self) -> str:
        """The signer key string ``PRIVATE+KEY+name+hexid+base64(type || seed)``."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        seed = self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"PRIVATE+KEY+{self.verifier.label}+{_b64(bytes([self.alg]) + seed)}"

    @classmethod
    def from_key(cls, skey: str) -> Signer:
        """Parse a signer key string; its key id must match the public key derived from the seed."""
        parts = skey.strip().split("+", 4)
        if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"] or not re.fullmatch(r"[0-9a-f]{8}", parts[3]):
            # never echo the input: it may be a private key
            raise MalformedKey("a signer key is PRIVATE+KEY+name+<8 hex digits>+base64")
        _, _, name, hex_id, b64 = parts
        try:
            raw = base64.b64decode(b64.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise MalformedKey("a signer key ends in standard base64") from None
        if len(raw) != 33:
            raise MalformedKey("a signer key holds a type byte and a 32-byte seed", expected=33, actual=len(raw))
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        signer = cls(name, Ed25519PrivateKey.from_private_bytes(raw[1:]), _check_alg(raw[0]))
        if signer.key_id != int(hex_id, 16):
            raise MalformedKey(f"signer key {name}: key id does not match the key", expected=f"{signer.key_id:08x}",
                               actual=hex_id)
        return signer

    def sign(self, text: bytes, *, timestamp: int | None = None) -> bytes:
        """The signature bytes that follow the key id: Ed25519(text), or timestamp || Ed25519(cosigned message)."""
        if self.alg == ALG_COSIGNATURE_V1:
            if timestamp is None or not 0 <= timestamp <= _MAX_TIMESTAMP:
                raise ValueError(f"a cosignature needs a POSIX timestamp in [0, 2^63-1], got {timestamp!r}")
            return timestamp.to_bytes(8, "big") + self.private_key.sign(_cosigned_message(text, timestamp))
        return self.private_key.sign(text)


# -------------------------------------------------------------------------------------------------- notes


@dataclass(frozen=True)
class NoteSignature:
    """One signature line, parsed but not verified."""

    name: str
    key_id: int
    signature: bytes

    @property
    def label(self) -> str:
        return f"{self.name}+{self.key_id:08x}"

    def line(self) -> str:
        return f"{SIGNATURE_PREFIX}{self.name} {_b64(self.key_id.to_bytes(4, 'big') + self.signature)}\n"


@dataclass(frozen=True)
class Note:
    """A note text and its signature lines, in order."""

    text: str
    signatures: tuple[NoteSignature, ...] = ()

    def encode(self) -> bytes:
        """The signed note's bytes: text, blank line, signature lines."""
        check_text(self.text)
        if not self.signatures:
            raise MalformedNote("a signed note has at least one signature line", expected=">= 1", actual=0)
        return (self.text + "\n" + "".join(s.line() for s in self.signatures)).encode()


def _check_chars(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedNote(f"{what} is not valid UTF-8") from None
    for i, c in enumerate(text):
        if ord(c) < 0x20 and c != "\n":
            raise MalformedNote(f"{what} has a control character at offset {i}", expected="none but newline",
                                actual=f"U+{ord(c):04X}")


def check_text(text: str) -> str:
    """A note text: non-empty, ends in a newline, no control characters but newline."""
    if not isinstance(text, str) or not text.endswith("\n"):
        raise MalformedNote("a note text ends in a newline", expected="'\\n' at the end", actual=repr(text[-20:]))
    _check_chars(text, "the note text")
    return text


def parse_note(data: bytes | str) -> Note:
    """Split a signed note into text and signature lines, checking syntax only (no signature is verified)."""
    if len(data) > MAX_NOTE_BYTES:
        raise MalformedNote("larger than a signed note may be", expected=f"<= {MAX_NOTE_BYTES:,} bytes",
                            actual=len(data))
    if isinstance(data, bytes):
        try:
            msg = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedNote(f"not valid UTF-8 at byte {e.start}") from None
    else:
        msg = data
    _check_chars(msg, "the note")
    split = msg.rfind("\n\n")
    if split < 0:
        raise MalformedNote("no blank line between text and signatures", expected="text, blank line, signatures")
    text, block = msg[:split + 1], msg[split + 2:]
    if not block or not block.endswith("\n"):
        raise MalformedNote("the signature block is empty or does not end in a newline",
                            expected="'— name base64' lines ending in '\\n'", actual=repr(block[-40:]))
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise MalformedNote("too many signatures", expected=f"<= {MAX_SIGNATURES}", actual=len(lines))
    sigs = []
    for n, line in enumerate(lines, 1):
        if not line.startswith(SIGNATURE_PREFIX):
            raise MalformedNote(f"signature line {n} does not start with an em dash and a space",
                                expected=repr(SIGNATURE_PREFIX), actual=repr(line[:20]))
        name, sep, b64 = line[len(SIGNATURE_PREFIX):].partition(" ")
        try:
            check_key_name(name)
        except MalformedKey:
            raise MalformedNote(f"signature line {n} has an invalid key name", actual=repr(name[:80])) from None
        if not sep or not b64:
            raise MalformedNote(f"signature line {n} has no signature", expected="'— name base64'",
                                actual=repr(line[:80]))
        raw = b64decode_strict(b64, f"signature line {n}", MalformedNote)
        if len(raw) < 5:
            raise MalformedNote(f"signature line {n} is shorter than a key id and a signature", expected=">= 5 bytes",
                                actual=len(raw))
        sigs.append(NoteSignature(name, int.from_bytes(raw[:4], "big"), raw[4:]))
    return Note(text, tuple(sigs))


def sign_note(note: Note | str, *signers: Signer, timestamp: int | None = None) -> bytes:
    """Sign a text (or add signatures to a note) and return the signed note's bytes.

    Existing signatures stay first, except those by the same (name, key id) as a new signer, which are replaced,
    and repeats of one line, kept once (as Go's note.Sign, after Open dropped them); new signature lines follow in
    the order given. ``timestamp`` is required when a signer makes cosignatures.
    """
    if isinstance(note, str):
        note = Note(note)
    text = check_text(note.text).encode()
    if not signers and not note.signatures:
        raise ValueError("sign_note needs at least one signer")
    new = [NoteSignature(s.name, s.key_id, s.sign(text, timestamp=timestamp)) for s in signers]
    replaced = {(s.name, s.key_id) for s in new}
    kept = [s for s in dict.fromkeys(note.signatures) if (s.name, s.key_id) not in replaced]
    return Note(note.text, (*kept, *new)).encode()


@dataclass(frozen=True)
class VerifiedSignature:
    """A signature that verified: by whom, which type, and (cosignatures) when."""

    name: str
    key_id: int
    alg: int
    timestamp: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name}+{self.key_id:08x}"


@dataclass(frozen=True)
class OpenedNote:
    """A verified note: its text, the signatures that verified, and those by unknown keys (kept, not trusted)."""

    text: str
    verified: tuple[VerifiedSignature, ...]
    unverified: tuple[NoteSignature, ...]


def _verifier_map(verifiers: Iterable[Verifier]) -> dict[tuple[str, int], Verifier]:
    out: dict[tuple[str, int], Verifier] = {}
    for v in verifiers:
        other = out.setdefault((v.name, v.key_id), v)
        if other != v:
            raise MalformedKey(f"two verifier keys share the name and key id {v.label}", expected=other.key(),
                               actual=v.key())
    return out


def open_note(data: bytes | str, verifiers: Iterable[Verifier]) -> OpenedNote:
    """Parse and verify a signed note against trusted ``verifiers``.

    Signatures by unknown keys are ignored (returned as ``unverified``); a failing signature by a known key raises
    SignatureInvalid; no valid signature by a known key raises UnknownKey. The text must be trusted only after this.
    """
    note = parse_note(data)
    known = _verifier_map(verifiers)
    text = note.text.encode()
    verified: dict[tuple[str, int], VerifiedSignature] = {}
    unverified: dict[NoteSignature, None] = {}
    for sig in note.signatures:
        v = known.get((sig.name, sig.key_id))
        if v is None:
            unverified.setdefault(sig)
            continue
        timestamp = v.verify(text, sig.signature)  # every signature by a known key is checked, duplicates included
        verified.setdefault((sig.name, sig.key_id), VerifiedSignature(sig.name, sig.key_id, v.alg, timestamp))
    if not verified:
        raise UnknownKey("signed note", expected=sorted(v.label for v in known.values()),
                         actual=[s.label for s in note.signatures])
    return OpenedNote(note.text, tuple(verified.values()), tuple(unverified))


# -------------------------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class Checkpoint:
    """A log's signed tree head: origin, tree size, root hash, optional opaque extension lines."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        return format_checkpoint(self)


_SIZE = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def format_checkpoint(checkpoint: Checkpoint, *, hash_size: int = 32) -> str:
    """The checkpoint's note text; it re-parses to the same checkpoint or this raises."""
    lines = [checkpoint.origin, str(checkpoint.size), _b64(checkpoint.root), *checkpoint.extensions]
    text = "".join(line + "\n" for line in lines)
    if parse_checkpoint(text, hash_size=hash_size) != checkpoint:
        raise MalformedCheckpoint("the checkpoint does not survive a round trip", expected=checkpoint.origin,
                                  actual=text[:80])
    return text


def parse_checkpoint(text: str, *, hash_size: int = 32) -> Checkpoint:
    """Parse a checkpoint body strictly: non-empty lines, origin, decimal size < 2^64, canonical base64 root of
    ``hash_size`` bytes, then non-empty extension lines."""
    try:
        check_text(text)
    except MalformedNote as e:
        raise MalformedCheckpoint(e.detail, expected=e.expected, actual=e.actual) from None
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise MalformedCheckpoint("a checkpoint has at least three lines (origin, size, root)", expected=">= 3",
                                  actual=len(lines))
    for n, line in enumerate(lines, 1):
        if not line:
            raise MalformedCheckpoint(f"line {n} is empty", expected="non-empty lines", actual=repr(text[:80]))
    origin, size_line, root_line, *extensions = lines
    if not _SIZE.fullmatch(size_line) or int(size_line) >= 2**64:
        raise MalformedCheckpoint("the tree size is not a decimal < 2^64 without leading zeros",
                                  expected="e.g. 20852163", actual=size_line[:40])
    root = b64decode_strict(root_line, "root hash", MalformedCheckpoint)
    if len(root) != hash_size:
        raise MalformedCheckpoint(f"the root hash is not {hash_size} bytes", expected=hash_size, actual=len(root))
    return Checkpoint(origin, int(size_line), root, tuple(extensions))


def sign_checkpoint(checkpoint: Checkpoint, *signers: Signer, timestamp: int | None = None) -> bytes:
    """The checkpoint as a signed note (the log's key name SHOULD equal the origin)."""
    return sign_note(format_checkpoint(checkpoint), *signers, timestamp=timestamp)


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose log signature verified, with the witness cosignatures that verified."""

    checkpoint: Checkpoint
    log_signature: VerifiedSignature
    cosignatures: tuple[VerifiedSignature, ...]
    note: OpenedNote


def verify_checkpoint(data: bytes | str, log: Verifier, *, witnesses: Iterable[Verifier] = (), quorum: int = 0,
                      origin: str | None = None, hash_size: int = 32) -> VerifiedCheckpoint:
    """Verify a signed checkpoint: the log's signature, the body's syntax, the origin if given, and at least
    ``quorum`` valid cosignatures among ``witnesses`` (other signatures are ignored)."""
    witnesses = tuple(witnesses)
    opened = open_note(data, (log, *witnesses))
    by_key = {(s.name, s.key_id): s for s in opened.verified}
    log_sig = by_key.get((log.name, log.key_id))
    if log_sig is None:
        raise UnknownKey("checkpoint", expected=[log.label], actual=[s.label for s in opened.verified])
    checkpoint = parse_checkpoint(opened.text, hash_size=hash_size)
    if origin is not None and checkpoint.origin != origin:
        raise LogOriginMismatch(expected=origin, actual=checkpoint.origin)
    cosigs = tuple(by_key[(w.name, w.key_id)] for w in witnesses if (w.name, w.key_id) in by_key)
    if len(cosigs) < quorum:
        raise CosignatureQuorum(checkpoint.origin, expected=quorum, actual=[s.label for s in cosigs])
    return VerifiedCheckpoint(checkpoint, log_sig, cosigs, opened)


def cosign_checkpoint(data: bytes | str, log: Verifier, witness: Signer, *, timestamp: int) -> bytes:
    """Add a witness's cosignature to a checkpoint signed by ``log``, keeping every existing signature.

    The caller must first have checked consistency with the last checkpoint this witness cosigned for the origin.
    """
    verify_checkpoint(data, log)
    return sign_note(parse_note(data), witness, timestamp=timestamp)

