"""The three training arms on this machine: loop seconds, steps/s, what recording receipts costs, and DiLoCo's sent
bytes as a fraction of DDP's.

    python benchmarks/train_bench.py [--steps 128] [--checkpoint-every 32] [--reps 3] [--json]

Prepares a small experiment (the default model and training settings, fewer documents, a short pretraining) in a
temporary directory, then runs every arm ``--reps`` times with the ledger and ``--reps`` times with ``--no-ledger``
(the same workers, checkpoints written alike, no receipt appended), interleaved so that load from other processes
hits both alike. Each run's loop seconds are the slowest rank's, read from the line every rank prints at its end;
each figure is the best run. The ranks also time what recording costs them inside the ledger runs (appends and
checkpoint locations), which shows the overhead without the run-to-run noise of a shared machine.
Targets: ledger / no-ledger loop seconds < 1.03 per arm, and recording < 3% of the loop; DiLoCo's total sent bytes /
DDP's within 5% of 1/H.
Exit 0 when every target holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ledger.experiment.config import ARMS, ExperimentConfig, config_from_dict
from ledger.store import Store
from runners.prepare import pinned_threads, prepare
from runners.train import train_arm

TARGET_OVERHEAD = 1.03
TARGET_RECORDING_SHARE = TARGET_OVERHEAD - 1  # the same target, timed inside the ranks
TARGET_BYTES_TOLERANCE = 0.05


@dataclass
class ArmRuns:
    ledger: list[float] = field(default_factory=list)  # max-rank loop seconds per run
    no_ledger: list[float] = field(default_factory=list)
    sent_bytes: int | None = None  # total over ranks, from the runs with the ledger
    wall: list[float] = field(default_factory=list)  # launch to last rank gone, with the ledger
    recording: list[float] = field(default_factory=list)  # per ledger run: max over ranks of ledger s / loop s


def bench_config(steps: int, checkpoint_every: int, inner_steps: int | None) -> ExperimentConfig:
    """The default experiment with fewer documents and a short pretraining (the seed model's quality is not what
    is measured), training ``steps`` steps."""
    train: dict[str, Any] = {"steps": steps, "checkpoint_every": checkpoint_every}
    if inner_steps is not None:
        train["diloco"] = {"inner_steps": inner_steps}
    return config_from_dict({
        "data": {"train_per_variant": 64, "eval_per_variant": 2, "retention_probes": 8},
        "pretrain": {"steps": 10, "task_documents": 64},
        "train": train,
    })


def rank_lines(log_dir: Path, world: int) -> list[dict[str, Any]]:
    """The JSON line each rank prints at its end (runners.train.worker)."""
    out = []
    for rank in range(world):
        lines = [ln for ln in (log_dir / f"rank{rank}.log").read_text().splitlines() if ln.startswith('{"rank"')]
        if not lines:
            raise RuntimeError(f"rank {rank} printed no end line; see {log_dir}")
        out.append(json.loads(lines[-1]))
    return out


def run_once(workdir: Path, db: Path, arm: str, run: str, *, ledger: bool) -> tuple[float, int, float, float]:
    """(max-rank loop seconds, total sent bytes, launch wall seconds, max-rank share of the loop spent recording)
    of one run."""
    result, name = train_arm(workdir, str(db), arm, run=run, extra=[] if ledger else ["--no-ledger"])
    log_dir = workdir / "logs" / name.replace("/", "_")
    if not result.ok:
        raise RuntimeError(f"{arm} run {run} failed: exit codes {result.returncodes}; see {log_dir}")
    lines = rank_lines(log_dir, ARMS[arm].world)
    assert all(ln["recorded"] == ledger for ln in lines)
    share = max(ln["ledger_seconds"] / ln["loop_seconds"] for ln in lines)
    return max(ln["loop_seconds"] for ln in lines), sum(ln["sent_bytes"] for ln in lines), result.seconds, share


def check_recorded(db: Path, arm: str, run: str, loop: float) -> None:
    """The ledger run's train-end receipts carry the same loop seconds the ranks printed."""
    with Store.open(db) as store:
        ends = [s.receipt for s in store.find(kind="train-end", run=run)]
    if len(ends) != ARMS[arm].world or max(e.measurements["loop_seconds"] for e in ends) != loop:
        raise RuntimeError(f"{arm} run {run}: train-end receipts disagree with the ranks' output")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--checkpoint-every", type=int, default=32)
    parser.add_argument("--inner-steps", type=int, default=None, help="DiLoCo H (default: the config's, 16)")
    parser.add_argument("--reps", type=int, default=3, help="Runs per arm and mode; each figure is the best")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--dir", type=Path, default=None, help="Parent of the temporary work directory")
    parser.add_argument("--keep", action="store_true", help="Keep the work directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    config = bench_config(args.steps, args.checkpoint_every, args.inner_steps)
    h = config.train.diloco.inner_steps

    workdir = Path(tempfile.mkdtemp(prefix="train-bench-", dir=args.dir))
    try:
        db = workdir / "ledger.db"
        t0 = time.perf_counter()
        with Store.open(db, create=True) as store, pinned_threads(1):
            prepare(config, workdir, store)
        prepare_s = time.perf_counter() - t0
        runs = {arm: ArmRuns() for arm in arms}
        for rep in range(args.reps):
            for arm in arms:
                # Alternate which mode goes first, so neither always follows the other arm's runs.
                for ledger in ((False, True) if rep % 2 == 0 else (True, False)):
                    run = f"bench/{arm}/{'ledger' if ledger else 'no-ledger'}/{rep}"
                    loop, sent, wall, share = run_once(workdir, db, arm, run, ledger=ledger)
                    if ledger:
                        check_recorded(db, arm, run, loop)
                        runs[arm].ledger.append(loop)
                        runs[arm].wall.append(wall)
                        runs[arm].sent_bytes = sent
                        runs[arm].recording.append(share)
                    else:
                        runs[arm].no_ledger.append(loop)
                    print(f"  rep {rep} {arm:<12} {'ledger   ' if ledger else 'no-ledger'} loop {loop:7.3f} s"
                          f"  wall {wall:6.2f} s", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    ok = True
    for arm in arms:
        r = runs[arm]
        best_l, best_n = min(r.ledger), min(r.no_ledger)
        overhead = best_l / best_n
        passed = overhead < TARGET_OVERHEAD
        share_passed = min(r.recording) < TARGET_RECORDING_SHARE
        ok &= passed and share_passed
        rows.append({"arm": arm, "world": ARMS[arm].world, "loop_seconds": best_l, "loop_seconds_no_ledger": best_n,
                     "steps_per_second": args.steps / best_l, "overhead": overhead, "overhead_pass": passed,
                     "recording_share": min(r.recording), "recording_pass": share_passed,
                     "launch_wall_seconds": min(r.wall),
                     "total_sent_bytes": r.sent_bytes,
                     "runs_ledger": r.ledger, "runs_no_ledger": r.no_ledger})
    bytes_row: dict[str, Any] | None = None
    if "ddp-four" in runs and "diloco-four" in runs:
        ddp, dil = runs["ddp-four"].sent_bytes, runs["diloco-four"].sent_bytes
        assert ddp and dil is not None
        fraction = dil / ddp
        passed = abs(fraction - 1 / h) <= TARGET_BYTES_TOLERANCE / h
        ok &= passed
        bytes_row = {"diloco_over_ddp": fraction, "one_over_h": 1 / h, "h": h, "pass": passed}

    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "config": {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "h": h, "reps": args.reps,
                   "global_batch": config.train.global_batch, "d_model": config.model.d_model,
                   "n_layers": config.model.n_layers},
        "prepare_seconds": prepare_s,
        "arms": rows,
        "sent_bytes": bytes_row,
        "pass": ok,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.steps} steps, checkpoint every {args.checkpoint_every}, H={h}, global batch "
              f"{config.train.global_batch}, d_model {config.model.d_model}; best of {args.reps} runs each; "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'arm':<12} {'ranks':>5} {'loop s':>8} {'steps/s':>8} {'no-ledger s':>12} {'ledger/none':>12} "
              f"{'recording':>10}  target")
        for row in rows:
            print(f"{row['arm']:<12} {row['world']:>5} {row['loop_seconds']:>8.3f} {row['steps_per_second']:>8.1f} "
                  f"{row['loop_seconds_no_ledger']:>12.3f} {row['overhead']:>12.4f} {row['recording_share']:>10.2%}"
                  f"  ratio < {TARGET_OVERHEAD}: {'PASS' if row['overhead_pass'] else 'FAIL'}, recording < "
                  f"{TARGET_RECORDING_SHARE:.0%}: {'PASS' if row['recording_pass'] else 'FAIL'}")
        print("recording: the largest share of a rank's loop spent appending receipts and recording checkpoint "
              "locations, timed inside the ledger runs (best run)")
        if bytes_row is not None:
            print(f"DiLoCo sent bytes / DDP's: {bytes_row['diloco_over_ddp']:.4f} (1/H = {1 / h:.4f}; within "
                  f"{TARGET_BYTES_TOLERANCE:.0%}): {'PASS' if bytes_row['pass'] else 'FAIL'}")
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
