"""Recovery: kill a rank mid-run, restart the group from the last checkpoint every rank completed, finish, and
prove each rank ends exactly where the uninterrupted run ends.

The uninterrupted run is the arm's training run already in the ledger (``train/<arm>``), or trained here if
absent. The recovered run (``recover/<arm>``) starts like any training run; the launcher SIGKILLs one rank right
after its chosen step; the survivors' collectives fail when the peer's connection drops (bounded by the worker's
collective timeout, so nothing hangs for torch's 30-minute default) and the launcher tears the group down. The
whole group then restarts from the common checkpoint, each rank appending a ``restore`` receipt that names the
checkpoint receipt it loaded. Receipts: ``fault``, ``restore`` (per rank, by the workers), the restarted ranks'
``checkpoint``/``train-end``, one ``comparison`` per rank, and a ``comparison`` summarising the recovery.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ledger.errors import LedgerError
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from ledger.experiment.config import ARMS
from runners.train import summarize_arm, train_arm
from verify.recovery import SUMMARY_FORMAT, SUMMARY_SCOPE, compare_rank, rank_passed


@dataclass
class RecoveryResult:
    summary: Receipt
    comparisons: list[Receipt]
    passed: bool


def _ends(store: Store, prepared: str, run: str) -> dict[int, Receipt]:
    return {s.receipt.rank or 0: s.receipt for s in store.find(kind="train-end", run=run, prepared=prepared)}


def _fresh_run(store: Store, name: str) -> str:
    """``name`` if the ledger has no receipt of that run, else ``name/2``, ``name/3``, ..."""
    candidate, n = name, 1
    while store.find(run=candidate, limit=1):
        n += 1
        candidate = f"{name}/{n}"
    return candidate


def latest_common_checkpoint(store: Store, prepared: str, run: str, world: int) -> dict[int, Receipt]:
    """For each rank, the checkpoint receipt at the last step that EVERY rank completed in ``run``."""
    by_rank: dict[int, dict[int, Receipt]] = {r: {} for r in range(world)}
    for s in store.find(kind="checkpoint", run=run, prepared=prepared):
        r = s.receipt
        assert r.rank is not None and r.step is not None
        by_rank.setdefault(r.rank, {})[r.step] = r
    common = set.intersection(*(set(steps) for steps in by_rank.values())) if by_rank else set()
    if not common:
        raise LedgerError(f"run {run}: no checkpoint step that all {world} ranks completed; nothing to resume from")
    step = max(common)
    return {rank: steps[step] for rank, steps in by_rank.items()}


def run_recover(workdir: Path, db: str, *, arm: str = "diloco-four", kill_rank: int = 1,
                kill_after_step: int | None = None, prepared: str | None = None, steps: int | None = None,
                timeout: float = 20.0, restore_extra: list[str] | None = None,
                run: str | None = None) -> RecoveryResult:
    """Run the uninterrupted arm if needed, the killed group, the restart, and the per-rank comparisons.

    ``run`` names the recovered run (default ``recover/<arm>``, or ``recover/<arm>/<n>`` when the ledger already has
    that run): each attempt is its own run, so its common checkpoint is never taken from an earlier attempt.
    """
    world = ARMS[arm].world
    if not 0 <= kill_rank < world:
        raise LedgerError(f"--kill-rank {kill_rank}: arm {arm} has ranks 0..{world - 1}")
    with Store.open(db) as store:
        prep = store.latest_prepared(prepared)
        from ledger.artifacts import ArtifactStore, default_root
        from runners.prepare import load_prepared

        cfg = load_prepared(store, ArtifactStore(default_root(store.url)), prep).config
    last = steps if steps is not None else cfg.train.steps
    every = cfg.train.checkpoint_every
    if kill_after_step is None:  # the reference: checkpoints every 64, killed after 75 (a little past one)
        kill_after_step = min(last - 1, every + max(1, every // 6))
    if not every <= kill_after_step < last:
        raise LedgerError(f"--kill-after-step {kill_after_step} must be at least one checkpoint in ({every}) and "
                          f"before the last step ({last})")

    with Store.open(db) as store:
        # Reuse a complete uninterrupted run of the same length: the arm's training run, or an earlier recovery's.
        bases = [f"train/{arm}", f"recover/{arm}/uninterrupted"]
        complete = [b for b in bases if len(have := _ends(store, prep, b)) == world
                    and all(e.step == last for e in have.values())]
        base = complete[0] if complete else _fresh_run(store, bases[1])
        if run is None:
            run = _fresh_run(store, f"recover/{arm}")
        elif store.find(run=run, limit=1):
            raise LedgerError(f"run {run} is already in the ledger; a recovery attempt needs a run of its own")
    if not complete:
        res, _ = train_arm(workdir, db, arm, run=base, prepared=prep, steps=steps, timeout=timeout)
        if not res.ok:
            raise LedgerError(f"uninterrupted {arm} run failed (exit codes {res.returncodes})")

    trigger = workdir / "logs" / f"kill-{run.replace('/', '_')}-{time.time_ns()}.json"
    trigger.parent.mkdir(parents=True, exist_ok=True)
    failed, _ = train_arm(workdir, db, arm, run=run, prepared=prep, steps=steps, timeout=timeout,
                          extra=["--kill-after-step", str(kill_after_step), "--kill-rank", str(kill_rank),
                                 "--kill-trigger", str(trigger)], kill=(kill_rank, trigger))
    if failed.ok or not trigger.exists():
        raise LedgerError(f"the planned kill of rank {kill_rank} after step {kill_after_step} did not happen "
                          f"(exit codes {failed.returncodes})")
    observed = json.loads(trigger.read_text())  # written atomically by the rank once the step is done

    with Store.open(db) as store:
        restore = latest_common_checkpoint(store, prep, run, world)
        resume_step = next(iter(restore.values())).step or 0
        fault = store.append(make_receipt(
            "fault", run=run, rank=kill_rank, step=observed["step"], prepared=prep,
            parents=list(restore.values()),
            measurements={"killed_rank": kill_rank, "signal": "SIGKILL", "last_observed_step": observed["step"],
                          "failed_group_seconds": failed.seconds, "detect_seconds": failed.detect_seconds,
                          "returncodes": failed.returncodes, "restore_step": resume_step,
                          "restore": {str(k): v.id for k, v in sorted(restore.items())}},
        )).receipt
    mapping = workdir / "logs" / f"restore-{fault.id[7:23]}.json"
    mapping.write_text(json.dumps({str(k): v.id for k, v in restore.items()}))
    restarted, _ = train_arm(workdir, db, arm, run=run, prepared=prep, steps=steps, timeout=timeout,
                             extra=["--restore", str(mapping), *(restore_extra or [])])
    if not restarted.ok:
        raise LedgerError(f"the restarted {arm} group failed (exit codes {restarted.returncodes})")

    with Store.open(db) as store:
        summarize_arm(store, prep, arm, run)
        unint, recov = _ends(store, prep, base), _ends(store, prep, run)
        comparisons: list[Receipt] = []
        rows = []
        for rank in range(world):
            m = compare_rank(store, unint[rank], recov[rank], resume_step)
            m["seconds"] = recov[rank].measurements["loop_seconds"]
            rows.append(m)
            comparisons.append(store.append(make_receipt(
                "comparison", run=run, rank=rank, step=recov[rank].step, prepared=prep,
                parents=[unint[rank], recov[rank]],
                artifacts={"uninterrupted_state": unint[rank].artifacts["state"],
                           "recovered_state": recov[rank].artifacts["state"]},
                measurements=m,
            )).receipt)
        passed = all(rank_passed(m) for m in rows)
        summary = store.append(make_receipt(
            "comparison", run=run, prepared=prep, parents=[fault, *comparisons],
            measurements={"format": SUMMARY_FORMAT, "arm": arm, "killed_rank": kill_rank,
                          "last_observed_step_before_kill": observed["step"], "restore_step": resume_step,
                          "failed_group_seconds": failed.seconds, "detect_seconds": failed.detect_seconds,
                          "restarted_group_seconds": restarted.seconds,
                          "all_rank_state_and_trajectory_comparisons_passed": passed,
                          "uninterrupted_run": base, "recovered_run": run, "scope": SUMMARY_SCOPE},
        )).receipt
    return RecoveryResult(summary, comparisons, passed)
