"""The whole experiment in one call: prepare, train the three arms, recover the primary arm after killing a rank,
evaluate, audit everything from the ledger, and write ``report.json``.

This is what ``ledger run experiment`` runs; the CLI only adds its step messages and a progress bar through the
``on_step`` and ``train_progress`` hooks.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger.artifacts import ArtifactStore, default_root
from ledger.experiment.config import ARMS
from ledger.store import Store
from runners.evaluate import run_evaluation
from runners.prepare import load_prepared, run_prepare
from runners.recover import run_recover
from runners.serving import REPLICAS, run_serving
from runners.train import summarize_arm, train_arm
from verify.audit import audit
from verify.report_page import render_page, report_receipt

# (label, total steps, rank 0's progress file, the work) -> what work() returned
TrainProgress = Callable[[str, int, Path, Callable[[], Any]], Any]


@dataclass(frozen=True)
class ExperimentResult:
    """Where the experiment's results are, whether its recovery proof and contracts passed, and how long each
    step took (``prepare``, ``train/<arm>``, ``recover``, ``eval``, ``audit``, ``total``; seconds)."""

    prepared: str
    db: str
    report: Path
    recovery_passed: bool
    audit: str | None
    contracts: dict[str, bool]
    seconds: dict[str, float]
    html: Path | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON the CLI prints with ``--json``."""
        return {"prepared": self.prepared, "db": self.db, "report": str(self.report),
                "recovery_passed": self.recovery_passed, "audit": self.audit, "contracts": self.contracts,
                "html": str(self.html) if self.html else None,
                "seconds": self.seconds}


def _run(label: str, total: int, progress_file: Path, work: Callable[[], Any]) -> Any:
    return work()


def run_experiment(workdir: Path, db: str, config: Path | None, *, on_step: Callable[[str], None] | None = None,
                   train_progress: TrainProgress | None = None) -> ExperimentResult:
    """Prepare from ``config`` (default: the built-in config) into ``workdir`` and the ledger ``db``, train every
    arm and append its summary, recover the contract's primary arm, evaluate, audit, and write
    ``<workdir>/report.json``.

    ``on_step(message)`` is told as each step starts. ``train_progress(label, total_steps, progress_file, work)``
    runs ``work()`` (one arm's training, whose rank 0 writes its progress to ``progress_file``) and returns its
    value; the CLI passes one that shows a progress bar meanwhile. Raises RunFailed if an arm's group fails.
    """
    step = on_step if on_step is not None else (lambda message: None)
    wrap = train_progress if train_progress is not None else _run
    workdir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}

    started = time.perf_counter()
    step("prepare: data, tokenizer, seed model")
    prepared = str(run_prepare(config, workdir, db)["prepared"])
    seconds["prepare"] = time.perf_counter() - started
    with Store.open(db) as store:
        cfg = load_prepared(store, ArtifactStore(default_root(store.url)), prepared).config

    for arm in ARMS:
        t0 = time.perf_counter()
        step(f"train {arm}")
        progress = workdir / "logs" / f"progress-{arm}.json"
        progress.parent.mkdir(parents=True, exist_ok=True)
        work = functools.partial(train_arm, workdir, db, arm, prepared=prepared, extra=["--progress", str(progress)])
        _, run = wrap(f"train {arm}", cfg.train.steps, progress, work)
        with Store.open(db) as store:
            summarize_arm(store, prepared, arm, run)
        seconds[f"train/{arm}"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    primary_arm = cfg.contract.primary_arm
    step(f"recover {primary_arm}: kill rank 1, restart from the common checkpoint, compare every rank")
    recovered = run_recover(workdir, db, arm=primary_arm, prepared=prepared)
    seconds["recover"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step("evaluate the seed and every arm on the selection")
    run_evaluation(workdir, db, prepared=prepared)
    seconds["eval"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step(f"serve {primary_arm}'s final model from {REPLICAS} replicas: phases single, four, failure")
    run_serving(workdir, db, prepared=prepared)
    seconds["serve"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step("audit: verify every receipt, recompute the report and render report.html")
    with Store.open(db) as store:
        arts = ArtifactStore(default_root(store.url))
        audited = audit(store, arts, prepared)
        assert audited.receipt is not None
        page = render_page(store, arts, audited.receipt, audited.report)
        arts.put_bytes(page)
        assert audited.settlement is not None
        store.append(report_receipt(audited.receipt, audited.settlement, page))
    seconds["audit"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - started

    report_path = workdir / "report.json"
    report_path.write_text(json.dumps(audited.report, indent=2, sort_keys=True) + "\n")
    (workdir / "report.html").write_bytes(page)
    return ExperimentResult(prepared=prepared, db=db, report=report_path, recovery_passed=recovered.passed,
                            audit=audited.receipt.id if audited.receipt else None,
                            contracts=dict(audited.report["contracts"]), seconds=seconds,
                            html=workdir / "report.html")


__all__ = ["ExperimentResult", "TrainProgress", "run_experiment"]
