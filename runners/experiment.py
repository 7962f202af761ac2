"""The whole experiment in one call: prepare, train the three arms, recover the primary arm after killing a rank,
evaluate, audit everything from the ledger, and write ``report.json``.

This is what ``ledger run experiment`` runs; the CLI only adds its step messages and a progress bar through the
``on_step`` and ``train_progress`` hooks.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger.artifacts import ArtifactStore, workdir_root
from ledger.database import resolve_url
from ledger.experiment.config import ARMS
from ledger.store import ENV_SIGNING_KEY, Store
from ledger.transparency import export_head, operator_key_path, operator_setup
from runners.evaluate import run_evaluation
from runners.hosts import HostSet
from runners.prepare import load_prepared, run_prepare
from runners.recover import run_recover
from runners.serving import REPLICAS, run_serving
from runners.train import summarize_arm, train_arm
from verify.audit import audit
from verify.report_page import render_page, report_receipt
from verify.transparency import verify_head

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
                   train_progress: TrainProgress | None = None, hosts: HostSet | None = None) -> ExperimentResult:
    """The whole experiment (see :func:`_experiment`), every receipt signed by the operator key
    ``<workdir>/keys/operator.key`` (created and registered first): in this process and in every rank and replica
    it starts, through ``$LEDGER_SIGNING_KEY`` (docs/transparency.md)."""
    resolve_url(db)  # a database named wrongly (an empty --db) fails before the work directory and its key are made
    workdir.mkdir(parents=True, exist_ok=True)
    signer = operator_setup(workdir, db)
    previous = os.environ.get(ENV_SIGNING_KEY)
    os.environ[ENV_SIGNING_KEY] = str(operator_key_path(workdir))
    try:
        return _experiment(workdir, db, config, signer, on_step=on_step, train_progress=train_progress, hosts=hosts)
    finally:
        if previous is None:
            os.environ.pop(ENV_SIGNING_KEY, None)
        else:
            os.environ[ENV_SIGNING_KEY] = previous


def _experiment(workdir: Path, db: str, config: Path | None, signer: Any, *,
                on_step: Callable[[str], None] | None = None, train_progress: TrainProgress | None = None,
                hosts: HostSet | None = None) -> ExperimentResult:
    """Prepare from ``config`` (default: the built-in config) into ``workdir`` and the ledger ``db``, train every
    arm and append its summary, recover the contract's primary arm, evaluate, audit, and write
    ``<workdir>/report.json``.

    ``on_step(message)`` is told as each step starts. ``train_progress(label, total_steps, progress_file, work)``
    runs ``work()`` (one arm's training, whose rank 0 writes its progress to ``progress_file``) and returns its
    value; the CLI passes one that shows a progress bar meanwhile. Raises RunFailed if an arm's group fails.
    With ``hosts`` (docs/hosts.md) the arms, the recovery and the serving replicas run one rank or replica per
    namespace host; prepare, evaluation and the audit run here.
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
        cfg = load_prepared(store, ArtifactStore(workdir_root(workdir)), prepared).config

    for arm in ARMS:
        t0 = time.perf_counter()
        step(f"train {arm}")
        progress = workdir / "logs" / f"progress-{arm}.json"
        progress.parent.mkdir(parents=True, exist_ok=True)
        work = functools.partial(train_arm, workdir, db, arm, prepared=prepared, extra=["--progress", str(progress)],
                                 hosts=hosts)
        _, run = wrap(f"train {arm}", cfg.train.steps, progress, work)
        with Store.open(db) as store:
            summarize_arm(store, prepared, arm, run)
        seconds[f"train/{arm}"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    primary_arm = cfg.contract.primary_arm
    step(f"recover {primary_arm}: kill rank 1, restart from the common checkpoint, compare every rank")
    recovered = run_recover(workdir, db, arm=primary_arm, prepared=prepared, hosts=hosts)
    seconds["recover"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step("evaluate the seed and every arm on the selection")
    run_evaluation(workdir, db, prepared=prepared)
    seconds["eval"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step(f"serve {primary_arm}'s final model from {REPLICAS} replicas: phases single, four, failure")
    run_serving(workdir, db, prepared=prepared, hosts=hosts)
    seconds["serve"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step("audit: verify every receipt, recompute the report and render report.html")
    with Store.open(db) as store:
        arts = ArtifactStore(workdir_root(workdir))
        # A signed head of everything recorded so far: the audit proves the ledger extends it and holds every
        # receipt; the page names it. The final head (with the audit's own receipts) is exported at the end.
        export_head(store, signer, workdir / "audited-head.txt")
        head_text = (workdir / "audited-head.txt").read_text()
        verify_head(store, head_text.encode(), trusted=[signer.verifier])
        # Every receipt of the experiment was signed with the operator key ($LEDGER_SIGNING_KEY): required.
        audited = audit(store, arts, prepared, require_signatures=True)
        assert audited.receipt is not None
        page = render_page(store, arts, audited.receipt, audited.report, log_head=head_text)
        arts.put_bytes(page)
        assert audited.settlement is not None
        store.append(report_receipt(audited.receipt, audited.settlement, page, log_head=head_text))
        export_head(store, signer, workdir / "log-head.txt")
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
