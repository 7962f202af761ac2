"""The transparency log: receipt signatures, the Merkle log's leaves and nodes, its origin, the checkpoints it issued.

Why: a hash DAG detects accidents, not its keeper; an operator with write access could rewrite a receipt and re-hash
its descendants. Signed receipts and an append-only Merkle log whose signed heads are published elsewhere close that
gap (docs/transparency.md). New tables only: nothing existing changes.

The upgrade builds the log for the receipts already stored, in seq order, each leaf committing to its receipt id
with no signature (none existed before this revision). Such a log proves history only from the upgrade on: whoever
held the database before could have rewritten it, and the log built from it is built from what they left. The leaf
bytes are written out here rather than imported from ledger/tlog.py, so that this revision keeps building the
version-1 leaf whatever later code does; ledger/merkle.py is RFC 9162 and does not change. The downgrade drops the
tables (the receipts keep their ids; their signatures and the log are gone).

Revision ID: 0004_transparency_log
Revises: 0003_receipt_locations
Create Date: 2026-12-05 10:00:00.000000
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

from ledger import merkle
from ledger.digests import is_digest
from ledger.errors import DatabaseError

revision = "0004_transparency_log"
down_revision = "0003_receipt_locations"
branch_labels = None
depends_on = None

_LEAF_DOMAIN = b"training-ledger/log-leaf/v1\x00"
_BATCH = 5000


def upgrade() -> None:
    op.create_table(
        "receipt_signatures",
        sa.Column("receipt_seq", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("signature", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["receipt_seq"], ["receipts.seq"],
                                name=op.f("fk_receipt_signatures_receipt_seq_receipts")),
        sa.PrimaryKeyConstraint("receipt_seq", "key", name=op.f("pk_receipt_signatures")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "log_leaves",
        sa.Column("leaf_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("receipt_seq", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["receipt_seq"], ["receipts.seq"], name=op.f("fk_log_leaves_receipt_seq_receipts")),
        sa.PrimaryKeyConstraint("leaf_index", name=op.f("pk_log_leaves")),
        sa.UniqueConstraint("receipt_seq", name=op.f("uq_log_leaves_receipt_seq")),
    )
    op.create_table(
        "log_nodes",
        sa.Column("pos", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("hash", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("pos", name=op.f("pk_log_nodes")),
    )
    op.create_table(
        "log_info",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("origin", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_log_info")),
    )
    op.create_table(
        "log_checkpoints",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("root", sa.LargeBinary(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("recorded_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_log_checkpoints")),
    )
    conn = op.get_bind()
    conn.execute(sa.text("INSERT INTO log_info (id, origin) VALUES (1, :origin)"),
                 {"origin": "training-ledger/" + secrets.token_hex(16)})
    _build_log(conn)


def _build_log(conn: sa.Connection) -> None:
    """Leaves for every stored receipt in seq order (unsigned), and every complete node, in batches."""
    frontier = merkle.Frontier()
    last = 0
    while True:
        rows = conn.execute(sa.text("SELECT seq, id FROM receipts WHERE seq > :last ORDER BY seq LIMIT :n"),
                            {"last": last, "n": _BATCH}).all()
        if not rows:
            return
        leaves: list[dict[str, object]] = []
        nodes: list[dict[str, object]] = []
        for seq, rid in rows:
            if not is_digest(rid):  # a row edited behind the library's back: refuse rather than log it
                raise DatabaseError(f"receipt at seq {seq} has a malformed id {rid!r}: cannot build the log over it")
            leaf = _LEAF_DOMAIN + bytes.fromhex(rid.removeprefix("blake3:")) + b"\x00"  # no signatures
            leaves.append({"leaf_index": frontier.size, "receipt_seq": seq})
            frontier, new = merkle.append(frontier, merkle.leaf_hash(leaf))
            nodes.extend({"pos": _pos(n.level, n.index), "level": n.level, "idx": n.index, "hash": n.hash}
                         for n in new)
        conn.execute(sa.text("INSERT INTO log_leaves (leaf_index, receipt_seq) VALUES (:leaf_index, :receipt_seq)"),
                     leaves)
        conn.execute(sa.text("INSERT INTO log_nodes (pos, level, idx, hash) VALUES (:pos, :level, :idx, :hash)"),
                     nodes)
        last = rows[-1][0]


def _pos(level: int, idx: int) -> int:
    """A node's post-order position (ledger/tlog.py node_pos, written out here for the same reason as the leaf)."""
    last = ((idx + 1) << level) - 1
    return 2 * last - last.bit_count() + level


def downgrade() -> None:
    for table in ("log_checkpoints", "log_info", "log_nodes", "log_leaves", "receipt_signatures"):
        op.drop_table(table)
