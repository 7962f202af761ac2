"""The record formats the experiment's receipts carry in ``measurements.format`` (or ``method``), named once here:
writers put them in receipts, the kinds table selects a schema by them, and verify picks its recomputation."""

from __future__ import annotations

from typing import Final

EVAL_FORMAT: Final = "ledger-eval/1"
COMPARISON_METHOD: Final = "paired-exact-match"
QUALITY_FORMAT: Final = "ledger-quality/1"
RECOVERY_RANK_FORMAT: Final = "ledger-recovery-rank/1"
RECOVERY_SUMMARY_FORMAT: Final = "ledger-recovery/1"
REPLAY_FORMAT: Final = "ledger-replay/1"
AUDIT_FORMAT: Final = "ledger-audit/1"
SETTLEMENT_FORMAT: Final = "ledger-settlement/1"
REPORT_HTML_FORMAT: Final = "ledger-report-html/2"  # the page's figures drawn by verify/svg_plot.py
REPORT_HTML_MATPLOTLIB_FORMAT: Final = "ledger-report-html/1"  # drawn by matplotlib: verified, no longer written
REPORT_HTML_FORMATS: Final = (REPORT_HTML_FORMAT, REPORT_HTML_MATPLOTLIB_FORMAT)
SERVE_REPLICA_FORMAT: Final = "ledger-serve-replica/1"
SERVE_PHASE_FORMAT: Final = "ledger-serve-phase/1"
SERVE_SUMMARY_FORMAT: Final = "ledger-serve-summary/1"
