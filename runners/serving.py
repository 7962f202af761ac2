"""The experiment's serving step (DESIGN step 5): replicas of the primary arm's final model on loopback ports, the
three phases (single, four, failure) of a fixed request set, and their receipts.

Receipts, all appended once the phases are done (nothing is recorded for a step that did not finish):

* one ``replica`` per server: the model source it loaded (the primary arm's rank 0 ``train-end``), the model digest
  the replica computed itself from the bytes it loaded, its address and binding (host, pid, torch, threads);
* one ``serve-phase`` per phase, citing the replicas it spread requests over, with the request set and the
  per-request log (request digest, replica, attempts, status, latency, response digest, output token ids) as
  artifacts, and the phase's figures and replica metrics (cache lookups and hits) as measurements;
* one ``serve-summary`` citing the three phases and the contract: the reference report's serving section.

Every figure is computed by verify/serving.py from the rows, and the verifier recomputes it from the same rows.
"""

from __future__ import annotations

import platform
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger.artifacts import ArtifactStore, put_json, put_jsonl, workdir_root
from ledger.errors import InputError
from ledger.experiment.formats import SERVE_PHASE_FORMAT, SERVE_REPLICA_FORMAT, SERVE_SUMMARY_FORMAT
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners import loadgen
from runners.hosts import HostSet, ensure, in_namespace
from runners.prepare import load_prepared, load_selection
from runners.serve import ReplicaSpec
from verify import serving as vs

SERVING_SCOPE = ("Fixed held-out requests at fixed client concurrency on loopback replicas of one operator; no "
                 "payments or permissionless admission")
REPLICAS = 4


@dataclass(frozen=True)
class ServingResult:
    summary: Receipt
    phases: dict[str, Receipt]
    replicas: list[Receipt]

    def to_json(self) -> dict[str, Any]:
        m = self.summary.measurements
        return {"summary": self.summary.id, "phases": {p: r.id for p, r in self.phases.items()},
                "replicas": [r.id for r in self.replicas], "serving_fixture_passed": m["serving_fixture_passed"],
                "four_throughput_ratio": m["four_throughput_ratio"], "failure_retries": m["failure_retries"],
                "conditions": m["conditions"]}


def primary_model_source(store: Store, prepared: str, arm: str) -> Receipt:
    """The primary arm's final model: the rank 0 train-end its ``train/<arm>`` summary cites."""
    summaries = [s.receipt for s in store.find(kind="arm-summary", prepared=prepared, run=f"train/{arm}")]
    if not summaries:
        raise InputError(f"arm {arm} has no summary of a train/{arm} run: train it first (ledger run train)")
    ends = [store.get(p).receipt for p in summaries[-1].parents]
    ends = [e for e in ends if e.kind == "train-end"]
    return min(ends, key=lambda e: e.rank or 0)


def replica_spec(store: Store, arts: ArtifactStore, prepared: str, source: Receipt, threads: int = 1) -> ReplicaSpec:
    """How a replica loads ``source``'s model: its own checkpoint directory and the prepared tokenizer and config,
    each with the digest it must hash to."""
    prep = load_prepared(store, arts, prepared).receipt
    state = source.artifacts["state"]
    checkpoint = arts.locate(state, store.evidence_locations(source.id, "state", state), name="state",
                             directory=True)
    tok, cfg = prep.artifacts["tokenizer"], prep.artifacts["config"]
    return ReplicaSpec(checkpoint=checkpoint, state=state, model_digest=source.artifacts["model"],
                       tokenizer=arts.locate(tok, store.locations(tok), name="tokenizer", directory=False),
                       config=arts.locate(cfg, store.locations(cfg), name="config", directory=False),
                       checkpoint_receipt=source.id, tokenizer_digest=tok, config_digest=cfg, threads=threads)


def run_serving(workdir: Path, db: str, *, prepared: str | None = None, replicas: int = REPLICAS,
                requests: int = 64, concurrency: int = 4,
                progress: Callable[[str], None] | None = None, hosts: HostSet | None = None) -> ServingResult:
    """Serve the primary arm's final model from ``replicas`` loopback replicas, run the three phases, stop every
    replica (also on errors and Ctrl-C), then record the replica, phase and summary receipts.

    With ``hosts``, replica i runs on namespace host i and the load client on the switch (the operator's seat,
    docs/hosts.md), so every request and answer crosses the shaped links."""
    say = progress or (lambda _m: None)
    with Store.open(db) as store:
        arts = ArtifactStore(workdir_root(workdir))
        digest = store.latest_prepared(prepared)
        config = load_prepared(store, arts, digest).config
        arm = config.contract.primary_arm
        source = primary_model_source(store, digest, arm)
        spec = replica_spec(store, arts, digest, source)
        selection = store.find(kind="selection", prepared=digest)[-1].receipt
        contract = store.find(kind="contract", prepared=digest)[-1].receipt
        documents, _ = load_selection(store, arts, str(selection.selection))
    # 64 as in the reference; a small experiment's selection may hold fewer documents.
    request_set = loadgen.request_set(documents, min(requests, len(documents)))
    say(f"starting {replicas} replicas of {arm}'s final model {source.artifacts['model'][:19]}")
    def serve() -> dict[str, Any]:
        with loadgen.start_replicas(replicas, spec, log_dir=workdir / "logs" / "serve", hosts=hosts) as running:
            say("serving phases single, four and failure")
            return loadgen.run_serving(running, request_set, concurrency=concurrency, run_prefix=f"serve/{arm}",
                                       allow_remote=hosts is not None)

    served = serve() if hosts is None else in_namespace(ensure(hosts).network.switch, serve)
    with Store.open(db) as store:
        return record_serving(store, ArtifactStore(workdir_root(workdir)), served, source=source,
                              contract=contract, arm=arm, hosts=hosts)


def record_serving(store: Store, arts: ArtifactStore, served: dict[str, Any], *, source: Receipt, contract: Receipt,
                   arm: str, hosts: HostSet | None = None) -> ServingResult:
    """The receipts of a finished serving run (see the module docstring), appended in one transaction."""
    prepared = source.prepared
    replicas: list[Receipt] = []
    for i, health in enumerate(served["replicas"]):
        host = socket.gethostname() if hosts is None else hosts[i].name
        replicas.append(make_receipt(
            "replica", run=f"serve/{arm}", rank=i, prepared=prepared, parents=[source],
            artifacts={"model": source.artifacts["model"], "state": source.artifacts["state"]},
            measurements={"format": SERVE_REPLICA_FORMAT, "endpoint": health["endpoint"],
                          "model_digest": health["model_digest"], "checkpoint_receipt": source.id,
                          "binding": {"host": host, "pid": health["pid"], "threads": health["threads"],
                                      "cpu": health.get("cpu"), "torch": health.get("torch"),
                                      "python": platform.python_version()}}))
    by_endpoint = {r.measurements["endpoint"]: r for r in replicas}
    request_set = put_json(arts, served["requests"])
    phases: dict[str, Receipt] = {}
    for name, record in served["phases"].items():
        cited = [by_endpoint[e] for e in record["endpoints"]]
        phases[name] = make_receipt(
            "serve-phase", run=f"serve/{arm}", prepared=prepared, parents=cited,
            artifacts={"request_log": put_jsonl(arts, record["rows"]), "request_set": request_set},
            measurements={"format": SERVE_PHASE_FORMAT, **{k: v for k, v in record.items() if k != "rows"}})
    summary = vs.serving_summary(served["phases"], required=contract.measurements["serving"],
                                 expected_model_digest=source.artifacts["model"])
    summary_receipt = make_receipt(
        "serve-summary", run=f"serve/{arm}", prepared=prepared, parents=[contract, *phases.values()],
        measurements={"format": SERVE_SUMMARY_FORMAT, "arm": arm, "scope": SERVING_SCOPE, **summary})
    store.append_many([*replicas, *phases.values(), summary_receipt])
    return ServingResult(summary_receipt, phases, replicas)


__all__ = ["ServingResult", "primary_model_source", "record_serving", "replica_spec", "run_serving"]
