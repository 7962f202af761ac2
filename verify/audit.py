"""The audit: verify every receipt the report draws on, rebuild the report from them (verify/report.py), and
record an ``audit`` receipt carrying the report as a canonical JSON artifact, and a ``settlement`` receipt.

Every receipt the report draws on is verified first (ids, chain, artifacts re-hashed, and each kind's
recomputations: arm figures from train-end receipts, recovery comparisons from checkpoint files, statistics from
per-document outcomes), so the report holds only recomputed numbers; `ledger verify` of the audit receipt
rebuilds the report and names the first field that differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.experiment.formats import AUDIT_FORMAT, SETTLEMENT_FORMAT
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from verify.receipts import Verifier
from verify.report import build_report
from verify.transparency import SignatureReport, check_experiment_signatures


@dataclass
class AuditResult:
    report: dict[str, Any]
    cited: list[Receipt]
    checks: list[str] = field(default_factory=list)
    receipt: Receipt | None = None
    settlement: Receipt | None = None
    recorded: bool = False  # whether receipt and settlement were appended (else they are what would be)
    signatures: SignatureReport | None = None  # who signed the experiment's receipts, each signature checked


def audit(store: Store, artifacts: ArtifactStore, prepared: str | None = None, *, record: bool = True,
          require_signatures: bool = False, progress: Callable[[str], None] | None = None) -> AuditResult:
    """Verify every receipt the report draws on, then every other receipt of the experiment and the signatures of
    all of them (with ``require_signatures`` an unsigned one fails), build the report, and (``record``) append
    audit + settlement."""
    digest = store.latest_prepared(prepared)
    # One verifier for every cited receipt: their ancestries overlap (the prepare, the training chains, the evals),
    # and each row, chain rule, kind check, artifact copy and checkpoint state is verified once for the audit.
    verifier = Verifier(store, artifacts, require_artifacts=True)
    # The experiment's report pages (earlier `ledger report --record`) start rendering on a worker process now, the
    # slowest check of an audit, so that they are ready when verification reaches them.
    verifier.prefetch(_reports(store, digest))
    report, cited = build_report(store, digest)
    checks: list[str] = []
    for r in cited:
        if progress:
            progress(f"verifying {r.kind} {r.id[:19]}")
        checks.extend(verifier.verify(r.id).checks)
    # Then every other receipt of the experiment (earlier audits and their settlements, reports, replays...): the
    # audit covers the whole experiment, not only what this report cites; shared ancestry is verified once.
    # The stored ids: a body edited in place must not rename its row. Read in batches, each receipt whose ancestry
    # is verified already is checked alone, so that a ledger with many more receipts costs what reading them does.
    checks.extend(verifier.verify_experiment(digest, progress=progress))
    # Who vouches for them: a keeper of the database who rewrote receipts (ids and chain recomputed) cannot sign
    # them again with a registered key. The log itself (each leaf, against a published head) is `verify --head`'s.
    signatures = check_experiment_signatures(store, digest, require=require_signatures)
    result = AuditResult(report, cited, sorted(set(checks)), signatures=signatures)
    # The receipts exist (with their content ids) whether or not they are recorded: a page rendered with
    # --no-record still names the audit it shows.
    report_bytes = digests.canonical_bytes(report)
    result.receipt = make_receipt(
        "audit", run="audit", prepared=digest, parents=cited,
        artifacts={"report": digests.raw_digest(report_bytes)},
        measurements={"format": AUDIT_FORMAT, "contracts": report["contracts"],
                      "tokens_issued": report["learning"]["tokens_issued"]})
    result.settlement = make_receipt(
        "settlement", run="audit", prepared=digest, parents=[result.receipt],
        measurements={"format": SETTLEMENT_FORMAT, "tokens_issued": report["learning"]["tokens_issued"],
                      "rule": "tokens are issued only when the quality, efficiency, recovery and serving "
                              "contracts all pass", "contracts": report["contracts"]})
    result.recorded = record
    if record:
        artifacts.put_bytes(report_bytes)
        store.append_many([result.receipt, result.settlement])
    return result


def _reports(store: Store, digest: str) -> list[Receipt]:
    """The report receipts of the experiment, as stored (not verified yet: only for Verifier.prefetch)."""
    try:
        return [s.receipt for s in store.find(kind="report", prepared=digest)]
    except Exception:  # noqa: BLE001 - a row that does not parse, say: the verification names it in its turn
        return []
