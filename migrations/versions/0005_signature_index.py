"""An index on receipt_signatures.signature: which receipts one batch signature signs.

Why: a batched append now stores one Ed25519 signature for up to 1,024 receipts (ledger/signing.py); verifying any
one of them rebuilds the signed message from the receipts stored with the same signature, which without this index
would scan every signature row of the ledger. Nothing else changes: signatures already stored are single-receipt
signatures and verify as they did.

Revision ID: 0005_signature_index
Revises: 0004_transparency_log
Create Date: 2026-12-01 20:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0005_signature_index"
down_revision = "0004_transparency_log"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_receipt_signatures_signature", "receipt_signatures", ["signature"])


def downgrade() -> None:
    op.drop_index("ix_receipt_signatures_signature", table_name="receipt_signatures")
