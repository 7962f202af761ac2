"""Recovery: kill a rank mid-run, restart the group from the last checkpoint every rank completed, finish, and
prove each rank ends exactly where the uninterrupted run ends.

The uninterrupted run is the arm's training run already in the ledger (``train/<arm>``), or trained here if
absent. The recovered run (``recover/<arm>``) starts like any training run; the launcher SIGKILLs one rank right
after its chosen step; the survivors' collectives fail when the peer's connection drops (bounded by the worker's
collective timeout, so nothing hangs for torch's 30-minute default) and the launcher tears the group down. The
whole group then restarts from the common checkpoint, each rank appending a ``restore`` receipt that names the
checkpoint receipt it loaded. Receipts: ``fault``, ``restore`` (per rank, by the workers), the restarted ranks'
``checkpoint``/``train-end``, one ``comparison`` per rank, and a ``comparison`` summarising the recovery.

:func:`run_recover` runs these steps in order, each opening the ledger at most once: :func:`plan_recovery`,
:func:`train_uninterrupted` (only if no complete reference run exists), :func:`run_killed`,
:func:`record_fault` (which chooses the common checkpoint), :func:`run_restarted` and :func:`compare_recovery`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ledger.artifacts import ArtifactStore, workdir_root
from ledger.errors import InputError, LedgerError
from ledger.experiment.config import ARMS
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners.distributed import LaunchResult
from runners.hosts import HostSet
from runners.prepare import load_prepared
from runners.train import summarize_arm, train_arm
from verify.recovery import SUMMARY_FORMAT, SUMMARY_SCOPE, compare_rank, rank_passed


@dataclass
class RecoveryResult:
    summary: Receipt
    comparisons: list[Receipt]
    passed: bool


@dataclass(frozen=True)
class RecoveryPlan:
    """What one recovery attempt will do, settled from the ledger before any rank is launched."""

    arm: str
    world: int
    prepared: str
    last_step: int
    kill_rank: int
    kill_after_step: int
    base: str  # the uninterrupted run compared against
    base_complete: bool  # False: train ``base`` first
    run: str  # the recovered run


@dataclass(frozen=True)
class KilledGroup:
    """The group launched with a planned kill, and the step the killed rank reported completing."""

    result: LaunchResult
    observed_step: int
    host: str | None = None  # the namespace host that died with the rank (``kill_host``), else None


@dataclass(frozen=True)
class Fault:
    """The ``fault`` receipt and each rank's checkpoint receipt at the common step the group restarts from."""

    receipt: Receipt
    restore: dict[int, Receipt]
    resume_step: int


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


def plan_recovery(workdir: Path, db: str, *, arm: str | None = None, kill_rank: int = 1,
                  kill_after_step: int | None = None, prepared: str | None = None, steps: int | None = None,
                  run: str | None = None) -> RecoveryPlan:
    """Settle the arm (default: the prepared config's ``contract.primary_arm``), the kill, the uninterrupted run
    to compare against (reused if complete) and the recovered run's name; refuse impossible requests."""
    with Store.open(db) as store:
        prep = store.latest_prepared(prepared)
        cfg = load_prepared(store, ArtifactStore(workdir_root(workdir)), prep).config
        arm = arm if arm is not None else cfg.contract.primary_arm
        if arm not in ARMS:
            raise InputError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        world = ARMS[arm].world
        if not 0 <= kill_rank < world:
            raise LedgerError(f"--kill-rank {kill_rank}: arm {arm} has ranks 0..{world - 1}")
        last = steps if steps is not None else cfg.train.steps
        every = cfg.train.checkpoint_every
        if kill_after_step is None:  # the reference: checkpoints every 64, killed after 75 (a little past one)
            kill_after_step = min(last - 1, every + max(1, every // 6))
        if not every <= kill_after_step < last:
            raise LedgerError(f"--kill-after-step {kill_after_step} must be at least one checkpoint in ({every}) "
                              f"and before the last step ({last})")
        # Reuse a complete uninterrupted run of the same length: the arm's training run, or an earlier recovery's.
        bases = [f"train/{arm}", f"recover/{arm}/uninterrupted"]
        complete = [b for b in bases if len(have := _ends(store, prep, b)) == world
                    and all(e.step == last for e in have.values())]
        base = complete[0] if complete else _fresh_run(store, bases[1])
        if run is None:
            run = _fresh_run(store, f"recover/{arm}")
        elif store.find(run=run, limit=1):
            raise LedgerError(f"run {run} is already in the ledger; a recovery attempt needs a run of its own")
    return RecoveryPlan(arm, world, prep, last, kill_rank, kill_after_step, base, bool(complete), run)


def train_uninterrupted(workdir: Path, db: str, plan: RecoveryPlan, *, steps: int | None,
                        timeout: float, hosts: HostSet | None = None) -> None:
    """Train the reference run ``plan.base`` from the start, uninterrupted (RunFailed if it fails)."""
    train_arm(workdir, db, plan.arm, run=plan.base, prepared=plan.prepared, steps=steps, timeout=timeout,
              hosts=hosts)


def run_killed(workdir: Path, db: str, plan: RecoveryPlan, *, steps: int | None, timeout: float,
               hosts: HostSet | None = None, kill_host: bool = False) -> KilledGroup:
    """Launch the recovered run with its planned kill; the group must fail because of it (and only so). With
    ``kill_host`` the killed rank's namespace host dies with it (docs/hosts.md)."""
    trigger = workdir / "logs" / f"kill-{plan.run.replace('/', '_')}-{time.time_ns()}.json"
    trigger.parent.mkdir(parents=True, exist_ok=True)
    failed, _ = train_arm(workdir, db, plan.arm, run=plan.run, prepared=plan.prepared, steps=steps, timeout=timeout,
                          extra=["--kill-after-step", str(plan.kill_after_step), "--kill-rank", str(plan.kill_rank),
                                 "--kill-trigger", str(trigger)], kill=(plan.kill_rank, trigger), check=False,
                          hosts=hosts, kill_host=kill_host)
    if failed.ok or not trigger.exists():
        raise LedgerError(f"the planned kill of rank {plan.kill_rank} after step {plan.kill_after_step} did not "
                          f"happen (exit codes {failed.returncodes})")
    observed = json.loads(trigger.read_text())  # written atomically by the rank once the step is done
    return KilledGroup(failed, int(observed["step"]), hosts[plan.kill_rank].name if hosts and kill_host else None)


def record_fault(db: str, plan: RecoveryPlan, killed: KilledGroup) -> Fault:
    """Choose the last checkpoint every rank of the killed group completed and append the ``fault`` receipt."""
    with Store.open(db) as store:
        restore = latest_common_checkpoint(store, plan.prepared, plan.run, plan.world)
        resume_step = next(iter(restore.values())).step or 0
        failed = killed.result
        receipt = store.append(make_receipt(
            "fault", run=plan.run, rank=plan.kill_rank, step=killed.observed_step, prepared=plan.prepared,
            parents=list(restore.values()),
            measurements={"killed_rank": plan.kill_rank, "signal": "SIGKILL",
                          "last_observed_step": killed.observed_step, "failed_group_seconds": failed.seconds,
                          "detect_seconds": failed.detect_seconds, "returncodes": failed.returncodes,
                          "restore_step": resume_step,
                          "restore": {str(k): v.id for k, v in sorted(restore.items())},
                          **({"host_removed": killed.host} if killed.host else {})},
        )).receipt
    return Fault(receipt, restore, resume_step)


def run_restarted(workdir: Path, db: str, plan: RecoveryPlan, fault: Fault, *, steps: int | None, timeout: float,
                  restore_extra: list[str] | None = None, hosts: HostSet | None = None) -> LaunchResult:
    """Restart the whole group, each rank from its checkpoint of ``fault``, to the end (RunFailed if it fails)."""
    mapping = workdir / "logs" / f"restore-{fault.receipt.id[7:23]}.json"
    mapping.write_text(json.dumps({str(k): v.id for k, v in fault.restore.items()}))
    restarted, _ = train_arm(workdir, db, plan.arm, run=plan.run, prepared=plan.prepared, steps=steps,
                             timeout=timeout, extra=["--restore", str(mapping), *(restore_extra or [])],
                             hosts=hosts)  # a host that died is recreated by the launch
    return restarted


def compare_recovery(db: str, plan: RecoveryPlan, killed: KilledGroup, fault: Fault,
                     restarted: LaunchResult) -> RecoveryResult:
    """Summarise the recovered run, compare each rank with the uninterrupted run, and append one ``comparison``
    per rank and the recovery's summary ``comparison``."""
    with Store.open(db) as store:
        summarize_arm(store, plan.prepared, plan.arm, plan.run)
        unint, recov = _ends(store, plan.prepared, plan.base), _ends(store, plan.prepared, plan.run)
        comparisons: list[Receipt] = []
        rows = []
        for rank in range(plan.world):
            m = compare_rank(store, unint[rank], recov[rank], fault.resume_step)
            m["seconds"] = recov[rank].measurements["loop_seconds"]
            rows.append(m)
            comparisons.append(store.append(make_receipt(
                "comparison", run=plan.run, rank=rank, step=recov[rank].step, prepared=plan.prepared,
                parents=[unint[rank], recov[rank]],
                artifacts={"uninterrupted_state": unint[rank].artifacts["state"],
                           "recovered_state": recov[rank].artifacts["state"]},
                measurements=m,
            )).receipt)
        passed = all(rank_passed(m) for m in rows)
        summary = store.append(make_receipt(
            "comparison", run=plan.run, prepared=plan.prepared, parents=[fault.receipt, *comparisons],
            measurements={"format": SUMMARY_FORMAT, "arm": plan.arm, "killed_rank": plan.kill_rank,
                          "last_observed_step_before_kill": killed.observed_step, "restore_step": fault.resume_step,
                          "failed_group_seconds": killed.result.seconds,
                          "detect_seconds": killed.result.detect_seconds,
                          "restarted_group_seconds": restarted.seconds,
                          "all_rank_state_and_trajectory_comparisons_passed": passed,
                          "uninterrupted_run": plan.base, "recovered_run": plan.run, "scope": SUMMARY_SCOPE},
        )).receipt
    return RecoveryResult(summary, comparisons, passed)


def run_recover(workdir: Path, db: str, *, arm: str | None = None, kill_rank: int = 1,
                kill_after_step: int | None = None, prepared: str | None = None, steps: int | None = None,
                timeout: float = 20.0, restore_extra: list[str] | None = None,
                run: str | None = None, hosts: HostSet | None = None, kill_host: bool = False) -> RecoveryResult:
    """Run the uninterrupted arm if needed, the killed group, the restart, and the per-rank comparisons.

    ``arm`` defaults to the prepared config's ``contract.primary_arm``. ``run`` names the recovered run (default
    ``recover/<arm>``, or ``recover/<arm>/<n>`` when the ledger already has that run): each attempt is its own run,
    so its common checkpoint is never taken from an earlier attempt. With ``hosts`` every group runs one rank per
    namespace host; ``kill_host`` makes the killed rank's host die (link, processes, namespace) and the restarted
    group run on the host made anew.
    """
    plan = plan_recovery(workdir, db, arm=arm, kill_rank=kill_rank, kill_after_step=kill_after_step,
                         prepared=prepared, steps=steps, run=run)
    if not plan.base_complete:
        train_uninterrupted(workdir, db, plan, steps=steps, timeout=timeout, hosts=hosts)
    killed = run_killed(workdir, db, plan, steps=steps, timeout=timeout, hosts=hosts, kill_host=kill_host)
    fault = record_fault(db, plan, killed)
    restarted = run_restarted(workdir, db, plan, fault, steps=steps, timeout=timeout, restore_extra=restore_extra,
                              hosts=hosts)
    return compare_recovery(db, plan, killed, fault, restarted)
