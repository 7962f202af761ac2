"""`ledger report` on the session's tiny experiment: the page is the audit recomputed, rendered twice to the same
bytes, recorded in a report receipt that `ledger verify` renders again, and readable in a real browser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.artifacts import ArtifactStore
from ledger.cli import app
from ledger.store import Store
from tests.conftest import TinyExperiment
from tests.verify.test_report_html import CONTRACTS, SECTIONS, _open, browser  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
runner = CliRunner()


@pytest.fixture(scope="module")
def rendered(tiny_experiment: TinyExperiment, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    exp = tiny_experiment.copy(tmp_path_factory.mktemp("report") / "experiment")
    out = exp.workdir / "page.html"
    result = runner.invoke(app, ["report", "--db", str(exp.db), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return {**json.loads(result.stdout), "exp": exp, "out": out}


def test_the_same_ledger_renders_the_same_bytes(rendered: dict[str, Any], tmp_path: Path) -> None:
    again = tmp_path / "again.html"
    result = runner.invoke(app, ["report", "--db", str(rendered["exp"].db), "--out", str(again), "--no-record",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == rendered["out"].read_bytes()
    assert json.loads(result.stdout)["report_receipt"] is None  # --no-record appends nothing


def test_the_report_receipt_renders_again_and_a_changed_page_fails(rendered: dict[str, Any]) -> None:
    exp = rendered["exp"]
    ok = runner.invoke(app, ["verify", "--db", str(exp.db), rendered["report_receipt"], "--require-artifacts"])
    assert ok.exit_code == 0, ok.output
    assert "renders again from audit" in ok.stdout
    with Store.open(exp.db) as store:
        receipt = store.get(rendered["report_receipt"]).receipt
    path = ArtifactStore(exp.artifacts).path_for(receipt.artifacts["html"])
    original = path.read_bytes()
    try:
        path.write_bytes(original.replace(b"Experiment audit report", b"Experiment audit rep0rt"))
        bad = runner.invoke(app, ["verify", "--db", str(exp.db), rendered["report_receipt"]])
        assert bad.exit_code == 1 and receipt.id in bad.stderr and "'html'" in bad.stderr
    finally:
        path.write_bytes(original)


def test_a_report_receipt_misstating_the_page_length_fails(rendered: dict[str, Any]) -> None:
    """The receipt's digest names the page, its ``bytes`` must too: a copy claiming another length, appended with
    the same parents and page, fails verification naming the field."""
    from ledger.receipts import make_receipt

    exp = rendered["exp"]
    with Store.open(exp.db) as store:
        real = store.get(rendered["report_receipt"]).receipt
        forged = make_receipt("report", run=real.run, prepared=real.prepared, parents=list(real.parents),
                              artifacts=real.artifacts,
                              measurements={**real.measurements, "bytes": real.measurements["bytes"] - 1})
        store.append(forged)
    bad = runner.invoke(app, ["verify", "--db", str(exp.db), forged.id])
    assert bad.exit_code == 1, bad.output
    assert len(bad.stderr.splitlines()) == 1 and "measurements.bytes" in bad.stderr, bad.stderr


def test_the_page_holds_the_audit_verdicts_in_a_real_browser(rendered: dict[str, Any], browser: Any,  # noqa: F811
                                                             tmp_path: Path) -> None:
    report = json.loads((rendered["exp"].workdir / "report.json").read_text())
    facts, requests, console = _open(browser, rendered["out"], 1280, tmp_path / "tiny.png")
    assert console == [] and requests == [rendered["out"].as_uri()]
    assert facts["sections"] == SECTIONS
    assert facts["verdicts"] == {c: "PASS" if rendered["contracts"][c] else "FAIL" for c in CONTRACTS}
    assert facts["tokens"] == str(report["learning"]["tokens_issued"])
    assert facts["svgs"] >= 7  # training 3, recovery 2, learning 3 (serving is not run in this ledger)
    assert facts["scrollWidth"] <= facts["innerWidth"]


def test_verifying_a_current_page_imports_no_matplotlib(rendered: dict[str, Any]) -> None:
    """`ledger verify` of a format-2 report receipt renders the page again without matplotlib (nor a worker)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from ledger.cli.app import main\n"
            f"sys.argv = ['ledger', 'verify', '--db', {str(rendered['exp'].db)!r}, {rendered['report_receipt']!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('exit', code, sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "renders again from audit" in out.stdout, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == "exit 0 []", out.stderr
