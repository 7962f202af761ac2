"""What verification recomputes for each receipt kind: one row per kind, beside ledger/kinds.py's chain rule and
schema. Every row starts with the schema check (the measurements a writer must fill, typed); kinds whose figures
derive from other evidence add the recomputation. tests/ledger/test_kinds.py fails when a kind has no row.

Checks run on every receipt of a verified ancestry before artifacts are re-hashed (verify/receipts.py), so a
tampered record is named by its document, rank or field rather than only by its file's digest.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from ledger.kinds import spec
from ledger.receipts import Kind
from verify import evaluation, recovery, report, report_page, serving_receipts, training
from verify.context import KindCheck, KindCheckContext, guarded


def check_schema(ctx: KindCheckContext) -> list[str]:
    """The receipt's measurements fit its kind's schema (ledger/kinds.py): every required field, typed."""
    spec(ctx.receipt.kind).schema.check(ctx.receipt)
    return []


CHECKS: Final[Mapping[Kind, tuple[KindCheck, ...]]] = MappingProxyType({
    Kind.PREPARE: (check_schema,),  # its artifacts are re-hashed and its digest is a chain rule
    Kind.SELECTION: (check_schema,),
    Kind.CONTRACT: (check_schema,),
    Kind.TRAIN_START: (check_schema,),
    Kind.CHECKPOINT: (check_schema,),  # its state is recomputed from the checkpoint files with the artifacts
    Kind.TRAIN_END: (check_schema,),
    Kind.ARM_SUMMARY: (check_schema, guarded(training.check_arm_summary)),
    Kind.FAULT: (check_schema,),
    Kind.RESTORE: (check_schema,),
    Kind.COMPARISON: (check_schema, guarded(recovery.check_rank_comparison), guarded(recovery.check_recovery_summary),
                      guarded(evaluation.comparison_check)),
    Kind.EVAL: (check_schema, guarded(evaluation.eval_check)),
    Kind.QUALITY: (check_schema, guarded(evaluation.quality_check)),
    Kind.REPLICA: (check_schema,),
    Kind.SERVE_PHASE: (check_schema, guarded(serving_receipts.check_serve_phase)),
    Kind.SERVE_SUMMARY: (check_schema, guarded(serving_receipts.check_serve_summary)),
    Kind.AUDIT: (check_schema, guarded(report.check_audit)),
    Kind.SETTLEMENT: (check_schema,),  # restates its audit: a chain rule
    Kind.REPORT: (check_schema, guarded(report_page.check_report_page)),
    Kind.NOTE: (check_schema,),
    Kind.KEY: (check_schema,),  # the key string is a chain rule; who signed with it, verify/transparency.py
})


_BY_NAME: Final[Mapping[str, tuple[KindCheck, ...]]] = {kind.value: checks for kind, checks in CHECKS.items()}


def checks_for(kind: str) -> tuple[KindCheck, ...]:
    """The checks of ``kind``, in order."""
    found = _BY_NAME.get(kind)  # a plain dict of the kinds' names: Kind(kind) costs a microsecond per receipt
    return found if found is not None else CHECKS[Kind(kind)]
