"""Database rows (SQLAlchemy 2 typed ORM). Rows are not domain objects: a stored row's canonical body is parsed by
``ledger.reads.StoredRow.to_receipt()``, and every other column is an index derived from that body, re-checked by
the verifier.

Any change here needs an Alembic revision in ``migrations/versions`` and a new ``SCHEMA_HEAD`` (ledger/database.py).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The schema revision this code reads and writes lives in ledger/database.py (read there without SQLAlchemy).
from ledger.database import KNOWN_REVISIONS, SCHEMA_HEAD  # noqa: F401  (re-exported)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

DIGEST_LEN = 71  # "blake3:" + 64 hex


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ReceiptRow(Base):
    __tablename__ = "receipts"

    # Append order; the Merkle log (log_leaves, docs/transparency.md) is built over it.
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(DIGEST_LEN), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    run: Mapped[str | None] = mapped_column(String(200))
    rank: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)
    prepared: Mapped[str | None] = mapped_column(String(DIGEST_LEN))
    selection: Mapped[str | None] = mapped_column(String(DIGEST_LEN))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    # When the ledger stored it (ns since the epoch); not part of the receipt's identity.
    recorded_ns: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_receipts_prepared_kind", "prepared", "kind"),
        Index("ix_receipts_run_rank_step", "run", "rank", "step"),
        Index("ix_receipts_kind", "kind"),
        Index("ix_receipts_selection", "selection"),
    )


class ParentRow(Base):
    """One edge of the DAG: the receipt at ``child_seq`` cites the one at ``parent_seq``. Mirrors the body's
    ``parents`` list.

    Keyed by ``receipts.seq``, not by the 71-character ids: a new receipt's edges then land at the end of both
    B-trees instead of at random places in them, which is most of what a batched append costs
    (benchmarks/README.md, ledger_bench). The store and the verifier translate seqs to ids.
    """

    __tablename__ = "receipt_parents"

    child_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), primary_key=True)
    parent_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), primary_key=True)

    # Descendants walk the edges from the parent side. WITHOUT ROWID on SQLite: the primary key is the whole row,
    # so the table is one B-tree instead of a rowid table plus its key index.
    __table_args__ = (Index("ix_receipt_parents_parent_seq", "parent_seq"), {"sqlite_with_rowid": False})


class ArtifactRow(Base):
    """An artifact a receipt refers to. Mirrors the body's ``artifacts`` object.

    No index on ``digest``: nothing looks receipts up by artifact digest, and that index (random 71-character keys)
    cost more than the rest of an append (benchmarks/README.md).
    """

    __tablename__ = "receipt_artifacts"

    receipt_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    digest: Mapped[str] = mapped_column(String(DIGEST_LEN))

    __table_args__ = {"sqlite_with_rowid": False}  # one B-tree keyed by (receipt_seq, name), as for the edges


class LocationRow(Base):
    """Where an artifact's bytes may be found. A lookup, not identity: the verifier re-hashes what it finds."""

    __tablename__ = "artifact_locations"

    digest: Mapped[str] = mapped_column(String(DIGEST_LEN), primary_key=True)
    uri: Mapped[str] = mapped_column(Text, primary_key=True)
    recorded_ns: Mapped[int] = mapped_column(BigInteger)


class ReceiptLocationRow(Base):
    """Where a receipt says the bytes of its artifact ``name`` are: its own evidence (a checkpoint receipt's own
    directory). Equal states share one digest, so the digest's other locations may be another run's copies; the
    verifier re-hashes every location of a digest, and compares runs from each receipt's own locations."""

    __tablename__ = "receipt_locations"

    receipt_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    uri: Mapped[str] = mapped_column(Text, primary_key=True)

    __table_args__ = {"sqlite_with_rowid": False}


# ------------------------------------------------------------------------------- the transparency log (0004)
# docs/transparency.md specifies these tables; ledger/tlog.py writes them inside the append transaction.


class SignatureRow(Base):
    """A signature by the key labelled ``key`` (``name+<8 hex key id>``) over the receipt's id, or over the ids of the
    receipts appended with it (ledger/signing.py; each of them stores the same bytes). Beside the receipt, not in
    its body: the id stays the digest of the body. Written in the receipt's append transaction, and committed to by
    its log leaf."""

    __tablename__ = "receipt_signatures"

    receipt_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), primary_key=True)
    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    signature: Mapped[bytes] = mapped_column(LargeBinary)

    # The index finds the receipts a batch signature signs (0005).
    __table_args__ = (Index("ix_receipt_signatures_signature", "signature"), {"sqlite_with_rowid": False})


class LogLeafRow(Base):
    """Leaf ``leaf_index`` of the Merkle log is the receipt at ``receipt_seq``. Leaf indexes are contiguous from 0
    (seqs may have gaps) and increase with seq: the log's order is the append order."""

    __tablename__ = "log_leaves"

    # Integer like receipts.seq: on SQLite the rowid itself, so the log's size is one B-tree descent away.
    leaf_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    # Unique: a receipt is logged once; the index finds a receipt's leaf for its inclusion proof.
    receipt_seq: Mapped[int] = mapped_column(Integer, ForeignKey("receipts.seq"), unique=True)


class LogNodeRow(Base):
    """A complete node of the Merkle log: the root of the perfect subtree over leaves [idx * 2^level,
    (idx + 1) * 2^level); level 0 holds the leaf hashes. Complete nodes never change, so the table is append-only
    like the log, and every root and proof is read from O(log n) of its rows (ledger/merkle.py).

    Keyed by ``pos``, the node's post-order position (ledger/tlog.py ``node_pos``, a function of level and idx): the
    nodes one append completes have consecutive positions after every earlier node's, so they land together at the
    end of one B-tree (on SQLite the rowid itself) instead of one page per level. ``level`` and ``idx`` are kept
    for readers of the table; nothing looks a node up by them.
    """

    __tablename__ = "log_nodes"

    pos: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    level: Mapped[int] = mapped_column(Integer)
    idx: Mapped[int] = mapped_column(Integer)
    hash: Mapped[bytes] = mapped_column(LargeBinary)


class LogInfoRow(Base):
    """The log's identity: one row, its checkpoint origin line (``training-ledger/<32 hex>``, random at creation,
    so copies and forks of a ledger share it and independent ledgers do not)."""

    __tablename__ = "log_info"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    origin: Mapped[str] = mapped_column(String(200))


class LogCheckpointRow(Base):
    """A checkpoint (signed tree head) this ledger issued: the ledger's own record of the sizes it has claimed,
    which tells a truncated ledger from an older copy (docs/transparency.md, "What verify reports")."""

    __tablename__ = "log_checkpoints"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    size: Mapped[int] = mapped_column(BigInteger)
    root: Mapped[bytes] = mapped_column(LargeBinary)
    note: Mapped[str] = mapped_column(Text)
    recorded_ns: Mapped[int] = mapped_column(BigInteger)
