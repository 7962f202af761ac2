"""Runners: prepare, training arms, recovery, evaluation and serving; each emits receipts."""
