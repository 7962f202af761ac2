"""Initial schema: receipts, their parent edges and artifacts, and artifact locations.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30 05:48:11.892828
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "artifact_locations",
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("recorded_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("digest", "uri", name=op.f("pk_artifact_locations")),
    )
    op.create_table(
        "receipts",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=71), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("run", sa.String(length=200), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("prepared", sa.String(length=71), nullable=True),
        sa.Column("selection", sa.String(length=71), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("recorded_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_receipts")),
        sa.UniqueConstraint("id", name=op.f("uq_receipts_id")),
    )
    with op.batch_alter_table("receipts", schema=None) as batch_op:
        batch_op.create_index("ix_receipts_kind", ["kind"], unique=False)
        batch_op.create_index("ix_receipts_prepared_kind", ["prepared", "kind"], unique=False)
        batch_op.create_index("ix_receipts_run_rank_step", ["run", "rank", "step"], unique=False)
        batch_op.create_index("ix_receipts_selection", ["selection"], unique=False)

    op.create_table(
        "receipt_artifacts",
        sa.Column("receipt", sa.String(length=71), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.ForeignKeyConstraint(["receipt"], ["receipts.id"], name=op.f("fk_receipt_artifacts_receipt_receipts")),
        sa.PrimaryKeyConstraint("receipt", "name", name=op.f("pk_receipt_artifacts")),
    )
    with op.batch_alter_table("receipt_artifacts", schema=None) as batch_op:
        batch_op.create_index("ix_receipt_artifacts_digest", ["digest"], unique=False)

    op.create_table(
        "receipt_parents",
        sa.Column("child", sa.String(length=71), nullable=False),
        sa.Column("parent", sa.String(length=71), nullable=False),
        sa.ForeignKeyConstraint(["child"], ["receipts.id"], name=op.f("fk_receipt_parents_child_receipts")),
        sa.ForeignKeyConstraint(["parent"], ["receipts.id"], name=op.f("fk_receipt_parents_parent_receipts")),
        sa.PrimaryKeyConstraint("child", "parent", name=op.f("pk_receipt_parents")),
    )
    with op.batch_alter_table("receipt_parents", schema=None) as batch_op:
        batch_op.create_index("ix_receipt_parents_parent", ["parent"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("receipt_parents", schema=None) as batch_op:
        batch_op.drop_index("ix_receipt_parents_parent")

    op.drop_table("receipt_parents")
    with op.batch_alter_table("receipt_artifacts", schema=None) as batch_op:
        batch_op.drop_index("ix_receipt_artifacts_digest")

    op.drop_table("receipt_artifacts")
    with op.batch_alter_table("receipts", schema=None) as batch_op:
        batch_op.drop_index("ix_receipts_selection")
        batch_op.drop_index("ix_receipts_run_rank_step")
        batch_op.drop_index("ix_receipts_prepared_kind")
        batch_op.drop_index("ix_receipts_kind")

    op.drop_table("receipts")
    op.drop_table("artifact_locations")
