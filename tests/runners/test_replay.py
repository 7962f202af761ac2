"""`ledger replay`: re-execute a recorded training segment (step 4 -> 8 of a 4-rank DiLoCo run) and get every
rank's recorded step-8 state bit for bit; an altered recorded output, or a record claiming another state, fails
and is named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from ledger.artifacts import path_from_uri
from ledger.cli import app
from ledger.errors import ResumeDivergence
from ledger.receipts import Receipt, make_receipt
from ledger.state import SafetensorsFile
from ledger.store import Store
from runners.replay import REPLAY_FORMAT, replay
from tests.conftest import TinyExperiment, clear_ledger_env
from tests.runners.test_recover import one_error_line

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 4
RUN = "train/diloco-four"
runner = CliRunner()


def cli(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


@dataclass(frozen=True)
class Trained:
    workdir: Path
    db: Path
    prepare: Receipt
    start: dict[int, Receipt]  # rank -> train-start
    step4: dict[int, Receipt]  # rank -> checkpoint at step 4
    step8: dict[int, Receipt]  # rank -> checkpoint at step 8


@pytest.fixture(scope="module")
def trained(tiny_experiment: TinyExperiment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """A copy of the session's tiny experiment: its DiLoCo arm run is the recorded segment replayed here."""
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: the per-test hermetic env fixture runs too late
        clear_ledger_env(mp)
        copy = tiny_experiment.copy(tmp_path_factory.mktemp("replay") / "experiment")
        workdir, db = copy.workdir, copy.db
        with Store.open(db) as store:
            def by_rank(kind: str, step: int | None = None) -> dict[int, Receipt]:
                found = [s.receipt for s in store.find(kind=kind, run=RUN, step=step)]
                assert len(found) == WORLD
                return {r.rank or 0: r for r in found}

            done = Trained(workdir, db, store.find(kind="prepare")[-1].receipt, by_rank("train-start"),
                           by_rank("checkpoint", 4), by_rank("checkpoint", 8))
        yield done


def test_replay_reproduces_every_rank_and_records_a_verifiable_comparison(trained: Trained) -> None:
    with Store.open(trained.db) as store:
        before = store.count()
    result = cli("replay", trained.step4[0].id, "--workdir", trained.workdir, "--db", trained.db, "--record",
                 "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == REPLAY_FORMAT and doc["passed"] is True
    assert (doc["run"], doc["arm"], doc["from_step"], doc["to_step"]) == (RUN, "diloco-four", 4, 8)
    assert [r["rank"] for r in doc["ranks"]] == list(range(WORLD))
    for row in doc["ranks"]:
        recorded = trained.step8[row["rank"]]
        # Every rank's re-executed step-8 state is the recorded one, bit for bit (the whole state digest).
        assert row["recorded_receipt"] == recorded.id and row["equal"] is True
        assert row["replayed_state"] == row["recorded_state"] == recorded.artifacts["state"]
    with Store.open(trained.db) as store:
        assert store.count() == before + 1  # the replay itself appends nothing but its comparison
        receipt = store.get(doc["receipt"]).receipt
    assert receipt.kind == "comparison" and receipt.measurements["format"] == REPLAY_FORMAT
    assert set(receipt.parents) == {r.id for r in (*trained.step4.values(), *trained.step8.values())}
    verified = cli("verify", receipt.id, "--db", trained.db)
    assert verified.exit_code == 0, verified.output
    assert f"OK {receipt.id}" in verified.stdout


def _flip_data_byte(path: Path, tensor: str) -> None:
    with SafetensorsFile(path) as sf:
        at = sf.tensors[tensor].begin
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_replay_of_an_altered_recorded_output_fails_naming_it(trained: Trained) -> None:
    """One byte of rank 3's recorded step-8 optimizer state is edited after its receipt was written: in the copy
    the experiment's recovery recorded (the same state, bit for bit), not the run's own, since every recorded copy
    of a claimed state is checked, not the first one found."""
    recorded = trained.step8[3]
    with Store.open(trained.db) as store:
        located = [path_from_uri(u) for u in store.locations(recorded.artifacts["state"])]
    dirs = [p for p in located if p is not None and p.is_dir()]
    own = trained.workdir / "runs" / "train_diloco-four" / "rank3" / "step0000008"
    others = [d for d in dirs if d.resolve() != own.resolve()]
    assert own.resolve() in [d.resolve() for d in dirs] and len(others) == 1, dirs
    target = others[0] / "optimizer.safetensors"
    with Store.open(trained.db) as store:  # the receipt that recorded that copy: the recovered run's step 8
        (copied,) = [s.receipt for s in store.find(kind="checkpoint", run="recover/diloco-four", rank=3, step=8)]
    assert copied.artifacts["state"] == recorded.artifacts["state"]
    with SafetensorsFile(target) as sf:
        tensor = sorted(sf.tensors)[0]
    _flip_data_byte(target, tensor)
    try:
        result = cli("replay", trained.step4[0].id, "--workdir", trained.workdir, "--db", trained.db)
        assert result.exit_code == 1, result.output
        line = one_error_line(result)
        assert f"receipt {copied.id}: checkpoint {others[0]}: component 'optimizer' tensor '{tensor}'" in line
        assert "does not match its manifest" in line
    finally:
        _flip_data_byte(target, tensor)


def _forge(store: Store, trained: Trained, run: str, claim: dict[int, Receipt]) -> dict[int, Receipt]:
    """A run whose ranks start and checkpoint at step 4 exactly like the real one, then record ``claim[rank]``'s
    artifacts as their step-8 checkpoint: a record the chain rules accept but the work does not produce."""
    step4: dict[int, Receipt] = {}
    for rank in range(WORLD):
        real = trained.start[rank]
        start = make_receipt("train-start", run=run, rank=rank, step=0, prepared=real.prepared,
                             parents=[trained.prepare], artifacts=dict(real.artifacts),
                             measurements=dict(real.measurements))
        c4 = make_receipt("checkpoint", run=run, rank=rank, step=4, prepared=real.prepared, parents=[start],
                          artifacts=dict(trained.step4[rank].artifacts),
                          measurements=dict(trained.step4[rank].measurements))
        c8 = make_receipt("checkpoint", run=run, rank=rank, step=8, prepared=real.prepared, parents=[c4],
                          artifacts=dict(claim[rank].artifacts),
                          measurements=dict(trained.step8[rank].measurements))
        store.append_many([start, c4, c8])
        step4[rank] = c4
    return step4


def test_replay_of_a_forged_record_fails_naming_the_rank(trained: Trained) -> None:
    """Rank 2's step-8 record claims its step-4 state (no work done): replay does the work and disagrees."""
    claim = dict(trained.step8) | {2: trained.step4[2]}
    with Store.open(trained.db) as store:
        step4 = _forge(store, trained, "forged/diloco-four", claim)
        forged8 = store.find(kind="checkpoint", run="forged/diloco-four", rank=2, step=8)[0].receipt
    assert forged8.artifacts["state"] == trained.step4[2].artifacts["state"]
    # Its files are all there and verify: only re-executing the segment shows the claim is false.
    verified = cli("verify", forged8.id, "--db", trained.db)
    assert verified.exit_code == 0, verified.output
    with pytest.raises(ResumeDivergence) as info:
        replay(trained.workdir, str(trained.db), step4[0].id)
    err = info.value
    assert err.receipt == forged8.id and err.field == "artifacts.state"
    assert err.expected == trained.step4[2].artifacts["state"] and err.actual == trained.step8[2].artifacts["state"]
    message = err.one_line()
    assert message.startswith(f"replay of run forged/diloco-four steps 4..8: rank 2 does not reproduce checkpoint "
                              f"receipt {forged8.id}: ")
    assert "model/" in message and "first difference at element" in message  # located against the claimed files
