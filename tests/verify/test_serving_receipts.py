"""The serving receipts of the session's tiny experiment: they verify (with sampled requests re-executed), a
replica of another model is caught, and a request log with one response digest changed fails naming the request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.artifacts import ArtifactStore, put_jsonl, read_jsonl
from ledger.cli import app
from ledger.errors import RecordInvalid, VerificationError
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import TinyExperiment
from verify.receipts import verify_receipt
from verify.serving import ResponseDigestMismatch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
runner = CliRunner()


def _latest(store: Store, kind: str, **where: Any) -> Receipt:
    return store.find(kind=kind, **where)[-1].receipt


def test_the_serving_summary_verifies_and_its_requests_re_execute(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        summary = _latest(store, "serve-summary")
    assert summary.measurements["serving_fixture_passed"] is True
    assert summary.measurements["conditions"] == {"all_requests_completed": True,
                                                  "identical_successful_output_tokens": True, "no_cache_hits": True}
    result = runner.invoke(app, ["verify", "--db", str(tiny_experiment.db), summary.id, "--require-artifacts",
                                 "--rescore", "2"])
    assert result.exit_code == 0, result.output
    assert "re-executed on the primary model, identical tokens" in result.stdout
    assert result.stdout.count("every figure recomputed from the request log") == 3


def _forge(store: Store, arts: ArtifactStore, *, replica_source: Receipt | None = None,
           rows_edit: Any = None) -> Receipt:
    """A copy of the recorded serving receipts with one thing changed, appended; returns the forged summary."""
    summary = _latest(store, "serve-summary")
    phases = [store.get(p).receipt for p in summary.parents if store.get(p).receipt.kind == "serve-phase"]
    forged_replicas: dict[str, Receipt] = {}
    new_phases = []
    for phase in phases:
        cited = []
        for rid in phase.parents:
            real = store.get(rid).receipt
            if rid not in forged_replicas:
                src = replica_source or store.get(real.parents[0]).receipt
                forged_replicas[rid] = make_receipt(
                    "replica", run="forged/serve", rank=real.rank, prepared=real.prepared, parents=[src],
                    artifacts={"model": src.artifacts["model"], "state": src.artifacts["state"]},
                    measurements=dict(real.measurements))
            cited.append(forged_replicas[rid])
        log = phase.artifacts["request_log"]
        rows = read_jsonl(arts, log, locations=store.locations(log))
        if rows_edit is not None and phase.measurements["phase"] == "four":
            rows = rows_edit(rows)
        new_phases.append(make_receipt(
            "serve-phase", run="forged/serve", prepared=phase.prepared, parents=cited,
            artifacts={**phase.artifacts, "request_log": put_jsonl(arts, rows)},
            measurements=dict(phase.measurements)))
    forged = make_receipt("serve-summary", run="forged/serve", prepared=summary.prepared,
                          parents=[*(p for p in summary.parents if store.get(p).receipt.kind == "contract"),
                                   *new_phases], measurements=dict(summary.measurements))
    store.append_many([*forged_replicas.values(), *new_phases, forged])
    return forged


def test_a_replica_of_another_model_is_caught(tiny_experiment: TinyExperiment, tmp_path: Path) -> None:
    exp = tiny_experiment.copy(tmp_path / "exp")
    with Store.open(exp.db) as store:
        arts = ArtifactStore(exp.artifacts)
        ddp_end = _latest(store, "train-end", run="train/ddp-four", rank=0)
        forged = _forge(store, arts, replica_source=ddp_end)
        with pytest.raises(RecordInvalid) as caught:
            verify_receipt(store, forged.id, artifacts=arts, require_artifacts=True)
    assert caught.value.field == "parents" and "train/diloco-four" in str(caught.value.expected)
    assert "train/ddp-four" in str(caught.value.actual)


def test_a_changed_response_digest_is_named_by_its_request(tiny_experiment: TinyExperiment, tmp_path: Path) -> None:
    exp = tiny_experiment.copy(tmp_path / "exp")

    def edit(rows: list[Any]) -> list[Any]:
        rows[5] = {**rows[5], "response_digest": "blake3:" + "0" * 64}
        return rows

    with Store.open(exp.db) as store:
        arts = ArtifactStore(exp.artifacts)
        forged = _forge(store, arts, rows_edit=edit)
        with pytest.raises(VerificationError) as caught:
            verify_receipt(store, forged.id, artifacts=arts, require_artifacts=True)
    assert isinstance(caught.value, ResponseDigestMismatch)
    assert "5" in str(caught.value.field) or "request 5" in str(caught.value)
