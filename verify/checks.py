"""What verification recomputes for each receipt kind: one row per kind, beside ledger/kinds.py's chain rule and
schema. Every row starts with the schema check (the measurements a writer must fill, typed); kinds whose figures
derive from other evidence add the recomputation. tests/ledger/test_kinds.py fails when a kind has no row.

Checks run on every receipt of a verified ancestry before artifacts are re-hashed (verify/receipts.py), so a
tampered record is named by its document, rank or field rather than only by its file's digest.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from ledger.kinds import spec
from ledger.receipts import Kind, Receipt
from verify.context import KindCheck, KindCheckContext, guarded


def check_schema(ctx: KindCheckContext) -> list[str]:
    """The receipt's measurements fit its kind's schema (ledger/kinds.py): every required field, typed."""
    spec(ctx.receipt.kind).schema.check(ctx.receipt)
    return []


def _check(module: str, name: str) -> KindCheck:
    """``verify.<module>``'s check ``name``, imported when it first runs, guarded: `ledger verify` of a receipt
    imports the checks of the kinds its ancestry holds, not the evaluation's statistics or the serving replay for a
    note (about 40 ms of start-up)."""
    resolved: list[KindCheck] = []

    def run(ctx: KindCheckContext) -> list[str]:
        if not resolved:
            resolved.append(resolve(module, name))
        return resolved[0](ctx)

    run.__name__ = name
    IMPORTED_LATER.append((module, name))
    return guarded(run)


def resolve(module: str, name: str) -> KindCheck:
    """The check ``name`` of ``verify.<module>``: always one of verify's own modules, so the layers' import contracts
    (which see these imports only through the modules themselves) still hold; tests/verify/test_checks.py resolves
    every entry of the table."""
    found: KindCheck = getattr(importlib.import_module(f"verify.{module}"), name)
    return found


IMPORTED_LATER: Final[list[tuple[str, str]]] = []  # every (module, check) of the table, for the tests to resolve


CHECKS: Final[Mapping[Kind, tuple[KindCheck, ...]]] = MappingProxyType({
    Kind.PREPARE: (check_schema,),  # its artifacts are re-hashed and its digest is a chain rule
    Kind.SELECTION: (check_schema,),
    Kind.CONTRACT: (check_schema,),
    Kind.TRAIN_START: (check_schema,),
    Kind.CHECKPOINT: (check_schema,),  # its state is recomputed from the checkpoint files with the artifacts
    Kind.TRAIN_END: (check_schema,),
    Kind.ARM_SUMMARY: (check_schema, _check("training", "check_arm_summary")),
    Kind.FAULT: (check_schema,),
    Kind.RESTORE: (check_schema,),
    Kind.COMPARISON: (check_schema, _check("recovery", "check_rank_comparison"),
                      _check("recovery", "check_recovery_summary"), _check("evaluation", "comparison_check")),
    Kind.EVAL: (check_schema, _check("evaluation", "eval_check")),
    Kind.QUALITY: (check_schema, _check("evaluation", "quality_check")),
    Kind.REPLICA: (check_schema,),
    Kind.SERVE_PHASE: (check_schema, _check("serving_receipts", "check_serve_phase")),
    Kind.SERVE_SUMMARY: (check_schema, _check("serving_receipts", "check_serve_summary")),
    Kind.AUDIT: (check_schema, _check("report", "check_audit")),
    Kind.SETTLEMENT: (check_schema,),  # restates its audit: a chain rule
    Kind.REPORT: (check_schema, _check("report_page", "check_report_page")),
    Kind.NOTE: (check_schema,),
    Kind.KEY: (check_schema,),  # the key string is a chain rule; who signed with it, verify/transparency.py
})


_BY_NAME: Final[Mapping[str, tuple[KindCheck, ...]]] = {kind.value: checks for kind, checks in CHECKS.items()}


def checks_for(kind: str) -> tuple[KindCheck, ...]:
    """The checks of ``kind``, in order."""
    found = _BY_NAME.get(kind)  # a plain dict of the kinds' names: Kind(kind) costs a microsecond per receipt
    return found if found is not None else CHECKS[Kind(kind)]


_SCHEMA_ALONE: Final = (check_schema,)


def schema_alone(kind: str) -> bool:
    """Whether ``kind``'s only check is its schema, which reads nothing but the receipt (no ancestry, no files): a
    note or a checkpoint, most receipts of a long ledger."""
    return checks_for(kind) == _SCHEMA_ALONE


def run_checks(receipt: Receipt, context: Callable[[], KindCheckContext]) -> list[str]:
    """What the checks of ``receipt``'s kind say, in order. ``context`` is called only for a kind with checks beyond
    the schema (:func:`schema_alone`): building one costs a microsecond or two, more than a note's check."""
    checks = checks_for(receipt.kind)
    if checks == _SCHEMA_ALONE:
        spec(receipt.kind).schema.check(receipt)
        return []
    ctx = context()
    return [line for check in checks for line in check(ctx)]
