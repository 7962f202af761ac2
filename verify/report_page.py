"""The report page as evidence: render an audit's report as HTML (verify/report_html.py, with the figures of
verify/figures.py), record the page's digest in a ``report`` receipt, and re-render it to verify that receipt.

Rendering is deterministic (the same ledger gives the same bytes), so `ledger verify` of a report receipt renders
the page again from the audit it cites and compares digests: a page edited after the fact fails.

A page is rendered again in the format its receipt records (``measurements.format``). Format 2, the one written,
draws its figures in pure Python (verify/report_charts.py): a few tens of milliseconds, rendered in-process. A page
of format 1 was drawn by matplotlib, which takes about a second with its import (against about half a second for
the rest of an audit of the default experiment): :func:`start_rendering` lets such a page render early on a worker
process (the same interpreter and code, ``render_report`` on the same inputs) while the rest of the verification
goes on. The check then computes the page's inputs itself, as always, and takes the worker's page only when the
worker rendered exactly those inputs; otherwise (no worker, different inputs, a worker that failed) it renders the
page in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.errors import DigestMismatch, RecordInvalid
from ledger.experiment.formats import REPORT_HTML_FORMAT, REPORT_HTML_MATPLOTLIB_FORMAT
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from verify.context import KindCheckContext, Memo
from verify.figures import report_figures


def render_page(store: Store, artifacts: ArtifactStore, audit: Receipt, report: dict[str, Any],
                log_head: str | None = None, format: str = REPORT_HTML_FORMAT) -> bytes:
    """The HTML page of ``audit`` (whose rebuilt report is ``report``) in ``format``."""
    from verify.report_html import render_report

    return render_report(report, report_figures(store, artifacts, audit, report, log_head), format)


def report_receipt(audit: Receipt, settlement: Receipt, page: bytes, log_head: str | None = None,
                   format: str = REPORT_HTML_FORMAT) -> Receipt:
    """The ``report`` receipt of a page rendered in ``format``, the experiment's head: it cites the audit and its
    settlement (store the page with ``ArtifactStore.put_bytes`` to record it)."""
    return make_receipt("report", run="audit", prepared=audit.prepared, parents=[audit, settlement],
                        artifacts={"html": digests.raw_digest(page)},
                        measurements={"format": format, "bytes": len(page), "log_head": log_head})


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
    report = digests.parse_canonical(data)
    figures = report_figures(ctx.store, ctx.artifacts, audit, report, r.measurements["log_head"])
    page = _rendered(ctx.memo, report, figures, str(r.measurements["format"]))
    again = digests.raw_digest(page)
    if again != r.artifacts["html"]:
        raise DigestMismatch("the report page rendered again from its audit", expected=r.artifacts["html"],
                             actual=again, receipt=r.id, field="artifacts.html")
    if r.measurements.get("bytes") != len(page):
        raise RecordInvalid.at(f"receipt {r.id}: measurements.bytes {r.measurements.get('bytes')!r} is not the "
                               f"page's length {len(page)}", receipt=r.id, field="measurements.bytes",
                               expected=len(page), actual=r.measurements.get("bytes"))
    return [f"report {r.id[:19]}: the page renders again from audit {audit.id[:19]}, byte for byte"]


# ----------------------------------------------------------------------------------- rendering early


def start_rendering(store: Store, artifacts: ArtifactStore, receipt: Receipt, audit: Receipt, memo: Memo) -> None:
    """Start rendering the page of report receipt ``receipt`` (citing ``audit``) on a worker process, for a later
    :func:`check_report_page` with the same ``memo`` to use. Nothing here is trusted: the receipts may not be
    verified yet, and whatever goes wrong (a missing report, a malformed receipt) only means that the check renders
    the page itself, and meets the problem there.

    Only a format-1 page goes to a worker (format 2 renders faster than a worker starts). A process that has
    rendered a page before (matplotlib loaded, its fonts read) renders the next in about half
    what a worker takes to start, import matplotlib and render it: there no worker is started."""
    if receipt.measurements.get("format") != _WORKER_FORMAT or _WARM_MODULE in sys.modules:
        return
    worker = _Worker()  # first: it imports matplotlib while the inputs are assembled here
    try:
        data = artifacts.get_bytes(audit.artifacts["report"])
        report = digests.parse_canonical(data) if data is not None else None
        figures = (report_figures(store, artifacts, audit, report, receipt.measurements.get("log_head"))
                   if report is not None else None)
    except Exception:  # noqa: BLE001 - whatever it is, the check meets it in its turn
        report = figures = None
    wire = _wire(report, figures) if report is not None and figures is not None else None
    pages = _pages(memo)
    if wire is None or wire in pages:
        worker.cancel()
        return
    pages[wire] = worker.render(wire)


def _pages(memo: Memo) -> dict[bytes, Future[bytes | None]]:
    """The pages workers render (or have rendered) in this verification, keyed by the exact inputs they were
    given."""
    return memo.once(("report pages",), dict)


def _rendered(memo: Memo, report: dict[str, Any], figures: dict[str, Any], format: str) -> bytes:
    """``render_report(report, figures, format)``: the worker's page if one rendered exactly these inputs in this
    format, else rendered here."""
    wire = _wire(report, figures) if format == _WORKER_FORMAT else None
    future = _pages(memo).get(wire) if wire is not None else None
    page = future.result() if future is not None else None
    if page is None:
        from verify.report_html import render_report

        page = render_report(report, figures, format)
    return page


def _wire(report: dict[str, Any], figures: dict[str, Any]) -> bytes | None:
    """The inputs as JSON text that a worker parses back into exactly these values (types, key order, floats), or
    None when JSON cannot carry them exactly (a tuple, a non-string key, a subclass): those render in-process."""
    value = [report, figures]
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError):
        return None
    return text if _same(json.loads(text), value) else None


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same JSON value to the letter: same types, same keys in the same order."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return (list(a) == list(b) and all(type(k) is str for k in a)
                and all(_same(x, b[k]) for k, x in a.items()))
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float and a != a:
        return b != b  # NaN
    return bool(a == b) and type(a) in (str, int, float, bool, type(None))


_WORKER_FORMAT = REPORT_HTML_MATPLOTLIB_FORMAT  # drawn by matplotlib: worth a worker
_WARM_MODULE = "matplotlib.backends.backend_svg"  # imported by the first format-1 page this process renders
_WORKER_TIMEOUT_S = 600.0  # a worker still rendering after this is killed, and the check renders in-process

# The worker: this interpreter with this checkout's packages first on its path, rendering what it reads on stdin.
# matplotlib is imported before the inputs arrive (that is half of the worker's time).
_WORKER = f"""
import json, sys
import matplotlib.backends.backend_svg, matplotlib.figure, matplotlib.style, matplotlib.ticker
from verify.report_html import render_report
report, figures = json.loads(sys.stdin.buffer.read())
sys.stdout.buffer.write(render_report(report, figures, {_WORKER_FORMAT!r}))
"""


class _Worker:
    """A worker process that renders one page (see :data:`_WORKER`)."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parent.parent)  # where the verify and ledger packages are
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc: subprocess.Popen[bytes] | None = None
        if not sys.executable:  # an embedded interpreter: no worker, the check renders in-process
            return
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        except (OSError, ValueError):
            self._proc = None

    def cancel(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.communicate()

    def render(self, wire: bytes) -> Future[bytes | None]:
        """The page rendered from ``wire``; None if the worker could not render it."""
        future: Future[bytes | None] = Future()
        proc = self._proc
        if proc is None:
            future.set_result(None)
            return future

        def wait() -> None:
            try:
                page, _ = proc.communicate(wire, timeout=_WORKER_TIMEOUT_S)
                future.set_result(page if proc.returncode == 0 else None)
            except BaseException:  # noqa: BLE001 - a worker that fails or hangs: the check renders in-process
                proc.kill()
                proc.communicate()
                future.set_result(None)

        # A daemon thread: a verification that fails early does not wait for the worker at exit (the worker, its
        # pipe closed, ends on its own).
        threading.Thread(target=wait, name="report-page-worker", daemon=True).start()
        return future
