"""A format-1 report page (drawn by matplotlib) rendered early on a worker process (verify/report_page.py,
Verifier.prefetch): the worker's page is the page rendered in-process, a check uses it only for exactly its own
inputs, and without it the check renders the page itself. A format-2 page starts no worker."""

from __future__ import annotations

import math
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest

import verify.report_html
import verify.report_page as report_page
from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import TinyExperiment
from verify.context import Memo
from verify.figures import report_figures
from verify.receipts import Verifier


class _Colour(StrEnum):
    RED = "red"


@pytest.mark.parametrize("value", [
    {"b": 1, "a": [1.5, -0.0, None, True, "é\n"], "": {"x": 2**62}},
    {"nan": math.nan, "inf": math.inf},
    [],
])
def test_json_carries_plain_values_exactly(value: Any) -> None:
    assert report_page._wire(value, {}) is not None


@pytest.mark.parametrize("value", [
    {"t": (1, 2)},  # a tuple comes back a list
    {1: "x"},  # a key comes back a string
    {"k": _Colour.RED},  # a subclass comes back its base
    {"s": {1, 2}},  # no JSON at all
])
def test_values_json_would_change_are_not_sent_to_a_worker(value: Any) -> None:
    assert report_page._wire(value, {}) is None


def test_key_order_is_part_of_the_inputs() -> None:
    assert report_page._wire({"a": 1, "b": 2}, {}) != report_page._wire({"b": 2, "a": 1}, {})


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that has rendered no page yet (the only kind that starts a worker)."""
    monkeypatch.setattr(report_page, "_WARM_MODULE", "no such module, never imported")


V1 = "ledger-report-html/1"


@pytest.fixture(scope="module")
def v1_experiment(tiny_experiment: TinyExperiment, tmp_path_factory: pytest.TempPathFactory) -> TinyExperiment:
    """The tiny experiment with a second report receipt: its page rendered in format 1, as earlier versions
    recorded it."""
    exp = tiny_experiment.copy(tmp_path_factory.mktemp("v1") / "exp")
    store = Store.open(exp.db)
    arts = ArtifactStore(exp.artifacts)
    head = store.find(kind="report")[-1].receipt
    cited = {r.kind: r for r in (store.get(p).receipt for p in head.parents)}  # parents are in id order
    audit, settlement = cited["audit"], cited["settlement"]
    report = digests.parse_canonical(arts.get_bytes(audit.artifacts["report"]) or b"")
    log_head = head.measurements["log_head"]
    page = report_page.render_page(store, arts, audit, report, log_head, V1)
    arts.put_bytes(page)
    store.append(report_page.report_receipt(audit, settlement, page, log_head, V1))
    store.close()
    return exp


def _page_inputs(exp: TinyExperiment) -> tuple[Store, ArtifactStore, Receipt, Receipt, dict[str, Any], dict[str, Any]]:
    store = Store.open(exp.db)
    arts = ArtifactStore(exp.artifacts)
    receipt = next(r.receipt for r in store.find(kind="report") if r.receipt.measurements["format"] == V1)
    audit = next(a for a in (store.get(p).receipt for p in receipt.parents) if a.kind == "audit")
    data = arts.get_bytes(audit.artifacts["report"])
    assert data is not None
    report = digests.parse_canonical(data)
    figures = report_figures(store, arts, audit, report, receipt.measurements["log_head"])
    return store, arts, receipt, audit, report, figures


@pytest.mark.slow
def test_the_worker_renders_the_bytes_rendered_here(v1_experiment: TinyExperiment) -> None:
    store, _, receipt, _, report, figures = _page_inputs(v1_experiment)
    wire = report_page._wire(report, figures)
    assert wire is not None
    page = report_page._Worker().render(wire).result(timeout=120)
    assert page == verify.report_html.render_report(report, figures, V1)
    assert digests.raw_digest(page) == receipt.artifacts["html"]
    store.close()


def _no_render_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make rendering in this process fail loudly, counting the attempts."""
    calls: list[int] = []

    def refuse(report: Any, figures: Any, format: str) -> bytes:
        calls.append(1)
        raise AssertionError("rendered in-process")

    monkeypatch.setattr(verify.report_html, "render_report", refuse)
    return calls


@pytest.mark.slow
def test_a_prefetched_page_verifies_the_report_receipt(v1_experiment: TinyExperiment,
                                                       monkeypatch: pytest.MonkeyPatch, cold: None) -> None:
    store, arts, receipt, _, _, _ = _page_inputs(v1_experiment)
    calls = _no_render_here(monkeypatch)
    verifier = Verifier(store, arts, require_artifacts=True)
    verifier.prefetch([receipt])
    checks = verifier.verify(receipt.id).checks
    assert any("renders again from audit" in line for line in checks) and not calls
    store.close()


@pytest.mark.slow
def test_a_page_rendered_from_other_inputs_is_not_used(v1_experiment: TinyExperiment,
                                                       monkeypatch: pytest.MonkeyPatch, cold: None) -> None:
    store, arts, receipt, audit, _, _ = _page_inputs(v1_experiment)
    memo = Memo()
    # The worker renders the page of another log head (what a prefetch of an unverified receipt might do).
    other = Receipt(kind="report", run=receipt.run, prepared=receipt.prepared, parents=receipt.parents,
                    artifacts=dict(receipt.artifacts), measurements={**receipt.measurements, "log_head": "elsewhere"})
    report_page.start_rendering(store, arts, other, audit, memo)
    (future,) = report_page._pages(memo).values()
    assert future.result(timeout=120) is not None
    calls = _no_render_here(monkeypatch)
    monkeypatch.setattr(Verifier, "prefetch", lambda self, *args, **kwargs: None)
    verifier = Verifier(store, arts, require_artifacts=True)
    verifier._memo = memo
    with pytest.raises(AssertionError, match="rendered in-process"):  # the check renders its own inputs itself
        verifier.verify(receipt.id)
    assert calls == [1]
    store.close()


@pytest.mark.slow
def test_a_failed_worker_leaves_the_check_to_render_the_page(v1_experiment: TinyExperiment,
                                                             monkeypatch: pytest.MonkeyPatch, cold: None) -> None:
    store, arts, receipt, _, _, _ = _page_inputs(v1_experiment)
    monkeypatch.setattr(report_page, "_WORKER", "import sys; sys.exit(3)")
    verifier = Verifier(store, arts, require_artifacts=True)
    verifier.prefetch([receipt])
    assert [f.result(timeout=60) for f in report_page._pages(verifier._memo).values()] == [None]
    checks = verifier.verify(receipt.id).checks
    assert any("renders again from audit" in line for line in checks)
    store.close()


@pytest.mark.slow
def test_a_process_that_rendered_a_page_renders_the_next_itself(v1_experiment: TinyExperiment,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store, arts, receipt, audit, _, _ = _page_inputs(v1_experiment)
    monkeypatch.setitem(sys.modules, report_page._WARM_MODULE, sys.modules.get(report_page._WARM_MODULE, sys))
    memo = Memo()
    report_page.start_rendering(store, arts, receipt, audit, memo)
    assert report_page._pages(memo) == {}
    store.close()


@pytest.mark.slow
def test_report_receipts_are_verified_after_the_rest_of_the_experiment(tiny_experiment: TinyExperiment,
                                                                       tmp_path: Path) -> None:
    """While a page renders on the worker, the receipts recorded after it are verified; then the page is compared."""
    exp = tiny_experiment.copy(tmp_path / "exp")
    store = Store.open(exp.db)
    report = store.find(kind="report")[-1].receipt
    prepare = store.find(kind="prepare")[-1].receipt
    later = make_receipt("note", run="after-the-report", prepared=prepare.prepared, parents=[prepare],
                         measurements={"text": "recorded after the report"})
    store.append(later)
    order: list[str] = []
    verifier = Verifier(store, ArtifactStore(exp.artifacts), require_artifacts=True)
    checks = verifier.verify_experiment(report.prepared or "", progress=order.append)
    verified = [line.removeprefix("verifying ") for line in order]
    assert verified.index(later.id[:19]) < verified.index(report.id[:19]) == len(verified) - 1
    assert any(f"report {report.id[:19]}: the page renders again" in line for line in checks)
    store.close()


def test_a_format_2_page_starts_no_worker(tiny_experiment: TinyExperiment, cold: None) -> None:
    store = Store.open(tiny_experiment.db)
    receipt = store.find(kind="report")[-1].receipt
    assert receipt.measurements["format"] == "ledger-report-html/2"
    audit = next(a for a in (store.get(p).receipt for p in receipt.parents) if a.kind == "audit")
    memo = Memo()
    report_page.start_rendering(store, ArtifactStore(tiny_experiment.artifacts), receipt, audit, memo)
    assert report_page._pages(memo) == {}
    store.close()
