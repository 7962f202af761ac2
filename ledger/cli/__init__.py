"""The `ledger` command line (ledger/cli/app.py): a thin composition root over the library."""

from __future__ import annotations

from ledger.cli.app import app, main

__all__ = ["app", "main"]
