"""What the HTML report plots beyond the audit's report, assembled from the ledger alone (verify/report_html.py
specifies the shape): loss trajectories from checkpoint receipts, the recovery's two trajectories, per-probe
retention changes from the eval receipts' retention artifacts, the contract's thresholds, and the receipt ids
that hold each figure's numbers. Every value is copied from a receipt or from an artifact it names (re-hashed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledger.artifacts import ArtifactStore, read_jsonl
from ledger.experiment.formats import COMPARISON_METHOD, RECOVERY_SUMMARY_FORMAT
from ledger.receipts import Receipt
from ledger.store import Store


def trajectory(store: Store, end: Receipt) -> dict[str, Any]:
    """The recorded loss of every step on the chain that ends at train-end ``end`` (its rank's checkpoints, the
    failed group's up to the restored one for a recovered run), with each checkpoint's step and receipt."""
    checkpoints = sorted((s.receipt for s in store.ancestors(end.id)
                          if s.receipt.kind == "checkpoint" and s.receipt.rank == end.rank),
                         key=lambda r: r.step or 0)
    losses: dict[int, float] = {}
    for c in checkpoints:
        for step, loss in c.measurements.get("losses", []):
            losses[int(step)] = float(loss)
    return {"run": end.run, "rank": end.rank, "steps": sorted(losses), "loss": [losses[s] for s in sorted(losses)],
            "checkpoints": [c.step for c in checkpoints], "receipts": [c.id for c in checkpoints]}


def _by_id(store: Store, rid: str) -> Receipt:
    return store.get(rid).receipt


def report_figures(store: Store, artifacts: ArtifactStore, audit: Receipt, report: Mapping[str, Any],
                   log_head: str | None = None) -> dict[str, Any]:
    """The ``figures`` input of :func:`verify.report_html.render_report` for ``audit`` and its rebuilt ``report``."""
    cited = [_by_id(store, p) for p in audit.parents]
    receipts: dict[str, Any] = {"training": {}}
    losses: dict[str, Any] = {}
    for r in cited:
        if r.kind == "arm-summary":
            arm = str(r.measurements["arm"])
            receipts["training"][arm] = r.id
            ends = [_by_id(store, p) for p in r.parents]
            first = min((e for e in ends if e.kind == "train-end"), key=lambda e: e.rank or 0)
            losses[arm] = trajectory(store, first)
    figures: dict[str, Any] = {"audit_receipt": audit.id, "log_head": log_head, "receipts": receipts,
                               "losses": losses}
    contract = next((r for r in cited if r.kind == "contract"), None)
    if contract is not None:
        figures["quality_thresholds"] = dict(contract.measurements.get("quality", {}))
    summary = next((r for r in cited if r.kind == "comparison"
                    and r.measurements.get("format") == RECOVERY_SUMMARY_FORMAT), None)
    if summary is not None:
        receipts["recovery"] = summary.id
        parents = [_by_id(store, p) for p in summary.parents]
        fault = next((p for p in parents if p.kind == "fault"), None)
        if fault is not None:
            receipts["fault"] = fault.id
        rows = sorted(report.get("recovery", {}).get("rank_comparisons", []), key=lambda row: row["rank"])
        if rows:
            row = rows[0]
            figures["recovery"] = {
                "uninterrupted": trajectory(store, _by_id(store, row["uninterrupted_receipt"])),
                "recovered": trajectory(store, _by_id(store, row["recovered_receipt"])),
            }
    summary_serving = next((r for r in cited if r.kind == "serve-summary"), None)
    if summary_serving is not None:
        receipts["serving"] = summary_serving.id
        figures["serving"] = _serving(store, artifacts, summary_serving)
    quality = next((r for r in cited if r.kind == "quality"), None)
    if quality is not None:
        receipts["quality"] = quality.id
        figures["retention"] = _retention(store, artifacts, quality)
    return figures


def _serving(store: Store, artifacts: ArtifactStore, summary: Receipt) -> dict[str, Any]:
    """Each phase's latencies of answered requests (from its request log) and each replica's proof."""
    latencies: dict[str, list[float]] = {}
    replicas: dict[str, dict[str, Any]] = {}
    for p in summary.parents:
        phase = _by_id(store, p)
        if phase.kind != "serve-phase":
            continue
        digest = phase.artifacts["request_log"]
        rows = read_jsonl(artifacts, digest, locations=store.locations(digest), name="request_log")
        latencies[str(phase.measurements["phase"])] = [float(r["latency_seconds"]) for r in rows
                                                       if r.get("status") == 200]
        for rid in phase.parents:
            replica = _by_id(store, rid)
            replicas[rid] = {"endpoint": replica.measurements["endpoint"],
                             "model_digest": replica.measurements["model_digest"], "receipt": rid}
    ordered = sorted(replicas.values(), key=lambda r: (str(r["endpoint"]), str(r["receipt"])))
    return {"latencies": latencies, "replicas": ordered}


def _retention(store: Store, artifacts: ArtifactStore, quality: Receipt) -> dict[str, Any]:
    """Per-probe retention change of each arm against the seed, from the comparisons the quality receipt cites."""
    out: dict[str, Any] = {"arms": {}}
    rows_of: dict[str, list[Any]] = {}

    def nll(eval_id: str) -> list[float]:
        if eval_id not in rows_of:
            e = _by_id(store, eval_id)
            digest = e.artifacts["retention"]
            rows_of[eval_id] = read_jsonl(artifacts, digest, locations=store.locations(digest), name="retention")
        return [float(row["nll"]) for row in rows_of[eval_id]]

    for p in quality.parents:
        c = _by_id(store, p)
        m = c.measurements
        if c.kind != "comparison" or m.get("method") != COMPARISON_METHOD or m["baseline"]["arm"] != "seed":
            continue
        base, cand = m["baseline"]["eval"], m["candidate"]["eval"]
        out["seed_receipt"] = base
        out["arms"][m["candidate"]["arm"]] = {
            "receipt": cand, "changes": [b - a for a, b in zip(nll(base), nll(cand), strict=True)]}
    return out
