"""Recovery timing on this host: how fast a killed rank's group is detected and torn down, and what the failed and
restarted groups cost against an uninterrupted run, for the 4-rank DiLoCo arm on a small config.

Per round (a fresh run each, in one temporary experiment directory):

* an uninterrupted run of the arm (``--no-ledger``: the same training work, no receipts), timed as the baseline;
* ``runners.recover.run_recover``: rank 1 SIGKILLed after the chosen step, the group torn down, the whole group
  restarted from the last common checkpoint, and every rank compared with an uninterrupted run.

It prints, per round and as medians: detection (from the killed rank's death to every rank gone), the failed
group's seconds, the restarted group's seconds, and restarted / uninterrupted. Target: detection under 60 s (no
hang until torch's 30-minute collective timeout) and every rank's comparison passing. Exit 0 when both hold.

    python benchmarks/recovery_bench.py [--rounds 3] [--kill-after-step 5] [--config tiny.toml] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runners.prepare import run_prepare
from runners.recover import run_recover
from runners.train import train_arm

TARGET_DETECT_SECONDS = 60.0
ARM = "diloco-four"

# examples/tiny.toml: a 1-layer transformer, 8 steps of a global batch of 8, checkpoints every 4 steps, an outer
# DiLoCo step every 2 (the same one the recovery tests use).
SMALL = (Path(__file__).resolve().parents[1] / "examples" / "tiny.toml").read_text()


def one_round(workdir: Path, db: str, i: int, kill_after_step: int | None) -> dict[str, Any]:
    started = time.perf_counter()
    base, _ = train_arm(workdir, db, ARM, run=f"bench/uninterrupted/{i}",
                        extra=["--no-ledger", "--out", str(workdir / "baseline" / str(i))])
    if not base.ok:
        raise SystemExit(f"uninterrupted run failed: exit codes {base.returncodes}")
    uninterrupted = time.perf_counter() - started
    started = time.perf_counter()
    result = run_recover(workdir, db, arm=ARM, kill_rank=1, kill_after_step=kill_after_step)
    total = time.perf_counter() - started
    m = result.summary.measurements
    return {
        "run": m["recovered_run"],
        "killed_rank": m["killed_rank"],
        "last_observed_step": m["last_observed_step_before_kill"],
        "restore_step": m["restore_step"],
        "detect_seconds": m["detect_seconds"],
        "failed_group_seconds": m["failed_group_seconds"],
        "restarted_group_seconds": m["restarted_group_seconds"],
        "uninterrupted_seconds": uninterrupted,
        "restart_vs_uninterrupted": m["restarted_group_seconds"] / uninterrupted,
        "failed_plus_restart_vs_uninterrupted": (m["failed_group_seconds"] + m["restarted_group_seconds"])
        / uninterrupted,
        "recover_total_seconds": total,
        "passed": result.passed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after-step", type=int, default=5)
    parser.add_argument("--config", type=Path, default=None, help="Experiment TOML (default: the small config)")
    parser.add_argument("--dir", type=Path, default=None, help="Parent of the temporary experiment directory")
    parser.add_argument("--keep", action="store_true", help="Keep the experiment directory")
    parser.add_argument("--json", action="store_true", help="Print the rounds as JSON too")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="recovery-bench-", dir=args.dir))
    try:
        config = args.config
        if config is None:
            config = workdir / "small.toml"
            config.write_text(SMALL)
        db = str(workdir / "ledger.db")
        run_prepare(config, workdir, db)
        # The first recovery also trains its uninterrupted reference run (timed in its round as well).
        rounds = [one_round(workdir, db, i, args.kill_after_step) for i in range(args.rounds)]
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    cols = ("detect_seconds", "failed_group_seconds", "restarted_group_seconds", "uninterrupted_seconds",
            "restart_vs_uninterrupted", "failed_plus_restart_vs_uninterrupted")
    heads = ("detect s", "failed s", "restarted s", "uninterr. s", "restart/uninterr.", "(failed+restart)/uninterr.")
    print(f"{ARM}, 4 gloo ranks, rank 1 SIGKILLed after step {args.kill_after_step}, {args.rounds} round(s)")
    print(f"{'round':<7}" + "".join(f"{h:>28}" if i == len(heads) - 1 else f"{h:>19}" for i, h in enumerate(heads))
          + "  comparison")
    for i, r in enumerate(rounds):
        cells = "".join(f"{r[c]:>28.2f}" if j == len(cols) - 1 else f"{r[c]:>19.2f}" for j, c in enumerate(cols))
        print(f"{i:<7}{cells}  {'all ranks equal' if r['passed'] else 'DIVERGED'}")
    med = {c: statistics.median(r[c] for r in rounds) for c in cols}
    print(f"{'median':<7}" + "".join(f"{med[c]:>28.2f}" if j == len(cols) - 1 else f"{med[c]:>19.2f}"
                                     for j, c in enumerate(cols)))
    worst = max(r["detect_seconds"] for r in rounds)
    ok_detect = worst < TARGET_DETECT_SECONDS
    ok_equal = all(r["passed"] for r in rounds)
    print(f"detection (kill -> every rank gone), worst round: {worst:.2f} s; target < {TARGET_DETECT_SECONDS:.0f} s: "
          f"{'PASS' if ok_detect else 'FAIL'}")
    print(f"every rank's recovered state equals the uninterrupted run's: {'PASS' if ok_equal else 'FAIL'}")
    if args.json:
        print(json.dumps(rounds, indent=1))
    return 0 if ok_detect and ok_equal else 1


if __name__ == "__main__":
    sys.exit(main())
