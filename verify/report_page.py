"""The report page as evidence: render an audit's report as HTML (verify/report_html.py, with the figures of
verify/figures.py), record the page's digest in a ``report`` receipt, and re-render it to verify that receipt.

Rendering is deterministic (the same ledger gives the same bytes), so `ledger verify` of a report receipt renders
the page again from the audit it cites and compares digests: a page edited after the fact fails.
"""

from __future__ import annotations

from typing import Any

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.errors import DigestMismatch, RecordInvalid
from ledger.experiment.formats import REPORT_HTML_FORMAT
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from verify.context import KindCheckContext
from verify.figures import report_figures


def render_page(store: Store, artifacts: ArtifactStore, audit: Receipt, report: dict[str, Any],
                log_head: str | None = None) -> bytes:
    """The HTML page of ``audit`` (whose rebuilt report is ``report``)."""
    from verify.report_html import render_report

    return render_report(report, report_figures(store, artifacts, audit, report, log_head))


def report_receipt(audit: Receipt, settlement: Receipt, page: bytes, log_head: str | None = None) -> Receipt:
    """The ``report`` receipt of a rendered page, the experiment's head: it cites the audit and its settlement
    (store the page with ``ArtifactStore.put_bytes`` to record it)."""
    return make_receipt("report", run="audit", prepared=audit.prepared, parents=[audit, settlement],
                        artifacts={"html": digests.raw_digest(page)},
                        measurements={"format": REPORT_HTML_FORMAT, "bytes": len(page), "log_head": log_head})


def check_report_page(ctx: KindCheckContext) -> list[str]:
    """Render the page again from the audit the receipt cites and compare its digest with the recorded one."""
    r = ctx.receipt
    audit = next(ctx.closure[p] for p in r.parents if ctx.closure[p].kind == "audit")
    data = ctx.artifacts.get_bytes(audit.artifacts["report"])
    if data is None:
        if ctx.require_artifacts:
            raise RecordInvalid.at(f"receipt {r.id}: the report of audit {audit.id} is missing, the page cannot be "
                                   "rendered again", receipt=r.id, field="artifacts.html",
                                   expected=audit.artifacts["report"], actual="missing")
        return [f"report {r.id[:19]}: the audit's report is missing, page not rendered again"]
    page = render_page(ctx.store, ctx.artifacts, audit, digests.parse_canonical(data), r.measurements["log_head"])
    again = digests.raw_digest(page)
    if again != r.artifacts["html"]:
        raise DigestMismatch("the report page rendered again from its audit", expected=r.artifacts["html"],
                             actual=again, receipt=r.id, field="artifacts.html")
    return [f"report {r.id[:19]}: the page renders again from audit {audit.id[:19]}, byte for byte"]
