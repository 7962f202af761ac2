"""The transparency log seen through a :class:`~ledger.store.Store`: operator keys on disk and in the ledger, the
log's heads (signed C2SP checkpoints), its proofs, and in-toto attestations of a receipt. docs/transparency.md is
the specification; ledger/tlog.py holds the bytes and rows the store writes inside its append transaction.

Keys. A private key is a 0600 file ``<dir>/<NAME>.key`` (ledger/signing.py's format) in a key directory: ``--dir``,
else ``$LEDGER_KEYS``, else ``~/.config/training-ledger/keys``; never in the database. A public key is registered in
the ledger by a ``key`` receipt (:func:`key_receipt`), signed by the key itself, so who may sign is itself evidence
and is ordered by the log like everything else.

Heads. :func:`sign_head` signs the current checkpoint (origin ``training-ledger/<32 hex>``, the ledger's size and
SHA-256 root) as a signed note with the operator key and records it in ``log_checkpoints``: the ledger's own record
of the sizes it claimed, which verify uses to tell a truncated ledger from an older copy.

The main job. :func:`operator_setup` creates the operator key under ``<workdir>/keys/`` (once) and registers it;
:func:`export_head` writes the final head to a file. Both are runner-free: the experiment calls them.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ledger import digests, merkle, note, tlog
from ledger.artifacts import ArtifactStore, atomic_write
from ledger.database import expand_home
from ledger.errors import (
    DigestMismatch,
    InputError,
    LedgerError,
    LookupFailed,
    RecordInvalid,
    RecordMismatch,
    UnknownReceipt,
    VerificationError,
    os_error_line,
)
from ledger.reads import Reads, stored_bytes
from ledger.receipts import Kind, Receipt, make_receipt
from ledger.rules import KEY_FORMAT, KEY_REVOCATION_FORMAT
from ledger.signing import (
    ReceiptSignature,
    generate_key,
    load_private_key,
    load_public_key,
    operator_key,
    save_private_key,
)
from ledger.store import Store, Stored
from ledger.tlog import LeafSignature, LogCorrupt
from ledger.transparency_errors import KeyDirectoryExposed

if TYPE_CHECKING:
    from ledger import dsse

ENV_KEYS: Final = "LEDGER_KEYS"
DEFAULT_KEYS_DIR: Final = Path("~/.config/training-ledger/keys")
KEY_SUFFIX: Final = ".key"
# A key's file name is its name: a signed-note key name that is also a safe file name (no '/', no '+', no space).
KEY_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
OPERATOR_KEY: Final = "operator"
PREDICATE_TYPE: Final = "https://training-ledger.example/attestation/receipt/v1"


class UnknownKeyFile(LookupFailed):
    """No key file of that name in the key directory (exit 3)."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(f"no key {name!r} in {directory} (create it with `ledger keys new {name}`)")
        self.name = name
        self.directory = directory


class KeyLabelConflict(VerificationError):
    """Two registered keys share a label (name and 32-bit key id): a signature could not say which one signed."""

    def __init__(self, label: str, *, expected: str, actual: str, receipt: str) -> None:
        super().__init__(f"receipt {receipt}: registers a second key labelled {label} (a different key has that "
                         f"name and key id)", receipt=receipt, field="measurements.key", expected=expected,
                         actual=actual)


class NotInLog(VerificationError):
    """A receipt without a leaf: stored behind the library's back, after the log it should be in."""

    def __init__(self, receipt: str, seq: int) -> None:
        super().__init__(f"receipt {receipt} (seq {seq}) is not in the transparency log: it was stored without the "
                         f"library", receipt=receipt, field="log", expected="a leaf", actual=None)


# ------------------------------------------------------------------------------------------------ key directory


@dataclass(frozen=True)
class KeyFile:
    """A key in a key directory: its name, its file, and its public half."""

    name: str
    path: Path
    verifier: note.Verifier

    @property
    def witness(self) -> bool:
        return self.verifier.alg == note.ALG_COSIGNATURE_V1


def keys_dir(given: str | os.PathLike[str] | None = None) -> Path:
    """``given``, else ``$LEDGER_KEYS``, else ``~/.config/training-ledger/keys``."""
    value = os.fspath(given) if given is not None else os.environ.get(ENV_KEYS) or str(DEFAULT_KEYS_DIR)
    return expand_home(value)


def key_directory(given: str | os.PathLike[str] | None = None) -> Path:
    """:func:`keys_dir`, refused (InputError) when something other than a directory is there: a file given as the
    directory is named, not taken for an empty directory or for a key that exists."""
    return digests.absent_or_directory(keys_dir(given), "key directory")  # none yet: `keys new` makes it


def key_path(name: str, directory: str | os.PathLike[str] | None = None) -> Path:
    if not isinstance(name, str) or not KEY_NAME_RE.fullmatch(name):
        raise InputError(f"key name {name!r}: expected 1 to 100 of A-Z a-z 0-9 . _ - (starting with a letter or "
                         f"digit)")
    return key_directory(directory) / f"{name}{KEY_SUFFIX}"


def create_key(name: str, directory: str | os.PathLike[str] | None = None, *, witness: bool = False
               ) -> tuple[note.Signer, Path]:
    """A new Ed25519 key in a new 0600 file (an existing one is never replaced: FileExistsError), in a directory
    made 0700 if new; an existing one that group or others may write to is refused (KeyDirectoryExposed), the way
    the key files themselves are. ``witness`` makes a cosignature/v1 key (a witness's), which cannot sign receipts or
    log heads."""
    path = key_path(name, directory)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.parent.stat().st_mode)
    if mode & 0o022:
        raise KeyDirectoryExposed(os.fspath(path.parent), mode=mode)
    signer = note.Signer.generate(name, note.ALG_COSIGNATURE_V1) if witness else generate_key(name)
    return signer, save_private_key(signer, path)


def load_key(name: str, directory: str | os.PathLike[str] | None = None) -> note.Signer:
    """The key ``name`` from the key directory (refused if group or others may read it)."""
    path = key_path(name, directory)
    if not path.exists():
        raise UnknownKeyFile(name, path.parent)
    return load_private_key(path)


@dataclass(frozen=True)
class UnusableKeyFile:
    """A key file of a key directory that does not load (exposed, malformed, unreadable) and what loading it raised."""

    name: str
    path: Path
    error: LedgerError | OSError

    @property
    def problem(self) -> str:
        e = self.error
        return e.one_line() if isinstance(e, LedgerError) else os_error_line(e, self.path)


def list_keys(directory: str | os.PathLike[str] | None = None) -> tuple[list[KeyFile], list[UnusableKeyFile]]:
    """Every key file of the directory, by name, loaded; those that do not load apart, each with its error, so that
    one bad file hides no other key."""
    root = key_directory(directory)
    if not root.is_dir():
        return [], []
    out: list[KeyFile] = []
    unusable: list[UnusableKeyFile] = []
    for path in sorted(root.glob(f"*{KEY_SUFFIX}")):
        name = path.name.removesuffix(KEY_SUFFIX)
        if KEY_NAME_RE.fullmatch(name):
            try:
                out.append(KeyFile(name, path, load_private_key(path).verifier))
            except (LedgerError, OSError) as exc:
                unusable.append(UnusableKeyFile(name, path, exc))
    return out, unusable


# ------------------------------------------------------------------------------------------ keys in the ledger


def key_receipt(verifier: note.Verifier, *, rank: int | None = None, run: str | None = None) -> Receipt:
    """The receipt registering ``verifier`` (an Ed25519 operator or rank key)."""
    return make_receipt(Kind.KEY, run=run, rank=rank, measurements={"format": KEY_FORMAT, "key": verifier.key()})


def register_key(store: Store, signer: note.Signer, *, rank: int | None = None, run: str | None = None) -> Stored:
    """Append the key's registration, signed by the key itself (idempotent: the same registration is one receipt).
    Only operator keys are registered: a witness's key is refused before a receipt is made."""
    return store.append(key_receipt(operator_key(signer, "key registrations").verifier, rank=rank, run=run),
                        signer=signer)


@dataclass(frozen=True)
class RegisteredKey:
    """A key registered in the ledger: the key, the receipt registering it first, and that receipt's leaf."""

    verifier: note.Verifier
    receipt: str
    leaf_index: int


@dataclass(frozen=True)
class LoggedKeyReceipt:
    """A key receipt (a registration or a revocation) as the ledger holds it: its row, its leaf and its receipt."""

    seq: int
    leaf_index: int
    receipt: Receipt


def logged_key_receipts(store: Store) -> list[LoggedKeyReceipt]:
    """Every key receipt of the ledger, registrations and revocations, in log order. Each one's id is recomputed
    from its body first (a body edited to swap the key is a DigestMismatch); one outside the log is NotInLog."""
    with store.reading() as reads:
        rows = reads.all("SELECT r.seq, r.id, r.body, l.leaf_index FROM receipts r LEFT OUTER JOIN log_leaves l "
                         "ON l.receipt_seq = r.seq WHERE r.kind = ? ORDER BY r.seq", (Kind.KEY.value,))
    out: list[LoggedKeyReceipt] = []
    for seq, rid, body, leaf in sorted(rows, key=lambda r: (r[3] is None, r[3] if r[3] is not None else r[0])):
        body = stored_bytes(body)
        actual = digests.receipt_id(body)
        if actual != rid:
            raise DigestMismatch("receipt id does not recompute from the stored body", expected=rid, actual=actual,
                                 receipt=rid, field="body")
        if leaf is None:
            raise NotInLog(rid, seq)
        receipt = Receipt.from_bytes(body)
        receipt.__dict__["id"] = actual  # the digest of its body, just computed: fills the cached_property
        if receipt.kind != Kind.KEY.value:  # a row's kind column edited to 'key'
            raise RecordMismatch(rid, "kind", expected=receipt.kind, actual=Kind.KEY.value)
        if not isinstance(receipt.measurements.get("key"), str):  # a body written behind the library's back
            raise RecordInvalid.at(f"key receipt {rid} names no key", receipt=rid, field="measurements.key",
                                   expected="a public key", actual=receipt.measurements.get("key"))
        out.append(LoggedKeyReceipt(int(seq), int(leaf), receipt))
    return out


def registered_keys(store: Store) -> dict[str, RegisteredKey]:
    """Every registered key by label, at its first registration in log order (the key receipts as
    :func:`logged_key_receipts` checks them); a second key with the label of another is KeyLabelConflict."""
    out: dict[str, RegisteredKey] = {}
    for logged in logged_key_receipts(store):
        measurements = logged.receipt.measurements
        if measurements.get("format") == KEY_REVOCATION_FORMAT:
            continue  # a revocation registers nothing (ledger/revocation.py)
        verifier = load_public_key(measurements["key"])
        rid = logged.receipt.id
        have = out.get(verifier.label)
        if have is None:
            out[verifier.label] = RegisteredKey(verifier, rid, logged.leaf_index)
        elif have.verifier != verifier:
            raise KeyLabelConflict(verifier.label, expected=have.verifier.key(), actual=verifier.key(), receipt=rid)
    return out


# ------------------------------------------------------------------------------------------------ the log's reads


def log_origin(store: Store) -> str:
    """The log's origin line (every checkpoint of this ledger and of its copies starts with it)."""
    with store.reading() as reads:
        found = tlog.origin(reads)
    if found is None:  # a database adopted from create_all, never written since: its first append creates it
        with store.engine.execution_options(ledger_write=True).begin() as conn:
            found = tlog.create_origin(conn)
    return found


def checkpoint_of(reads: Reads, origin: str) -> note.Checkpoint:
    """The checkpoint of the log as this read transaction sees it."""
    size = tlog.log_size(reads)
    return note.Checkpoint(origin, size, merkle.root_at(tlog.DbNodes(reads), size))


def current_checkpoint(store: Store) -> note.Checkpoint:
    """The checkpoint (origin, size, root) of the ledger as it is now; not signed."""
    origin = log_origin(store)
    with store.reading() as reads:
        return checkpoint_of(reads, origin)


def sign_head(store: Store, signer: note.Signer, *, record: bool = True) -> bytes:
    """The current checkpoint as a signed note (C2SP tlog-checkpoint in a signed-note) by ``signer``. With ``record``
    (and a writable ledger) it is also kept in ``log_checkpoints``."""
    operator_key(signer, "log heads")
    checkpoint = current_checkpoint(store)
    signed = note.sign_checkpoint(checkpoint, signer)
    if record and store.readonly is None:
        from sqlalchemy import insert

        from ledger.models import LogCheckpointRow

        with store.engine.execution_options(ledger_write=True).begin() as conn:
            conn.execute(insert(LogCheckpointRow), {"size": checkpoint.size, "root": checkpoint.root,
                                                    "note": signed.decode(), "recorded_ns": time.time_ns()})
    return signed


def export_head(store: Store, signer: note.Signer, path: str | os.PathLike[str]) -> note.Checkpoint:
    """Sign the current head (:func:`sign_head`, recorded) and write it to ``path`` atomically; returns it."""
    signed = sign_head(store, signer)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, signed)
    return note.parse_checkpoint(note.parse_note(signed).text)


def issued_checkpoints(store: Store) -> list[note.Checkpoint]:
    """The checkpoints this ledger says it issued, oldest first (the operator can edit this: a hint, not proof)."""
    with store.reading() as reads:
        rows = [text for text, in reads.all("SELECT note FROM log_checkpoints ORDER BY seq")]
    out = []
    for text in rows:
        try:
            out.append(note.parse_checkpoint(note.parse_note(text).text))
        except InputError:  # an edited row is not a checkpoint this ledger issued
            continue
    return out


@dataclass(frozen=True)
class Inclusion:
    """Receipt ``receipt`` is leaf ``leaf_index`` of the tree of ``size`` leaves: ``proof`` from its leaf hash."""

    receipt: str
    leaf_index: int
    size: int
    leaf_hash: bytes
    signatures: tuple[LeafSignature, ...]
    proof: tuple[bytes, ...]

    def verify(self, root: bytes) -> None:
        merkle.verify_inclusion(self.leaf_hash, self.leaf_index, self.size, self.proof, root)


def leaf_of(reads: Reads, rid: str) -> tuple[int, tlog.LogEntry]:
    """The leaf index and log entry (id and stored signatures) of receipt ``rid``; NotInLog / UnknownReceipt."""
    rows = reads.all("SELECT r.seq, l.leaf_index FROM receipts r LEFT OUTER JOIN log_leaves l "
                     "ON l.receipt_seq = r.seq WHERE r.id = ?", (rid,))
    if not rows:
        raise UnknownReceipt(rid)
    seq, leaf = rows[0]
    if leaf is None:
        raise NotInLog(rid, seq)
    sigs = tlog.signatures_by_seq(reads, [seq]).get(seq, ())
    return int(leaf), tlog.LogEntry(seq, rid, sigs)


def inclusion(reads: Reads, rid: str, size: int) -> Inclusion:
    """The inclusion proof of receipt ``rid`` in the tree of ``size`` leaves (ceil(log2 size) node reads at most),
    its leaf hash recomputed from the id and the signatures stored with it."""
    index, entry = leaf_of(reads, rid)
    if index >= size:
        raise LogCorrupt(f"receipt {rid} is leaf {index}, beyond the tree of {size} leaves", expected=f"< {size}",
                         actual=index, receipt=rid)
    proof = merkle.inclusion_proof(tlog.DbNodes(reads), index, size)
    return Inclusion(rid, index, size, tlog.entry_hash(entry), entry.signatures, tuple(proof))


def consistency(reads: Reads, size1: int, size2: int) -> list[bytes]:
    """The consistency proof from the tree of ``size1`` leaves to the tree of ``size2`` (O(log size2) node reads)."""
    return merkle.consistency_proof(tlog.DbNodes(reads), size1, size2)


@dataclass(frozen=True, slots=True)
class LoggedRow:
    """One leaf as stored, for verification: its receipt row (None where the row is gone), the signatures stored
    with it, and the leaf hash the node table holds for it (None where that node is gone)."""

    leaf_index: int
    seq: int
    receipt: str | None
    body: bytes | None
    signatures: tuple[LeafSignature, ...]
    stored_hash: bytes | None


_LOGGED = ("SELECT l.leaf_index, l.receipt_seq, r.id, r.body FROM log_leaves l "
           "LEFT JOIN receipts r ON r.seq = l.receipt_seq "
           "WHERE l.leaf_index >= ? ORDER BY l.leaf_index LIMIT ?")
_SIGS_IN_RANGE = "SELECT receipt_seq, key, signature FROM receipt_signatures WHERE receipt_seq BETWEEN ? AND ?"
# The leaf hashes of a run of leaves: one range of positions (each leaf's nodes sit between it and the next leaf).
_LEAF_HASHES_IN_RANGE = "SELECT idx, hash FROM log_nodes WHERE pos BETWEEN ? AND ? AND level = 0"


def iter_logged(reads: Reads, *, batch: int = 5000, bodies: bool = True) -> Iterator[LoggedRow]:
    """Every leaf in leaf order with its receipt row, signatures and stored leaf hash, streamed in batches from one
    read transaction (its snapshot); ``bodies=False`` skips the receipt bodies."""
    sql = _LOGGED if bodies else _LOGGED.replace("r.body", "NULL")
    start = 0
    while True:
        rows = reads.all(sql, (start, batch))
        if not rows:
            return
        for leaf, seq, *_ in rows:  # integers as the schema declares them, unless a writer stored other values there
            if type(leaf) is not int or type(seq) is not int:
                raise LogCorrupt(f"a log_leaves row holds ({leaf!r}, {seq!r}), not a leaf index and a receipt seq",
                                 expected="two integers", actual=f"{leaf!r}, {seq!r}")
        seqs = [r[1] for r in rows]
        sigs: dict[int, list[LeafSignature]] = {}
        for seq, key, sig in reads.all(_SIGS_IN_RANGE, (min(seqs), max(seqs))):
            sigs.setdefault(seq, []).append(LeafSignature.stored(key, sig))
        first, last = rows[0][0], rows[-1][0]
        hashes = {int(i): stored_bytes(h) for i, h in reads.all(_LEAF_HASHES_IN_RANGE, (
            tlog.node_pos(0, first), tlog.node_pos(0, last)))}
        for leaf, seq, rid, body in rows:
            mine = tuple(tlog.in_key_order(sigs.get(seq, ())))
            yield LoggedRow(leaf, seq, rid, None if body is None else stored_bytes(body), mine, hashes.get(leaf))
        start = rows[-1][0] + 1


def unlogged_receipts(reads: Reads, limit: int = 1) -> list[tuple[int, str]]:
    """(seq, id) of receipts that have no leaf (none, unless rows were written behind the library's back)."""
    return [(int(s), str(i)) for s, i in reads.all(
        "SELECT r.seq, r.id FROM receipts r LEFT JOIN log_leaves l ON l.receipt_seq = r.seq "
        "WHERE l.leaf_index IS NULL ORDER BY r.seq LIMIT ?", (limit,))]


# --------------------------------------------------------------------------------------------------- main job


def operator_key_path(workdir: str | os.PathLike[str]) -> Path:
    """Where the main job keeps its operator key: ``<workdir>/keys/operator.key``."""
    return Path(workdir) / "keys" / f"{OPERATOR_KEY}{KEY_SUFFIX}"


def operator_setup(workdir: str | os.PathLike[str], db: str | os.PathLike[str] | None = None) -> note.Signer:
    """The experiment's operator key: created as ``<workdir>/keys/operator.key`` (0600) if absent, and registered
    by a ``key`` receipt in the ledger ``db`` (default ``<workdir>/ledger.db``, created if absent) unless it is
    registered already. Call before anything else is appended, so that every later receipt may be signed by it."""
    path = operator_key_path(workdir)
    if path.exists():
        signer = load_private_key(path)
    else:
        signer, _ = create_key(OPERATOR_KEY, path.parent)
    with Store.open(db if db is not None else Path(workdir) / "ledger.db", create=True) as store:
        register_key(store, signer)
    return signer


# ------------------------------------------------------------------------------------------------ attestations


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def attestation_statement(store: Store, artifacts: ArtifactStore, ref: str, signer: note.Signer) -> dict[str, Any]:
    """The in-toto Statement v1 attesting receipt ``ref``: subjects are the receipt's canonical bytes (named by its
    id) and every artifact whose bytes are found as a file (re-hashed: wrong bytes are a DigestMismatch, never
    attested), each with ``sha256`` and ``blake3``; the predicate holds the receipt, its signatures (a batch
    signature with the ids it signs) and its inclusion proof against a checkpoint signed now by ``signer``
    (docs/transparency.md, "Attestations")."""
    from ledger import dsse

    stored = store.get(ref)
    receipt = stored.receipt
    head = sign_head(store, signer)
    checkpoint = note.parse_checkpoint(note.parse_note(head).text)
    with store.reading() as conn:
        proof = inclusion(conn, receipt.id, checkpoint.size)
        # signing.py's encoding of each (a batch signature with the ids it signs: an offline verifier needs them)
        signatures = [{k: v for k, v in ReceiptSignature(receipt.id, s.key, s.signature, tlog.signed_together(
            conn, s.key, s.signature)).to_dict().items() if k != "receipt"} for s in proof.signatures]
    proof.verify(checkpoint.root)  # never attest what the head does not include
    subjects = [dsse.subject(receipt.id, sha256=hashlib.sha256(receipt.body).hexdigest(),
                             blake3=digests.digest_hex(digests.raw_digest(receipt.body)))]
    not_subjects: dict[str, str] = {}
    for name, digest in sorted(receipt.artifacts.items()):
        if name == receipt.id:
            raise InputError(f"receipt {receipt.id}: an artifact named like the receipt's id cannot be a subject")
        found = _artifact_file(store, artifacts, receipt.id, name, digest)
        if found is None:
            not_subjects[name] = "no file holds its bytes (a checkpoint directory, a component or missing)"
            continue
        subjects.append(dsse.subject(name, sha256=found, blake3=digest))
    predicate = {
        "receipt": digests.parse_canonical(receipt.body),
        "receipt_id": receipt.id,
        "signatures": signatures,
        "log": {"checkpoint": head.decode(), "leaf_index": proof.leaf_index,
                "inclusion_proof": [_b64(h) for h in proof.proof]},
        "not_subjects": not_subjects,
    }
    return dsse.statement(subjects, PREDICATE_TYPE, predicate)


def _artifact_file(store: Store, artifacts: ArtifactStore, rid: str, name: str, digest: str) -> str | None:
    """The sha256 (hex) of the first regular file holding artifact ``name``'s bytes, checked against its BLAKE3
    digest; None when no file holds them."""
    for path in artifacts.candidates(digest, store.evidence_locations(rid, name, digest)):
        if not path.is_file() or path.is_symlink():
            continue
        actual = digests.file_digest(path, follow_symlinks=False)
        if actual != digest:
            raise DigestMismatch(f"artifact {name!r} at {path}", expected=digest, actual=actual, receipt=rid,
                                 field=f"artifacts.{name}")
        sha = hashlib.sha256()
        with open(path, "rb") as f:  # a second pass: BLAKE3 above is the check, this only names the bytes
            while chunk := f.read(1 << 20):
                sha.update(chunk)
        return sha.hexdigest()
    return None


def export_attestation(store: Store, artifacts: ArtifactStore, ref: str, signer: note.Signer) -> dsse.Envelope:
    """:func:`attestation_statement` in a DSSE envelope signed by ``signer`` (keyid: its label)."""
    from ledger import dsse

    operator_key(signer, "attestations")
    stmt = attestation_statement(store, artifacts, ref, signer)
    return dsse.sign_statement(stmt, {signer.verifier.label: signer.private_key})
