"""Receipt-bound locations: where a receipt says the bytes of each of its artifacts are.

Why: equal states share one digest, so a recovered run's checkpoints have the uninterrupted run's digests and the
digest-keyed ``artifact_locations`` cannot say which copy is whose. Verification read the first copy found and
never opened the recovered run's directories. A receipt's own locations let the verifier compare each run from its
own files. New table only: nothing existing changes, and the downgrade drops it (receipts recorded since then keep
their digest-keyed locations, so their bytes can still be found).

Revision ID: 0003_receipt_locations
Revises: 0002_seq_keyed_index_rows
Create Date: 2026-12-01 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_receipt_locations"
down_revision = "0002_seq_keyed_index_rows"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "receipt_locations",
        sa.Column("receipt_seq", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["receipt_seq"], ["receipts.seq"],
                                name=op.f("fk_receipt_locations_receipt_seq_receipts")),
        sa.PrimaryKeyConstraint("receipt_seq", "name", "uri", name=op.f("pk_receipt_locations")),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("receipt_locations")
