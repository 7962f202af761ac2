"""Key parent edges and artifact rows by the integer receipts.seq instead of 71-character ids; drop the index on
artifact digests.

Why: every batched append inserted each receipt's edges and artifacts at random places in four B-trees keyed by
digest strings, which made appends about 0.1x raw sqlite3 (benchmarks/README.md, ledger_bench). Keyed by seq they
land at the ends of their B-trees. Nothing queries receipts by artifact digest, so that index goes. On SQLite both
tables are WITHOUT ROWID (their primary key is the row): one B-tree each instead of two.

The rows are carried over through a scratch table (``_index_rows_0002``), because on PostgreSQL the old table's
primary-key index keeps its name after a rename and would clash with the new table's. Every old row must map to
stored receipts; an edge or artifact row citing an id that is not in ``receipts`` (possible only by editing the
file with foreign keys off) stops the migration, so nothing is dropped silently.

Revision ID: 0002_seq_keyed_index_rows
Revises: 0001_initial
Create Date: 2026-11-30 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.errors import DatabaseError

revision = "0002_seq_keyed_index_rows"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

_SCRATCH = "_index_rows_0002"


def _count(table: str) -> int:
    return int(op.get_bind().execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def _carry(table: str, select_sql: str, columns: list[sa.Column[object]], what: str) -> None:
    """Copy ``select_sql`` (the old rows re-keyed) into a scratch table, refusing if any old row does not map."""
    op.create_table(_SCRATCH, *columns)
    names = ", ".join(c.name for c in columns)
    op.execute(f"INSERT INTO {_SCRATCH} ({names}) {select_sql}")
    old, carried = _count(table), _count(_SCRATCH)
    if carried != old:
        raise DatabaseError(
            f"{table}: {old - carried} of {old} row(s) cite a {what} that is not in receipts (the file was edited "
            f"with foreign keys off); run `ledger verify` on the receipts that cite them and repair the ledger first"
        )


def _refill(table: str, columns: list[str]) -> None:
    names = ", ".join(columns)
    op.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {_SCRATCH}")
    op.drop_table(_SCRATCH)


def upgrade() -> None:
    _carry(
        "receipt_parents",
        "SELECT c.seq, p.seq FROM receipt_parents e "
        "JOIN receipts c ON c.id = e.child JOIN receipts p ON p.id = e.parent",
        [sa.Column("child_seq", sa.Integer(), nullable=False), sa.Column("parent_seq", sa.Integer(), nullable=False)],
        "receipt id",
    )
    op.drop_index("ix_receipt_parents_parent", table_name="receipt_parents")
    op.drop_table("receipt_parents")
    op.create_table(
        "receipt_parents",
        sa.Column("child_seq", sa.Integer(), nullable=False),
        sa.Column("parent_seq", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["child_seq"], ["receipts.seq"], name=op.f("fk_receipt_parents_child_seq_receipts")),
        sa.ForeignKeyConstraint(["parent_seq"], ["receipts.seq"],
                                name=op.f("fk_receipt_parents_parent_seq_receipts")),
        sa.PrimaryKeyConstraint("child_seq", "parent_seq", name=op.f("pk_receipt_parents")),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_receipt_parents_parent_seq", "receipt_parents", ["parent_seq"], unique=False)
    _refill("receipt_parents", ["child_seq", "parent_seq"])

    _carry(
        "receipt_artifacts",
        "SELECT r.seq, a.name, a.digest FROM receipt_artifacts a JOIN receipts r ON r.id = a.receipt",
        [sa.Column("receipt_seq", sa.Integer(), nullable=False), sa.Column("name", sa.String(200), nullable=False),
         sa.Column("digest", sa.String(71), nullable=False)],
        "receipt id",
    )
    op.drop_index("ix_receipt_artifacts_digest", table_name="receipt_artifacts")
    op.drop_table("receipt_artifacts")
    op.create_table(
        "receipt_artifacts",
        sa.Column("receipt_seq", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.ForeignKeyConstraint(["receipt_seq"], ["receipts.seq"],
                                name=op.f("fk_receipt_artifacts_receipt_seq_receipts")),
        sa.PrimaryKeyConstraint("receipt_seq", "name", name=op.f("pk_receipt_artifacts")),
        sqlite_with_rowid=False,
    )
    _refill("receipt_artifacts", ["receipt_seq", "name", "digest"])


def downgrade() -> None:
    _carry(
        "receipt_parents",
        "SELECT c.id, p.id FROM receipt_parents e "
        "JOIN receipts c ON c.seq = e.child_seq JOIN receipts p ON p.seq = e.parent_seq",
        [sa.Column("child", sa.String(71), nullable=False), sa.Column("parent", sa.String(71), nullable=False)],
        "receipt seq",
    )
    op.drop_index("ix_receipt_parents_parent_seq", table_name="receipt_parents")
    op.drop_table("receipt_parents")
    op.create_table(
        "receipt_parents",
        sa.Column("child", sa.String(length=71), nullable=False),
        sa.Column("parent", sa.String(length=71), nullable=False),
        sa.ForeignKeyConstraint(["child"], ["receipts.id"], name=op.f("fk_receipt_parents_child_receipts")),
        sa.ForeignKeyConstraint(["parent"], ["receipts.id"], name=op.f("fk_receipt_parents_parent_receipts")),
        sa.PrimaryKeyConstraint("child", "parent", name=op.f("pk_receipt_parents")),
    )
    op.create_index("ix_receipt_parents_parent", "receipt_parents", ["parent"], unique=False)
    _refill("receipt_parents", ["child", "parent"])

    _carry(
        "receipt_artifacts",
        "SELECT r.id, a.name, a.digest FROM receipt_artifacts a JOIN receipts r ON r.seq = a.receipt_seq",
        [sa.Column("receipt", sa.String(71), nullable=False), sa.Column("name", sa.String(200), nullable=False),
         sa.Column("digest", sa.String(71), nullable=False)],
        "receipt seq",
    )
    op.drop_table("receipt_artifacts")
    op.create_table(
        "receipt_artifacts",
        sa.Column("receipt", sa.String(length=71), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.ForeignKeyConstraint(["receipt"], ["receipts.id"], name=op.f("fk_receipt_artifacts_receipt_receipts")),
        sa.PrimaryKeyConstraint("receipt", "name", name=op.f("pk_receipt_artifacts")),
    )
    op.create_index("ix_receipt_artifacts_digest", "receipt_artifacts", ["digest"], unique=False)
    _refill("receipt_artifacts", ["receipt", "name", "digest"])
