"""The transparency log's bytes and rows: the leaf encoding, the node table read through a connection, and the
incremental append the store runs inside its append transaction (docs/transparency.md specifies all of it).

The log is an RFC 9162 Merkle tree (SHA-256, :mod:`ledger.merkle`) over the receipts in append order. Leaf i is

    b"training-ledger/log-leaf/v1" || 0x00 || the receipt id's 32 raw bytes || u8 k
        || k times, sorted by key label: u16 len(label) || label (UTF-8) || u16 len(sig) || sig

(big-endian lengths; ``label`` is the signing key's ``name+<8 hex key id>``; ``sig`` the Ed25519 signature of
ledger/signing.py over the receipt alone or over the batch appended with it). So a leaf commits to the receipt and to
who signed it when it was appended: a signature added, removed or changed later no longer matches the log. The NUL
after the domain keeps leaf bytes disjoint from every other message a ledger key signs or hashes (signed-note texts
have no control characters, the receipt-signature domains differ, DSSE's PAE starts with "DSSEv1 ").

Rows (ledger/models.py): ``log_leaves`` (leaf index -> receipt seq; indexes contiguous from 0, seqs increasing but
not contiguous), ``log_nodes`` (pos, level, idx, hash) holding every complete node (level 0: the leaf hashes) keyed
by post-order position, and ``receipt_signatures``. Nothing here keeps state between transactions: the frontier a
new leaf needs is re-read from ``log_nodes`` (popcount(size) rows, one query), so any number of writers share one log
under the write lock.

This module is the store's; it imports no store, so :mod:`ledger.transparency` (the log seen through a Store) and the
verifier can stand on both.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from ledger import merkle
from ledger.database import copy_rows, driver_cursor
from ledger.errors import VerificationError
from ledger.note import Signer
from ledger.reads import CursorReads, DriverReads, Reads, marks, scalar, stored_bytes
from ledger.signing import raw_id, sign_batch

if TYPE_CHECKING:
    from sqlalchemy import Connection

# Reads take any ledger/reads.py Reads (a verifier's, or the append path's own transaction); the append path writes
# through SQLAlchemy (imported there) or, on SQLite, the driver's cursor.

LEAF_DOMAIN: Final = b"training-ledger/log-leaf/v1\x00"
_HASHED_LEAF_DOMAIN: Final = b"\x00" + LEAF_DOMAIN  # RFC 9162's leaf prefix, then the leaf bytes' domain
ORIGIN_PREFIX: Final = "training-ledger/"
MAX_SIGNATURES: Final = 255  # the leaf's one-byte count
_CHUNK = 400  # (level, idx) pairs per query: two bound parameters each, under SQLite's default limit of 999
_sha256 = hashlib.sha256


class LeafSignature(NamedTuple):
    """One signature a leaf commits to: the key label and the signature bytes (as stored)."""

    key: str
    signature: bytes

    @classmethod
    def stored(cls, key: object, signature: object) -> LeafSignature:
        """A receipt_signatures row's key and signature as stored, whatever types a writer gave them (the key as
        its text, the signature as :func:`~ledger.reads.stored_bytes`): the check then fails on them, not the read."""
        return cls(key if type(key) is str else str(key), stored_bytes(signature))


class LogEntry(NamedTuple):
    """What one leaf is made of: the receipt's seq and id and the signatures stored with it."""

    seq: int
    receipt: str
    signatures: tuple[LeafSignature, ...] = ()


class LogCorrupt(VerificationError):
    """The log's own rows are inconsistent (a node or a leaf row missing, indexes not contiguous): tampered with."""

    def __init__(self, detail: str, *, expected: Any = None, actual: Any = None, receipt: str | None = None) -> None:
        super().__init__(f"transparency log corrupt: {detail}", receipt=receipt, field="log", expected=expected,
                         actual=actual)
        self.detail = detail


# ------------------------------------------------------------------------------------------------- leaf bytes


_Sig = TypeVar("_Sig", bound=tuple[str, bytes])


def in_key_order(signatures: Iterable[_Sig]) -> list[_Sig]:
    """Signatures in the order a leaf holds them: by their key label's UTF-8 bytes."""
    return sorted(signatures, key=lambda s: s[0].encode())


def leaf_bytes(receipt_id: str, signatures: Iterable[LeafSignature | tuple[str, bytes]] = ()) -> bytes:
    """The exact bytes of a receipt's leaf (see the module docstring)."""
    sigs = in_key_order(signatures)
    if len(sigs) > MAX_SIGNATURES:
        raise ValueError(f"a leaf commits to at most {MAX_SIGNATURES} signatures, got {len(sigs)}")
    out = [LEAF_DOMAIN, raw_id(receipt_id), bytes([len(sigs)])]
    for key, sig in sigs:
        label = key.encode("utf-8")
        out += [len(label).to_bytes(2, "big"), label, len(sig).to_bytes(2, "big"), bytes(sig)]
    return b"".join(out)


def leaf_hash(receipt_id: str, signatures: Iterable[LeafSignature | tuple[str, bytes]] = ()) -> bytes:
    """SHA-256(0x00 || leaf bytes): the leaf's hash in the tree."""
    return merkle.leaf_hash(leaf_bytes(receipt_id, signatures))


def entry_hash(entry: LogEntry) -> bytes:
    return leaf_hash(entry.receipt, entry.signatures)


# ------------------------------------------------------------------------------------------------- node reader


def node_pos(level: int, idx: int) -> int:
    """The post-order position of node (level, idx): ``2 L - popcount(L) + level`` with ``L = (idx + 1) 2^level - 1``
    its last leaf (the numbering of a Merkle mountain range). Leaf L and the nodes it completes are numbered
    consecutively, after every node completed before, so ``log_nodes`` only ever grows at its end."""
    last = ((idx + 1) << level) - 1
    return 2 * last - last.bit_count() + level


class DbNodes:
    """The ``log_nodes`` table as a :class:`~ledger.merkle.BatchNodeReader`, read through one transaction (so a
    proof and the size it is for come from one snapshot). A missing node is :class:`LogCorrupt`."""

    def __init__(self, reads: Reads) -> None:
        self.source = reads
        self.reads = 0  # nodes fetched, for the O(log n) claims of tests and benchmarks

    def node(self, level: int, index: int) -> bytes:
        return self.nodes([(level, index)])[0]

    def nodes(self, addresses: Sequence[merkle.Address]) -> list[bytes]:
        wanted = list(dict.fromkeys(addresses))
        found: dict[merkle.Address, bytes] = {}
        for i in range(0, len(wanted), _CHUNK):
            chunk = wanted[i:i + _CHUNK]
            by_pos = {node_pos(level, idx): (level, idx) for level, idx in chunk}
            rows = self.source.all(f"SELECT pos, hash FROM log_nodes WHERE pos IN ({marks(len(by_pos))})",
                                   tuple(by_pos))
            found.update((by_pos[pos], stored_bytes(h)) for pos, h in rows)
        self.reads += len(wanted)
        missing = [a for a in wanted if a not in found]
        if missing:
            raise LogCorrupt(f"node (level {missing[0][0]}, index {missing[0][1]}) is missing from log_nodes",
                             expected="a stored node", actual=None)
        return [found[a] for a in addresses]


class Fold:
    """A compact range [0, size) as a stack of perfect-subtree hashes (ledger/merkle.py's Frontier without its
    objects per leaf): what a verifier folds a million recomputed leaves into, in leaf order."""

    __slots__ = ("size", "stack")

    def __init__(self) -> None:
        self.size = 0
        self.stack: list[bytes] = []

    def add(self, leaf: bytes) -> None:
        h, i = leaf, self.size
        while i & 1:
            h = _sha256(b"\x01" + self.stack.pop() + h).digest()
            i >>= 1
        self.stack.append(h)
        self.size += 1

    def root(self) -> bytes:
        return merkle.root_of_frontier(merkle.Frontier(self.size, tuple(self.stack)))


# ------------------------------------------------------------------------------------------------------- reads


def log_size(reads: Reads) -> int:
    """The number of leaves (leaf indexes are contiguous from 0: the last one's plus one, read as the append path
    reads it)."""
    top = reads.all(_LAST_LEAF)
    return int(top[0][0]) + 1 if top else 0


_ORIGIN = "SELECT origin FROM log_info WHERE id = 1"


def origin(reads: Reads) -> str | None:
    """The log's checkpoint origin line (None in a database adopted from ``create_all``: migration 0004 stores
    one; :func:`create_origin` makes it)."""
    found = scalar(reads, _ORIGIN)
    return None if found is None else str(found)


def create_origin(conn: Connection) -> str:
    """The origin, a new random one stored first if there is none, in the caller's write transaction."""
    driver = DriverReads(conn)
    found = origin(driver)
    if found is None:
        found = new_origin()
        driver.all("INSERT INTO log_info (id, origin) VALUES (1, ?)", (found,))
    return found


def new_origin() -> str:
    """A fresh origin: copies and forks of a ledger keep it, independent ledgers never share it."""
    return ORIGIN_PREFIX + secrets.token_hex(16)


def signatures_by_seq(reads: Reads, seqs: Sequence[int]) -> dict[int, tuple[LeafSignature, ...]]:
    """The stored signatures of the receipts at ``seqs`` (receipts without any are absent)."""
    out: dict[int, list[LeafSignature]] = {}
    for i in range(0, len(seqs), _CHUNK):
        chunk = list(seqs[i:i + _CHUNK])
        for seq, key, sig in reads.all("SELECT receipt_seq, key, signature FROM receipt_signatures "
                                       f"WHERE receipt_seq IN ({marks(len(chunk))})", chunk):
            out.setdefault(seq, []).append(LeafSignature.stored(key, sig))
    return {seq: tuple(in_key_order(sigs)) for seq, sigs in out.items()}


# ------------------------------------------------------------------------------------------------------ append

_SIGNED_TOGETHER = ("SELECT r.id FROM receipt_signatures s JOIN receipts r ON r.seq = s.receipt_seq "
                    "WHERE s.signature = ? AND s.key = ? ORDER BY s.receipt_seq")
_LAST_LEAF = "SELECT leaf_index, receipt_seq FROM log_leaves ORDER BY leaf_index DESC LIMIT 1"
_SQLITE_INSERT_SIGNATURES = "INSERT INTO receipt_signatures (receipt_seq, key, signature) VALUES (?, ?, ?)"
_SQLITE_INSERT_LEAVES = "INSERT INTO log_leaves (leaf_index, receipt_seq) VALUES (?, ?)"
_SQLITE_INSERT_NODES = "INSERT INTO log_nodes (pos, level, idx, hash) VALUES (?, ?, ?, ?)"


def sign_ids(signer: Signer, ids: Sequence[str]) -> Mapping[str, tuple[LeafSignature, ...]]:
    """The signatures by ``signer`` of receipts appended together (in log order, ledger/signing.py's batch
    signatures: one per MAX_BATCH receipts), per id, ready for :func:`append_leaves`."""
    label = signer.verifier.label
    out: dict[str, tuple[LeafSignature, ...]] = {}
    for chunk, sig in sign_batch(signer, ids):
        shared = (LeafSignature(label, sig),)
        out.update(dict.fromkeys(chunk, shared))
    return out


def signed_together(reads: Reads, key: str, signature: bytes) -> tuple[str, ...]:
    """The ids of the receipts stored with ``signature`` by ``key``, in log order: the receipts it must sign."""
    return tuple(str(rid) for rid, in reads.all(_SIGNED_TOGETHER, (signature, key)))


def append_leaves(conn: Connection, entries: Sequence[LogEntry]) -> int:
    """Store each entry's signatures and append its leaf, in order, inside the caller's write transaction; returns
    the new size. Entries must come in seq order after the last logged receipt (the log's order is the append
    order; the store appends a batch parents first)."""
    if conn.dialect.name == "sqlite":
        # Straight to the driver's cursor, in the caller's transaction: SQLAlchemy's per-statement work cost more
        # than the five statements themselves (benchmarks/log_bench.py).
        with driver_cursor(conn, "append to log_leaves, log_nodes, receipt_signatures") as cur:
            return _append_sqlite(cur, entries)
    # Elsewhere (PostgreSQL) the rows go in by COPY, in the caller's transaction (ledger.database.copy_rows).
    reads = DriverReads(conn)
    top = reads.all(_LAST_LEAF)
    size, sig_rows, leaf_rows, node_rows = _leaf_rows(reads, top[0] if top else None, entries)
    copy_rows(conn, "receipt_signatures", ("receipt_seq", "key", "signature"), sig_rows)
    copy_rows(conn, "log_leaves", ("leaf_index", "receipt_seq"), leaf_rows)
    copy_rows(conn, "log_nodes", ("pos", "level", "idx", "hash"), node_rows)
    return size


def _append_sqlite(cur: Any, entries: Sequence[LogEntry]) -> int:
    size, sig_rows, leaf_rows, node_rows = _leaf_rows(CursorReads(cur), cur.execute(_LAST_LEAF).fetchone(),
                                                      entries)
    for sql, rows in ((_SQLITE_INSERT_SIGNATURES, sig_rows), (_SQLITE_INSERT_LEAVES, leaf_rows),
                      (_SQLITE_INSERT_NODES, node_rows)):
        if rows:
            _insert_many(cur, sql, rows)
    return size


_MAX_PARAMETERS: Final = 999  # SQLite's default limit before 3.32; later versions allow more


def _insert_many(cur: Any, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """``executemany(sql, rows)``, as statements of many rows each (``VALUES (...), (...), ...``) while a full
    statement's worth remains: one step of the driver per statement instead of per row, about 40% less time for
    the log's rows (benchmarks/README.md, log_bench)."""
    width = len(rows[0])
    per = _MAX_PARAMETERS // width
    full = len(rows) - len(rows) % per
    if full:
        many = _multi_row(sql, width, per)
        for i in range(0, full, per):
            cur.execute(many, [value for row in rows[i:i + per] for value in row])
    if full < len(rows):
        cur.executemany(sql, rows[full:])


@functools.cache
def _multi_row(sql: str, width: int, count: int) -> str:
    one = "(" + ", ".join("?" * width) + ")"
    return sql.replace(one, ", ".join([one] * count))


_Rows = tuple[int, list[tuple[int, str, bytes]], list[tuple[int, int]], list[tuple[int, int, int, bytes]]]


def _leaf_rows(reads: Reads, top: Any, entries: Sequence[LogEntry]) -> _Rows:
    """The new size and the signature, leaf and node rows for ``entries`` after the last leaf ``top``."""
    size, last = (0, 0) if top is None else (int(top[0]) + 1, int(top[1]))
    if not entries:
        return size, [], [], []
    previous = last
    for e in entries:
        if e.seq <= previous:
            raise ValueError(f"log entries must follow the last logged seq {last} in increasing seq order, got "
                             f"{[x.seq for x in entries]}")
        previous = e.seq
    # The frontier's hashes, re-read from the stored nodes; then ledger/merkle.py's append loop inlined (the
    # same fold, SHA-256 as the log specifies) without a frozen Frontier and Node objects per leaf.
    stack = list(merkle.frontier_at(DbNodes(reads), size).hashes)
    sig_rows: list[tuple[int, str, bytes]] = []
    leaf_rows: list[tuple[int, int]] = []
    node_rows: list[tuple[int, int, int, bytes]] = []
    pos = node_pos(0, size)  # the new nodes' positions follow one another from the new leaf's
    heads: dict[str, bytes] = {}  # u16 len(label) || label, per label: a batch has one signer
    for e in entries:
        sigs = e.signatures
        leaf_rows.append((size, e.seq))
        # leaf_bytes' layout, written out for the unsigned and the singly signed leaf (every append's): its generic
        # sort and loop cost as much as the leaf's two hashes. tests/ledger/test_transparency.py holds them equal.
        if not sigs:
            h = _sha256(_HASHED_LEAF_DOMAIN + raw_id(e.receipt) + b"\x00").digest()
        elif len(sigs) == 1:
            key, sig = sigs[0]
            head = heads.get(key)
            if head is None:
                label = key.encode("utf-8")
                head = heads[key] = len(label).to_bytes(2, "big") + label
            sig_rows.append((e.seq, key, sig))
            h = _sha256(b"".join((_HASHED_LEAF_DOMAIN, raw_id(e.receipt), b"\x01", head,
                                  len(sig).to_bytes(2, "big"), sig))).digest()
        else:
            sig_rows.extend((e.seq, s.key, s.signature) for s in sigs)
            h = _sha256(b"\x00" + leaf_bytes(e.receipt, sigs)).digest()
        node_rows.append((pos, 0, size, h))
        level, i = 0, size
        while i & 1:
            h = _sha256(b"\x01" + stack.pop() + h).digest()
            level += 1
            i >>= 1
            pos += 1
            node_rows.append((pos, level, i, h))
        stack.append(h)
        size += 1
        pos += 1
    return size, sig_rows, leaf_rows, node_rows
