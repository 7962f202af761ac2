"""Every claim is checked against the bytes it names (issue 10): the recovered run's own checkpoints are read,
not the uninterrupted run's equal copies, and the settlement is covered by the audit and by the experiment's head."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from ledger.cli import app
from ledger.receipts import Receipt
from ledger.store import Store
from tests.conftest import TinyExperiment
from tests.helpers_state import flip_bit

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
runner = CliRunner()
RECOVERED, UNINTERRUPTED = "recover/diloco-four", "train/diloco-four"


def run(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def _own_dir(store: Store, receipt: Receipt) -> Path:
    places = store.receipt_locations(receipt.id)["state"]
    assert len(places) == 1, places
    return Path(places[0])


def _recovered(exp: TinyExperiment, *, final: bool) -> tuple[Receipt, Path, Path]:
    """A recovered-run receipt (its final train-end, or an intermediate checkpoint after the restore), its own
    directory, and the uninterrupted run's directory holding the same state."""
    with Store.open(exp.db) as store:
        if final:
            r = store.find(kind="train-end", run=RECOVERED, rank=1)[-1].receipt
        else:
            restore = store.find(kind="restore", run=RECOVERED, rank=1)[-1].receipt
            r = next(s.receipt for s in store.find(kind="checkpoint", run=RECOVERED, rank=1)
                     if (s.receipt.step or 0) > (restore.step or 0) and restore.id in
                     {a.receipt.id for a in store.ancestors(s.receipt.id)})
        twin = next(s.receipt for s in store.find(kind=r.kind, run=UNINTERRUPTED, rank=1)
                    if s.receipt.artifacts["state"] == r.artifacts["state"])
        return r, _own_dir(store, r), _own_dir(store, twin)


def _audit_id(exp: TinyExperiment) -> str:
    with Store.open(exp.db) as store:
        return store.find(kind="audit")[-1].receipt.id


@pytest.mark.parametrize("final", [True, False], ids=["final", "intermediate"])
def test_a_flipped_bit_in_a_recovered_checkpoint_fails_everything(tiny_experiment: TinyExperiment, tmp_path: Path,
                                                                  final: bool) -> None:
    exp = tiny_experiment.copy(tmp_path / "exp")
    receipt, own, twin = _recovered(exp, final=final)
    assert own != twin and exp.workdir in own.parents  # the copy's own directory, not the session's original
    flip_bit(own / "model.safetensors", -1)
    audit = run("audit", "--db", exp.db, "--no-record")
    assert audit.exit_code == 1 and str(own) in audit.stderr, audit.output
    verified = run("verify", "--db", exp.db, _audit_id(exp))
    assert verified.exit_code == 1 and str(own) in verified.stderr
    if final:
        compared = run("compare-runs", "--db", exp.db, UNINTERRUPTED, RECOVERED)
        assert compared.exit_code == 1 and str(own) in compared.stderr


def test_a_deleted_recovered_checkpoint_is_missing(tiny_experiment: TinyExperiment, tmp_path: Path) -> None:
    exp = tiny_experiment.copy(tmp_path / "exp")
    _, own, twin = _recovered(exp, final=True)
    shutil.rmtree(own)
    assert twin.is_dir()
    audit = run("audit", "--db", exp.db, "--no-record")
    assert audit.exit_code == 3 and "missing" in audit.stderr and str(own) in audit.stderr, audit.output
    compared = run("compare-runs", "--db", exp.db, UNINTERRUPTED, RECOVERED)
    assert compared.exit_code == 3 and "missing" in compared.stderr


def test_an_edited_settlement_is_caught_by_the_audit_and_the_head(tiny_experiment: TinyExperiment,
                                                                  tmp_path: Path) -> None:
    exp = tiny_experiment.copy(tmp_path / "exp")
    with Store.open(exp.db) as store:
        settlement = store.find(kind="settlement")[-1].receipt
        head = store.find(kind="report")[-1].receipt
    assert settlement.id in head.parents  # the experiment's head cites the settlement
    conn = sqlite3.connect(exp.db)
    with conn:
        (body,) = conn.execute("SELECT body FROM receipts WHERE id = ?", (settlement.id,)).fetchone()
        tokens = settlement.measurements["tokens_issued"]
        forged = bytes(body).replace(f'"tokens_issued":{tokens}'.encode(), b'"tokens_issued":9')
        assert forged != bytes(body)
        conn.execute("UPDATE receipts SET body = ? WHERE id = ?", (forged, settlement.id))
    conn.close()
    assert run("verify", "--db", exp.db, head.id).exit_code == 1
    audit = run("audit", "--db", exp.db, "--no-record")
    assert audit.exit_code == 1 and settlement.id in audit.stderr, audit.output
