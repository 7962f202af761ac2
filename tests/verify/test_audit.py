"""The main job end to end on a tiny config (`ledger run experiment`), then the audit and its tamper cases."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.artifacts import ArtifactStore, default_root
from ledger.cli import app
from ledger.store import Store
from tests.conftest import TinyExperiment

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

runner = CliRunner()


@pytest.fixture(scope="module")
def experiment(tiny_experiment: TinyExperiment, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The session's tiny experiment, copied: these tests tamper with it (and put things back)."""
    exp = tiny_experiment.copy(tmp_path_factory.mktemp("audit") / "experiment")
    return {**exp.summary, "workdir": exp.workdir, "report": str(exp.workdir / "report.json")}


def _db(e: dict[str, Any]) -> str:
    return str(Path(e["workdir"]) / "ledger.db")


def test_experiment_records_every_step_and_the_audit_verifies(experiment: dict[str, Any]) -> None:
    report = json.loads(Path(experiment["report"]).read_text())
    assert set(report["training"]["arms"]) == {"single", "ddp-four", "diloco-four"}
    assert report["recovery"]["all_rank_state_and_trajectory_comparisons_passed"] is True
    assert report["contracts"]["recovery"] is True
    # Serving ran (four replicas, one killed mid-phase) and its fixture passed; tokens only if every contract did.
    assert report["contracts"]["serving"] is True and report["learning"]["serving_approved"] is True
    assert report["serving"]["serving_fixture_passed"] is True and report["serving"]["failure_retries"] >= 1
    assert report["learning"]["tokens_issued"] == int(all(report["contracts"].values()))
    # DiLoCo with H=2 sends exactly half of DDP's bytes (one pseudo-gradient all-reduce per two steps).
    assert report["training"]["ratios"]["sent_bytes_vs_ddp"] == 0.5
    assert report["training"]["arms"]["single"]["total_sent_bytes"] == 0
    ddp = report["training"]["arms"]["ddp-four"]
    assert len({r["sent_bytes"] for r in ddp["ranks"]}) == 1
    result = runner.invoke(app, ["verify", "--db", _db(experiment), experiment["audit"], "--require-artifacts"])
    assert result.exit_code == 0, result.output
    assert "report rebuilt from the ledger, every field equal" in result.stdout
    assert "recovery: 4 rank comparison(s) passed" in result.stdout


def test_audit_again_gives_the_same_report(experiment: dict[str, Any]) -> None:
    result = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record", "--json"])
    assert result.exit_code == 0, result.output
    again = json.loads(result.stdout)["report"]
    assert again == json.loads(Path(experiment["report"]).read_text())


def test_a_rewritten_report_artifact_is_named(experiment: dict[str, Any], tmp_path: Path) -> None:
    with Store.open(_db(experiment)) as store:
        audit = store.get(experiment["audit"]).receipt
        arts = ArtifactStore(default_root(store.url))
    path = arts.path_for(audit.artifacts["report"])
    original = path.read_bytes()
    try:
        path.write_bytes(original.replace(b'"killed_rank":1', b'"killed_rank":2'))
        result = runner.invoke(app, ["verify", "--db", _db(experiment), experiment["audit"]])
        assert result.exit_code == 1
        assert "report" in result.stderr and audit.id in result.stderr
    finally:
        path.write_bytes(original)


def test_a_tampered_arm_figure_is_named(experiment: dict[str, Any]) -> None:
    """An operator who inflates a rank's loop seconds in a train-end body breaks that receipt's id, named by verify."""
    with Store.open(_db(experiment)) as store:
        end = store.find(kind="train-end", run="train/ddp-four", rank=2)[-1].receipt
    conn = sqlite3.connect(_db(experiment))
    (body,) = conn.execute("SELECT body FROM receipts WHERE id = ?", (end.id,)).fetchone()
    forged = bytes(body).replace(b'"loop_seconds":', b'"loop_seconds":1', 1)
    try:
        conn.execute("UPDATE receipts SET body = ? WHERE id = ?", (forged, end.id))
        conn.commit()
        result = runner.invoke(app, ["verify", "--db", _db(experiment), experiment["audit"]])
        assert result.exit_code == 1
        assert end.id in result.stderr and "body" in result.stderr
    finally:
        conn.execute("UPDATE receipts SET body = ? WHERE id = ?", (body, end.id))
        conn.commit()
        conn.close()


def _signed_checkpoint(e: dict[str, Any]) -> tuple[int, str, list[tuple[str, bytes]]]:
    """A checkpoint receipt of the experiment that the main job signed: its seq, id and signature rows."""
    with sqlite3.connect(_db(e)) as conn:
        seq, rid = conn.execute("SELECT r.seq, r.id FROM receipts r JOIN receipt_signatures s ON s.receipt_seq = r.seq "
                                "WHERE r.kind = 'checkpoint' ORDER BY r.seq LIMIT 1").fetchone()
        rows = conn.execute("SELECT key, signature FROM receipt_signatures WHERE receipt_seq = ?", (seq,)).fetchall()
    return seq, rid, [(k, bytes(s)) for k, s in rows]


def _put_signatures(e: dict[str, Any], seq: int, rows: list[tuple[str, bytes]]) -> None:
    with sqlite3.connect(_db(e)) as conn:
        conn.execute("DELETE FROM receipt_signatures WHERE receipt_seq = ?", (seq,))
        conn.executemany("INSERT INTO receipt_signatures VALUES (?, ?, ?)", [(seq, k, s) for k, s in rows])


def test_the_audit_checks_who_signed_every_receipt_of_the_experiment(experiment: dict[str, Any]) -> None:
    """Every receipt of the experiment is signed by the operator key the main job registered, and the audit says so:
    with --require-signatures it passes, and the count is the experiment's."""
    result = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record", "--json", "--require-signatures"])
    assert result.exit_code == 0, result.output
    signatures = json.loads(result.stdout)["signatures"]
    with sqlite3.connect(_db(experiment)) as conn:
        (count,) = conn.execute("SELECT COUNT(*) FROM receipts WHERE prepared = (SELECT prepared FROM receipts "
                                "WHERE kind = 'prepare' ORDER BY seq DESC LIMIT 1)").fetchone()
    assert signatures["checked"] == count and signatures["unsigned"] == 0
    ((label, signed),) = signatures["signed"].items()
    assert label.startswith("operator+") and signed == count
    text = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record"])
    assert text.exit_code == 0 and f"signatures: {count} receipt(s) signed by {label}" in text.stdout


def test_a_forged_signature_fails_the_audit(experiment: dict[str, Any]) -> None:
    """A keeper who rewrites a signature (or a receipt, its id and chain recomputed, and its signature with it) has
    no registered key to sign with: the audit fails, naming the receipt."""
    seq, rid, rows = _signed_checkpoint(experiment)
    try:
        _put_signatures(experiment, seq, [(k, bytes([s[0] ^ 1]) + s[1:]) for k, s in rows])
        result = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record"])
        assert result.exit_code == 1, result.output
        assert rid in result.stderr and "signature" in result.stderr and result.stderr.count("\n") == 1
    finally:
        _put_signatures(experiment, seq, rows)


def test_an_unsigned_receipt_is_counted_and_fails_only_when_signatures_are_required(
        experiment: dict[str, Any]) -> None:
    seq, rid, rows = _signed_checkpoint(experiment)
    try:
        _put_signatures(experiment, seq, [])
        result = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record"])
        assert result.exit_code == 0, result.output
        assert f"signatures: 1 receipt(s) unsigned (first {rid})" in result.stdout
        result = runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record", "--require-signatures"])
        assert result.exit_code == 1 and rid in result.stderr and "not signed" in result.stderr, result.output
    finally:
        _put_signatures(experiment, seq, rows)
    assert runner.invoke(app, ["audit", "--db", _db(experiment), "--no-record", "--require-signatures"]).exit_code == 0
