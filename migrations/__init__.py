"""Alembic migrations of the ledger schema, installed with the package so `ledger db upgrade` works from a wheel."""
