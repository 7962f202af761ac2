"""Replay: re-execute one recorded training segment and check it reproduces the recorded result bit for bit.

Given a checkpoint receipt (step s of a run), every rank of that run is restored from its own step-s checkpoint
and runs, with the recorded config and nothing appended to the ledger, up to the run's next checkpoint step t.
Each rank's resulting state digest must equal its recorded step-t checkpoint receipt's; the recorded step-t files,
where present, must still verify too. An auditor spot-checks an operator's claimed work this way without
trusting their files beyond the starting checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger.errors import InputError, LedgerError, ResumeDivergence
from ledger.experiment.config import ARMS
from ledger.experiment.formats import REPLAY_FORMAT
from ledger.receipts import Receipt, a_kind, make_receipt
from ledger.store import Store
from runners.train import train_arm


@dataclass
class ReplayResult:
    run: str
    arm: str
    from_step: int
    to_step: int
    ranks: list[dict[str, Any]]
    seconds: float
    receipt: Receipt | None = None

    @property
    def passed(self) -> bool:
        return all(r["equal"] for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"format": REPLAY_FORMAT, "run": self.run, "arm": self.arm, "from_step": self.from_step,
                "to_step": self.to_step, "passed": self.passed, "ranks": self.ranks, "seconds": self.seconds,
                "receipt": self.receipt.id if self.receipt else None}


def _segment(store: Store, start: Receipt) -> tuple[dict[int, Receipt], dict[int, Receipt]]:
    """The step-s checkpoints of every rank of the run (the lineage of ``start``) and each one's next checkpoint."""
    world = int(start.measurements.get("world", 1))
    begin: dict[int, Receipt] = {}
    end: dict[int, Receipt] = {}
    for rank in range(world):
        here = [s.receipt for s in store.find(kind="checkpoint", run=start.run, rank=rank, step=start.step)]
        if not here:
            raise InputError(f"run {start.run}: rank {rank} has no checkpoint at step {start.step} to replay from")
        # Several attempts (a killed group and its restart) may share a step; take the one on start's lineage,
        # i.e. with the same state as start's for start's own rank, else the latest.
        mine = [r for r in here if r.id == start.id]
        begin[rank] = mine[0] if mine else here[-1]
        nxt = [s.receipt for s in store.descendants(begin[rank].id)
               if s.receipt.kind == "checkpoint" and s.receipt.rank == rank and s.receipt.run == start.run
               and (s.receipt.step or 0) > (start.step or 0)]
        if not nxt:
            raise InputError(f"run {start.run}: rank {rank} recorded no checkpoint after step {start.step}")
        end[rank] = min(nxt, key=lambda r: r.step or 0)
    steps = {r.step or 0 for r in end.values()}
    if len(steps) != 1:
        raise LedgerError(f"run {start.run}: ranks' next checkpoints are at different steps {sorted(steps)}")
    return begin, end


def replay(workdir: Path, db: str, ref: str, *, record: bool = False, timeout: float = 30.0) -> ReplayResult:
    """Replay the segment that starts at checkpoint receipt ``ref``; raise ResumeDivergence naming the rank,
    component and tensor if any rank's result differs from what was recorded."""
    from ledger.state import checkpoint_digest
    from verify.state import compare_states, resolve_checkpoint

    with Store.open(db) as store:
        start = store.get(ref).receipt
        if start.kind != "checkpoint":
            raise InputError(f"receipt {start.id} is {a_kind(start.kind)} receipt; replay starts from a checkpoint")
        arm = str(start.measurements.get("arm"))
        if arm not in ARMS:
            raise InputError(f"receipt {start.id} names no known arm ({arm!r})")
        begin, end = _segment(store, start)
        prepared = start.prepared
        # The recorded output's own files must still be what its receipts say (an edited file is named here);
        # checked before re-executing, so an altered record fails without spending the compute.
        from ledger.artifacts import ArtifactStore, workdir_root
        from verify.receipts import verify_receipt

        for recorded in end.values():
            verify_receipt(store, recorded.id, artifacts=ArtifactStore(workdir_root(workdir)))
    to_step = next(iter(end.values())).step or 0
    with tempfile.TemporaryDirectory(prefix="ledger-replay-") as tmp:
        mapping = Path(tmp) / "restore.json"
        mapping.write_text(json.dumps({str(k): v.id for k, v in begin.items()}))
        out = Path(tmp) / "out"
        result, _ = train_arm(workdir, db, arm, run=start.run or "replay", prepared=prepared, steps=to_step,
                              timeout=timeout, extra=["--restore", str(mapping), "--no-ledger", "--out", str(out)])
        if not result.ok:
            raise LedgerError(f"replay of {start.run} from step {start.step} failed (exit codes {result.returncodes})")
        ranks: list[dict[str, Any]] = []
        with Store.open(db) as store:
            for rank, recorded in sorted(end.items()):
                produced = out / f"rank{rank}" / f"step{to_step:07d}"
                digest = checkpoint_digest(produced)
                row: dict[str, Any] = {"rank": rank, "recorded_receipt": recorded.id,
                                       "recorded_state": recorded.artifacts["state"], "replayed_state": digest,
                                       "equal": digest == recorded.artifacts["state"]}
                if not row["equal"]:
                    detail = "state digests differ"
                    try:  # locate the first difference against the recorded files, when they are here
                        cmp = compare_states(resolve_checkpoint(store, recorded.id), produced, files=False)
                        first = cmp.first_difference
                        detail = first.one_line() if first else detail
                    except LedgerError as exc:
                        detail += f" (recorded files not comparable: {exc.one_line()})"
                    raise ResumeDivergence(
                        f"replay of run {start.run} steps {start.step}..{to_step}: rank {rank} does not reproduce "
                        f"checkpoint receipt {recorded.id}: {detail}", receipt=recorded.id,
                        field="artifacts.state", expected=recorded.artifacts["state"], actual=digest)
                ranks.append(row)
            res = ReplayResult(start.run or "", arm, start.step or 0, to_step, ranks, result.seconds)
            if record:
                res.receipt = store.append(make_receipt(
                    "comparison", run=start.run, step=to_step, prepared=prepared,
                    parents=[*begin.values(), *end.values()],
                    measurements={k: v for k, v in res.to_json().items() if k != "receipt"},
                )).receipt
    return res
