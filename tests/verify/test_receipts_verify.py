"""Tamper evidence (verify/receipts.py): edit a real SQLite ledger behind the library's back, then verify.

Each tamper is made with the stdlib sqlite3 module (no foreign keys, no library code), as an operator with write
access to the file could; `ledger verify` on a descendant must fail naming the receipt and the field.
"""

from __future__ import annotations

import gc
import json
import shutil
import sqlite3
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner, Result

from ledger import digests
from ledger.artifacts import ArtifactStore, default_root
from ledger.cli import app
from ledger.digests import prepared_digest
from ledger.errors import ChainBroken, DigestMismatch, MissingArtifact, RecordInvalid, RecordMismatch, VerificationError
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store, missing_parent
from tests.conftest import ReceiptChain, schema_fill
from verify.receipts import _cycles_collected_after, verify_receipt

MakeChain = Callable[..., ReceiptChain]
runner = CliRunner()


def verify_cli(db: Path, ref: str, *extra: str) -> Result:
    return runner.invoke(app, ["verify", ref, "--db", str(db), *extra])


def failed_line(result: Result, code: int = 1) -> str:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ledger: error: "), result.stderr
    return lines[0]


def sql(db: Path, statement: str, *params: Any) -> int:
    """Run one statement on the raw file; returns the number of rows changed (must be > 0 for a tamper)."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            changed = conn.execute(statement, params).rowcount
    finally:
        conn.close()
    return changed


SEQ = "(SELECT seq FROM receipts WHERE id = ?)"  # edge and artifact rows are keyed by receipts.seq


def seq_of(db: Path, rid: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(SEQ.strip("()"), (rid,)).fetchone()[0])
    finally:
        conn.close()


def _prepared(store: Store) -> str:
    """The prepared digest of the ledger's latest prepare receipt."""
    prepared = store.find(kind="prepare")[-1].receipt.prepared
    assert prepared is not None
    return prepared


def forge_train_start(c: ReceiptChain) -> Receipt:
    """A valid train-start that differs from ``c.train_start`` only in a measurement (a different id)."""
    old = c.train_start
    return make_receipt("train-start", run=old.run, rank=old.rank, step=old.step, prepared=old.prepared,
                        parents=list(old.parents), measurements={"world": 4})


def library_error(db: Path, ref: str) -> VerificationError:
    with Store.open(db) as store, pytest.raises(VerificationError) as info:
        verify_receipt(store, ref)
    return info.value


@pytest.fixture
def chain_db(ledger_db: Path, make_chain: MakeChain) -> tuple[Path, ReceiptChain]:
    c = make_chain()
    with Store.open(ledger_db) as store:
        store.append_many(c.receipts())
    assert verify_cli(ledger_db, c.eval.id).exit_code == 0
    return ledger_db, c


# -------------------------------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("position", [0, 40, -2, -1])
def test_one_byte_of_an_ancestor_body(chain_db: tuple[Path, ReceiptChain], position: int) -> None:
    db, c = chain_db
    victim = c.train_start
    body = bytearray(victim.body)
    body[position] ^= 0x01
    assert sql(db, "UPDATE receipts SET body = ? WHERE id = ?", bytes(body), victim.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert victim.id in line and "body" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, DigestMismatch)
    assert err.receipt == victim.id and err.field == "body" and err.expected == victim.id


def test_body_edited_with_sql_replace(chain_db: tuple[Path, ReceiptChain]) -> None:
    # What an operator would type in the sqlite3 shell; replace() on a BLOB stores TEXT, which must not crash.
    db, c = chain_db
    victim = c.train_start
    assert b'"world":1' in victim.body
    changed = sql(db, "UPDATE receipts SET body = replace(body, '\"world\":1', '\"world\":4') WHERE id = ?",
                  victim.id)
    assert changed == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert victim.id in line and "body" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, DigestMismatch) and err.receipt == victim.id and err.field == "body"


def test_consistent_rewrite_of_an_ancestor_is_caught_at_its_child(chain_db: tuple[Path, ReceiptChain]) -> None:
    # Replace train-start's body AND id in place: the row checks out alone, and the child's edge (keyed by seq)
    # now leads to the forged id, but the child's body names the old one.
    db, c = chain_db
    old = c.train_start
    forged = forge_train_start(c)
    assert sql(db, "UPDATE receipts SET id = ?, body = ? WHERE id = ?", forged.id, forged.body, old.id) == 1
    child = c.checkpoints[0]
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and "parents" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == child.id and err.field == "parents"
    assert err.expected == [old.id] and err.actual == [forged.id]


def test_forged_ancestor_in_a_new_row_is_caught_at_its_child(chain_db: tuple[Path, ReceiptChain]) -> None:
    # Delete train-start's row, append the forged receipt as a new row and move train-start's own edges to it:
    # the child's edge leads to no row, and its body names a receipt the ledger no longer holds.
    db, c = chain_db
    old = c.train_start
    forged = forge_train_start(c)
    old_seq = seq_of(db, old.id)
    assert sql(db, "DELETE FROM receipts WHERE id = ?", old.id) == 1
    sql(db, "INSERT INTO receipts (id, kind, run, rank, step, prepared, selection, body, recorded_ns) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)", forged.id, forged.kind, forged.run, forged.rank, forged.step,
        forged.prepared, forged.selection, forged.body)
    new_seq = seq_of(db, forged.id)
    assert sql(db, "UPDATE receipt_parents SET child_seq = ? WHERE child_seq = ?", new_seq, old_seq) == 1
    child = c.checkpoints[0]
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and old.id in line and "parent" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, ChainBroken) and err.receipt == child.id and err.field == "parents"
    # Re-pointing the child's edge at the forged row too only moves the mismatch to the child's parent list.
    assert sql(db, "UPDATE receipt_parents SET parent_seq = ? WHERE parent_seq = ?", new_seq, old_seq) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and "parents" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == child.id and err.field == "parents"
    assert err.expected == [old.id] and err.actual == [forged.id]


# ------------------------------------------------------------------------------------------------- edges
# Edge and artifact rows are keyed by receipts.seq (docs/receipts.md, Storage); SEQ finds a receipt's seq by id.


def test_edge_pointed_at_another_receipt(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    child = c.checkpoints[0]
    changed = sql(db, f"UPDATE receipt_parents SET parent_seq = {SEQ} WHERE child_seq = {SEQ} AND parent_seq = {SEQ}",
                  c.contract.id, child.id, c.train_start.id)
    assert changed == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and "parents" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == child.id and err.field == "parents"
    assert err.expected == [c.train_start.id] and err.actual == [c.contract.id]


def test_edge_pointed_at_no_row(chain_db: tuple[Path, ReceiptChain]) -> None:
    # The parent the body names is still stored, but the edge leads nowhere: an index row that lies.
    db, c = chain_db
    child = c.checkpoints[0]
    assert sql(db, f"UPDATE receipt_parents SET parent_seq = 999999 WHERE child_seq = {SEQ}", child.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and "parents" in line and "999999" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == child.id and err.field == "parents"
    assert err.expected == [c.train_start.id] and err.actual == [missing_parent(999999)]


@pytest.mark.parametrize("which", ["train_end", "eval"])
def test_deleted_edge(chain_db: tuple[Path, ReceiptChain], which: str) -> None:
    db, c = chain_db
    child = getattr(c, which)
    victim_parent = child.parents[0]
    assert sql(db, f"DELETE FROM receipt_parents WHERE child_seq = {SEQ} AND parent_seq = {SEQ}", child.id,
               victim_parent) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert child.id in line and "parents" in line
    err = library_error(db, c.eval.id)
    assert err.receipt == child.id and err.field == "parents"


def test_added_edge(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    assert sql(db, f"INSERT INTO receipt_parents (child_seq, parent_seq) VALUES ({SEQ}, {SEQ})", c.train_end.id,
               c.contract.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert c.train_end.id in line and "parents" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == c.train_end.id and err.field == "parents"
    assert err.actual == sorted([*c.train_end.parents, c.contract.id])


def test_deleted_ancestor_row(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    assert sql(db, "DELETE FROM receipts WHERE id = ?", c.train_start.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert c.checkpoints[0].id in line and c.train_start.id in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, ChainBroken) and err.receipt == c.checkpoints[0].id and err.field == "parents"


# ------------------------------------------------------------------------------------------ artifact rows


def test_one_hex_char_of_an_artifact_digest(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    victim = c.checkpoints[1]
    good = victim.artifacts["state"]
    bad = good[:-1] + ("0" if good[-1] != "0" else "1")
    assert sql(db, f"UPDATE receipt_artifacts SET digest = ? WHERE receipt_seq = {SEQ} AND name = 'state'", bad,
               victim.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert victim.id in line and "artifacts.state" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == victim.id and err.field == "artifacts.state"
    assert err.expected == good and err.actual == bad


def test_deleted_and_added_artifact_rows(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    assert sql(db, f"DELETE FROM receipt_artifacts WHERE receipt_seq = {SEQ} AND name = 'outcomes'", c.eval.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert c.eval.id in line and "artifacts.outcomes" in line
    sql(db, f"INSERT INTO receipt_artifacts (receipt_seq, name, digest) VALUES ({SEQ}, 'outcomes', ?)", c.eval.id,
        c.eval.artifacts["outcomes"])
    sql(db, f"INSERT INTO receipt_artifacts (receipt_seq, name, digest) VALUES ({SEQ}, 'extra', ?)", c.train_end.id,
        c.eval.artifacts["outcomes"])
    line = failed_line(verify_cli(db, c.eval.id))
    assert c.train_end.id in line and "artifacts.extra" in line


# ---------------------------------------------------------------------------------------------- columns


@pytest.mark.parametrize(
    ("which", "column", "value"),
    [
        ("train_end", "kind", "checkpoint"),
        ("checkpoints", "run", "run-z"),
        ("checkpoints", "rank", 1),
        ("checkpoints", "step", 3),
        ("selection", "prepared", digests.raw_digest(b"other")),
        ("eval", "selection", digests.raw_digest(b"other")),
        ("eval", "run", None),
    ],
)
def test_index_column_changed(chain_db: tuple[Path, ReceiptChain], which: str, column: str, value: Any) -> None:
    db, c = chain_db
    victim = c.checkpoints[0] if which == "checkpoints" else getattr(c, which)
    assert sql(db, f"UPDATE receipts SET {column} = ? WHERE id = ?", value, victim.id) == 1
    line = failed_line(verify_cli(db, c.eval.id))
    assert victim.id in line and f"stored {column}" in line
    err = library_error(db, c.eval.id)
    assert isinstance(err, RecordMismatch) and err.receipt == victim.id and err.field == column
    assert err.expected == getattr(victim, column) and err.actual == value


def test_tamper_outside_the_ancestry_is_out_of_scope(chain_db: tuple[Path, ReceiptChain]) -> None:
    db, c = chain_db
    sql(db, "UPDATE receipts SET kind = 'note' WHERE id = ?", c.contract.id)  # not an ancestor of the eval
    assert verify_cli(db, c.eval.id).exit_code == 0
    assert c.contract.id in failed_line(verify_cli(db, c.contract.id))


# -------------------------------------------------------------------------------------------- artifacts


@pytest.fixture
def artifact_db(ledger_db: Path, make_chain: MakeChain) -> tuple[Path, ReceiptChain, Path, str]:
    """A chain whose prepare cites a real file put into the default artifact store beside the database."""
    with Store.open(ledger_db) as store:
        artifacts = ArtifactStore(default_root(store.url))
        data = b"family,variant,prompt\n" * 1000
        digest = artifacts.put_bytes(data)
        c = make_chain(prepare_artifacts={"data": digest})
        store.append_many(c.receipts())
    path = artifacts.path_for(digest)
    assert path.is_file() and path.parent.parent.parent == ledger_db.parent / "artifacts"
    assert digests.file_digest(path) == digest
    return ledger_db, c, path, digest


def verify_json(db: Path, ref: str, *extra: str) -> dict[str, Any]:
    result = verify_cli(db, ref, "--json", *extra)
    assert result.exit_code == 0, (result.output, result.exception)
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_a_failed_verify_json_prints_its_diagnostics_on_stdout(artifact_db: tuple[Path, ReceiptChain, Path, str]
                                                                ) -> None:
    """docs/cli.md: the one line on stderr, exit 1, and with --json the diagnostics object on stdout."""
    db, c, path, digest = artifact_db
    path.write_bytes(path.read_bytes() + b"x")
    result = verify_cli(db, c.eval.id, "--json")
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.output
    value = json.loads(result.stdout)
    assert value["ok"] is False and value["error"] == "DigestMismatch" and value["expected"] == digest
    assert value["receipt"] == c.prepare.id and value["field"] == "artifacts.data"
    assert value["message"] in result.stderr


def test_an_artifact_replaced_by_a_fifo_fails_in_one_line_naming_it_once(
        artifact_db: tuple[Path, ReceiptChain, Path, str]) -> None:
    import os

    db, c, path, _digest = artifact_db
    path.unlink()
    os.mkfifo(path)
    line = failed_line(verify_cli(db, c.eval.id))  # refused unopened: no hang
    assert "is a FIFO" in line and line.count(str(path)) == 1, line


def test_present_artifact_is_verified(artifact_db: tuple[Path, ReceiptChain, Path, str]) -> None:
    db, c, _path, digest = artifact_db
    result = verify_cli(db, c.eval.id)
    assert result.exit_code == 0 and "1 distinct artifact(s) re-hashed" in result.stdout
    report = verify_json(db, c.eval.id)
    assert report["artifacts_verified"] == 1
    assert digest not in {m["digest"] for m in report["artifacts_missing"]}
    with Store.open(db) as store:
        checks = verify_receipt(store, c.eval.id, artifacts=ArtifactStore(default_root(store.url))).artifacts
    data_check = next(a for a in checks if a.name == "data")
    assert data_check.status == "verified" and data_check.receipt == c.prepare.id


def test_modified_artifact_fails(artifact_db: tuple[Path, ReceiptChain, Path, str]) -> None:
    db, c, path, digest = artifact_db
    content = bytearray(path.read_bytes())
    content[123] ^= 0x20
    path.write_bytes(bytes(content))
    line = failed_line(verify_cli(db, c.eval.id))
    assert "'data'" in line and c.prepare.id in line and digest in line
    with Store.open(db) as store, pytest.raises(DigestMismatch) as info:
        verify_receipt(store, c.eval.id, artifacts=ArtifactStore(default_root(store.url)))
    assert info.value.receipt == c.prepare.id and info.value.field == "artifacts.data"
    assert info.value.expected == digest and info.value.actual == digests.file_digest(path)


def test_deleted_artifact_is_missing_not_valid(artifact_db: tuple[Path, ReceiptChain, Path, str]) -> None:
    db, c, path, digest = artifact_db
    path.unlink()
    result = verify_cli(db, c.eval.id)
    assert result.exit_code == 0
    assert "0 distinct artifact(s) re-hashed" in result.stdout and "missing: " in result.stdout
    report = verify_json(db, c.eval.id)
    assert report["artifacts_verified"] == 0
    missing = [{k: m[k] for k in ("receipt", "name", "digest")} for m in report["artifacts_missing"]]
    assert {"receipt": c.prepare.id, "name": "data", "digest": digest} in missing
    # The chain's other artifacts are fake (never stored), so --require-artifacts fails on one of them.
    assert "missing" in failed_line(verify_cli(db, c.eval.id, "--require-artifacts"), code=3)


def test_require_artifacts(ledger_db: Path) -> None:
    with Store.open(ledger_db) as store:
        artifacts = ArtifactStore(default_root(store.url))
        data, model = artifacts.put_bytes(b"data " * 100), artifacts.put_bytes(b"model " * 100)
        prep_arts = {"data": data, "model": model}
        prepare = make_receipt("prepare", prepared=prepared_digest(prep_arts), artifacts=prep_arts)
        child = make_receipt("note", prepared=prepare.prepared, parents=[prepare], artifacts={"again": data})
        store.append_many([prepare, child])
    report = verify_json(ledger_db, child.id, "--require-artifacts")
    assert report["artifacts_verified"] == 3 and report["artifacts_missing"] == []
    artifacts.path_for(model).unlink()
    line = failed_line(verify_cli(ledger_db, child.id, "--require-artifacts"), code=3)
    assert model in line and "'model of receipt" in line and prepare.id in line and "missing" in line
    with Store.open(ledger_db) as store, pytest.raises(MissingArtifact) as info:
        verify_receipt(store, child.id, artifacts=artifacts, require_artifacts=True)
    assert info.value.digest == model and info.value.exit_code == 3
    assert verify_json(ledger_db, child.id)["artifacts_missing"] == [
        {"receipt": prepare.id, "name": "model", "digest": model, "location": None}  # no copy anywhere
    ]


@pytest.mark.parametrize("as_uri", [False, True])
def test_moved_copy_registered_as_a_location(artifact_db: tuple[Path, ReceiptChain, Path, str], tmp_path: Path,
                                              as_uri: bool) -> None:
    db, c, path, digest = artifact_db
    moved = tmp_path / "elsewhere" / "prompts.csv"
    moved.parent.mkdir()
    shutil.move(path, moved)
    assert verify_json(db, c.eval.id)["artifacts_verified"] == 0
    with Store.open(db) as store:
        store.add_location(digest, moved.as_uri() if as_uri else str(moved))
    assert verify_json(db, c.eval.id)["artifacts_verified"] == 1
    # A wrong copy at the registered location is not trusted.
    moved.write_bytes(b"something else")
    line = failed_line(verify_cli(db, c.eval.id))
    assert "'data'" in line and str(moved) in line


def test_artifacts_option_and_env_choose_the_root(artifact_db: tuple[Path, ReceiptChain, Path, str],
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db, c, path, digest = artifact_db
    other_root = tmp_path / "mirror"
    shutil.move(path.parent.parent.parent, other_root)
    assert verify_json(db, c.eval.id)["artifacts_verified"] == 0
    assert verify_json(db, c.eval.id, "--artifacts", str(other_root))["artifacts_verified"] == 1
    monkeypatch.setenv("LEDGER_ARTIFACTS", str(other_root))
    assert verify_json(db, c.eval.id)["artifacts_verified"] == 1


# ------------------------------------------------------------------------- one verifier for many receipts


def checkpoint_ledger(db: Path, tmp: Path) -> tuple[list[str], dict[str, Path]]:
    """A prepare (two artifact files), a run of three checkpoints with real directories (the second also copied
    elsewhere and recorded there), its train-end, and two tips citing the run at different points."""
    from ledger.state import checkpoint_digest, read_manifest
    from tests.helpers_state import make_checkpoint

    dirs = {f"step{s}": make_checkpoint(tmp / "run" / f"step{s}", model={"w": np.full((32, 8), s, np.float32)})
            for s in (2, 4, 6)}
    dirs["copy"] = tmp / "elsewhere" / "step4"
    shutil.copytree(dirs["step4"], dirs["copy"])
    with Store.open(db) as store:
        arts = ArtifactStore(default_root(store.url))
        artifacts = {"config": arts.put_bytes(b"config\n" * 50), "data": arts.put_bytes(b"data\n" * 5000)}
        prepare = make_receipt("prepare", run="v", prepared=prepared_digest(artifacts), artifacts=artifacts)
        start = make_receipt("train-start", run="v", rank=0, step=0, prepared=prepare.prepared, parents=[prepare],
                             measurements=schema_fill("train-start"))
        chain_: list[Receipt] = [start]
        for s in (2, 4, 6):
            chain_.append(make_receipt("checkpoint", run="v", rank=0, step=s, prepared=prepare.prepared,
                                       parents=[chain_[-1]], artifacts={"state": checkpoint_digest(dirs[f"step{s}"])},
                                       measurements=schema_fill("checkpoint", losses=[[s, 1.0 / s]],
                                                                files=dict(read_manifest(dirs[f"step{s}"]).files))))
        end = make_receipt("train-end", run="v", rank=0, step=6, prepared=prepare.prepared, parents=[chain_[-1]],
                           artifacts={"state": chain_[-1].artifacts["state"]}, measurements=schema_fill("train-end"))
        early = make_receipt("note", run="v", prepared=prepare.prepared, parents=[chain_[2]])
        late = make_receipt("note", run="v", prepared=prepare.prepared, parents=[end])
        store.append_many([prepare, *chain_, end, early, late])
        for r, d in zip(chain_[1:], ("step2", "step4", "step6"), strict=True):
            store.add_receipt_locations(r.id, {"state": str(dirs[d])})
        store.add_receipt_locations(end.id, {"state": str(dirs["step6"])})
        store.add_location(chain_[2].artifacts["state"], str(dirs["copy"]))
    return [early.id, late.id], dirs


def test_one_verifier_reports_what_each_verify_receipt_does(ledger_db: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import ledger.state as state_module
    from verify.receipts import Verifier

    tips, dirs = checkpoint_ledger(ledger_db, tmp_path)
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        alone = [verify_receipt(store, t, artifacts=arts, require_artifacts=True).to_json() for t in tips]
        opened: list[Path] = []
        hashed: list[Path] = []
        real_open, real_file = state_module._open, digests.file_digest

        def counting_open(p: Path, m: bool, *copies: Any) -> Any:
            opened.append(p)
            return real_open(p, m, *copies)

        monkeypatch.setattr(state_module, "_open", counting_open)

        def counting_file(p: Path, **kw: Any) -> str:
            hashed.append(Path(p))
            return real_file(p, **kw)

        monkeypatch.setattr(digests, "file_digest", counting_file)
        verifier = Verifier(store, arts, require_artifacts=True)
        together = [verifier.verify(t).to_json() for t in reversed(tips)][::-1]
    assert together == alone
    assert sorted(opened) == sorted(dirs.values())  # each checkpoint directory read once, the copy included
    assert len(hashed) == len(set(hashed))  # every file re-hashed once: artifacts and checkpoint files alike
    in_checkpoints = [p for p in hashed if any(d in p.parents for d in dirs.values())]
    assert len(hashed) - len(in_checkpoints) == 2  # the two artifact files
    assert set(in_checkpoints) == {f for d in dirs.values() for f in d.glob("*.safetensors")}  # the copy's too


def test_a_checkpoint_file_rewritten_with_the_same_state_fails_its_receipts_files(ledger_db: Path,
                                                                                    tmp_path: Path) -> None:
    """The state digest covers tensors and scalars only: a model file written again with other ``__metadata__``
    (the same tensors) and the manifest written again to match keep the state, and so pass every digest but the
    file digests the checkpoint receipt recorded (``measurements.files``), which name it."""
    from safetensors.numpy import load_file, save_file

    from ledger.state import read_manifest, write_manifest

    tips, dirs = checkpoint_ledger(ledger_db, tmp_path)
    model = dirs["step2"] / "model.safetensors"
    save_file(load_file(str(model)), str(model), metadata={"note": "rewritten"})
    meta = read_manifest(dirs["step2"]).meta
    write_manifest(dirs["step2"], dict(meta))
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        with pytest.raises(DigestMismatch) as info:
            verify_receipt(store, tips[0], artifacts=arts, require_artifacts=True)
    assert info.value.field == "measurements.files.model.safetensors"
    assert "model.safetensors" in info.value.one_line() and str(dirs["step2"]) in info.value.one_line()


@pytest.mark.parametrize("damaged", ["step2", "copy", "data"])
def test_one_verifier_fails_as_verify_receipt_does(ledger_db: Path, tmp_path: Path, damaged: str) -> None:
    from verify.receipts import Verifier

    tips, dirs = checkpoint_ledger(ledger_db, tmp_path)
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        if damaged == "data":
            data = next(p for p in (arts.root / "blake3").rglob("*") if p.is_file() and p.stat().st_size > 10_000)
            flip = bytearray(data.read_bytes())
            flip[77] ^= 1
            data.write_bytes(bytes(flip))
        else:
            flip_bit_in(dirs[damaged] / "model.safetensors")
        errors = []
        for t in tips:
            with pytest.raises(VerificationError) as alone:
                verify_receipt(store, t, artifacts=arts, require_artifacts=True)
            errors.append(alone.value)
        verifier = Verifier(store, arts, require_artifacts=True)
        for t, expected in zip(tips, errors, strict=True):
            with pytest.raises(VerificationError) as shared:
                verifier.verify(t)
            assert type(shared.value) is type(expected) and shared.value.one_line() == expected.one_line()


def flip_bit_in(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _notes_on(db: Path, count: int) -> list[str]:
    """``count`` notes appended under the ledger's prepare receipt, each citing the one before."""
    with Store.open(db) as store:
        prepare = store.find(kind="prepare")[-1].receipt
        prev, notes = prepare, []
        for i in range(count):
            prev = make_receipt("note", run="many", step=i, prepared=prepare.prepared, parents=[prev],
                                measurements={"i": i})
            notes.append(prev)
        store.append_many(notes)
    return [n.id for n in notes]


def test_verify_many_checks_what_one_verify_each_does(ledger_db: Path, tmp_path: Path) -> None:
    from verify.receipts import Verifier

    checkpoint_ledger(ledger_db, tmp_path)
    _notes_on(ledger_db, 30)
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        ids = store.ids(prepared=_prepared(store))
        one_by_one = Verifier(store, arts, require_artifacts=True)
        expected = sorted({line for rid in ids for line in one_by_one.verify(rid).checks})
        many = Verifier(store, arts, require_artifacts=True)
        assert sorted(set(many.verify_many(ids))) == expected
        assert many.chained == one_by_one.chained == set(ids)
        whole = Verifier(store, arts, require_artifacts=True)
        assert sorted(set(whole.verify_experiment(store.latest_prepared()))) == expected
        assert whole.chained == set(ids)


@pytest.mark.parametrize("way", ["many", "experiment"])
@pytest.mark.parametrize("with_artifacts", [True, False])
def test_verify_many_checks_a_receipt_with_verified_parents_alone(ledger_db: Path, tmp_path: Path, way: str,
                                                                  with_artifacts: bool, monkeypatch: Any) -> None:
    """A chain verified in order never goes back through verify (and its receipt's whole ancestry), with or
    without artifacts: without them, each note used to, so verifying a chain of n took time quadratic in n."""
    from verify.receipts import Verifier

    checkpoint_ledger(ledger_db, tmp_path)
    _notes_on(ledger_db, 40)
    with Store.open(ledger_db) as store:
        prepared = store.latest_prepared()
        assert prepared is not None
        ids = store.ids(prepared=prepared)
        verifier = Verifier(store, ArtifactStore(default_root(store.url)) if with_artifacts else None)
        through_verify: list[str] = []
        verify = verifier.verify

        def spied(ref: str, **kw: Any) -> Any:
            through_verify.append(ref)
            return verify(ref, **kw)

        monkeypatch.setattr(verifier, "verify", spied)
        if way == "many":
            verifier.verify_many(ids)
        else:
            verifier.verify_experiment(prepared)
        assert verifier.chained == set(ids)
        assert through_verify == [], len(through_verify)


@pytest.mark.parametrize("way", ["many", "experiment"])
@pytest.mark.parametrize("tamper", ["body", "edge", "artifact"])
def test_verify_many_fails_as_one_verify_each_does(ledger_db: Path, tmp_path: Path, tamper: str, way: str) -> None:
    from verify.receipts import Verifier

    tips, dirs = checkpoint_ledger(ledger_db, tmp_path)
    notes = _notes_on(ledger_db, 12)
    if tamper == "body":
        sql(ledger_db, "UPDATE receipts SET body = replace(body, '\"i\":7', '\"i\":8') WHERE id = ?", notes[7])
    elif tamper == "edge":
        sql(ledger_db, f"UPDATE receipt_parents SET parent_seq = {SEQ} WHERE child_seq = {SEQ}", notes[2], notes[9])
    else:
        flip_bit_in(dirs["step6"] / "model.safetensors")
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        ids = store.ids(prepared=_prepared(store))
        with pytest.raises(VerificationError) as one_each:
            verifier = Verifier(store, arts, require_artifacts=True)
            for rid in ids:
                verifier.verify(rid)
        with pytest.raises(VerificationError) as many:
            if way == "many":
                Verifier(store, arts, require_artifacts=True).verify_many(ids)
            else:
                Verifier(store, arts, require_artifacts=True).verify_experiment(store.latest_prepared())
        # the rows' reader stopped where the failure did: no read transaction left open behind it
        assert all(reads.conn is None or not reads.conn.in_transaction for reads in store._opened)
    assert type(many.value) is type(one_each.value) and many.value.one_line() == one_each.value.one_line()


def test_a_recorded_checkpoint_copy_that_is_a_symlink_is_refused(ledger_db: Path, tmp_path: Path) -> None:
    """A link to a good copy has the right bytes behind it, but the recorded place is the link: a link could point
    anywhere, outside every place the ledger recorded, so a copy must be a directory itself."""
    tips, dirs = checkpoint_ledger(ledger_db, tmp_path)
    link = tmp_path / "linked-step4"
    link.symlink_to(dirs["step4"], target_is_directory=True)
    with Store.open(ledger_db) as store:
        arts = ArtifactStore(default_root(store.url))
        verify_receipt(store, tips[1], artifacts=arts, require_artifacts=True)  # holds before the link is recorded
        state = store.find(kind="checkpoint", run="v")[1].receipt.artifacts["state"]
        store.add_location(state, str(link))
        with pytest.raises(RecordInvalid, match="is a symbolic link, not a copy") as info:
            verify_receipt(store, tips[1], artifacts=arts, require_artifacts=True)
    assert str(link) in info.value.one_line()


def test_a_verification_hands_what_it_made_to_the_oldest_generation() -> None:
    """The collector is off while verifying; when it ends, what was made goes to the oldest generation instead of
    waiting in the youngest for the first allocation after, which would traverse all of it. A cycle made meanwhile
    is still collected."""

    class Node:
        me: Node

    gc.enable()
    with _cycles_collected_after():
        assert not gc.isenabled()
        kept = [[i] for i in range(20_000)]
        cycle = Node()
        cycle.me = cycle
        dead = weakref.ref(cycle)
        del cycle
    assert gc.isenabled()
    assert any(o is kept for o in gc.get_objects(generation=2))
    gc.collect()
    assert dead() is None


def test_objects_the_caller_froze_stay_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with _cycles_collected_after():
            pass
        assert gc.isenabled() and gc.get_freeze_count() == frozen > 0
    finally:
        gc.unfreeze()
