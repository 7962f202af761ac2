"""Content-addressed receipts, digests, the ledger store and the `ledger` CLI."""
