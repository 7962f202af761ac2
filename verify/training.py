"""Training figures recomputed from receipts: an arm's max-rank and total figures from its ranks' train-end
receipts, and the ratios between arms (the reference report's ``training`` section).

Torch-free: the runners import these to write arm summaries, and `ledger verify` of an arm-summary receipt
recomputes every figure from the receipts it cites and names the first that differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ledger.errors import MeasurementMismatch
from ledger.experiment.config import ARMS
from ledger.receipts import Receipt
from verify.context import KindCheckContext

RANK_FIELDS = ("update_seconds", "synchronization_seconds", "active_seconds", "checkpoint_seconds", "loop_seconds",
               "sent_bytes", "interface_bytes")


def arm_figures(ends: Sequence[Receipt]) -> dict[str, Any]:
    """The arm's per-rank figures and max-rank/total figures, as in the reference report's training arms."""
    ordered = sorted(ends, key=lambda e: e.rank or 0)
    ranks = [{k: r.measurements[k] for k in RANK_FIELDS} | {"rank": r.rank} for r in ordered]
    return {
        "world": len(ranks),
        "ranks": ranks,
        "max_rank_active_seconds": max(r["active_seconds"] for r in ranks),
        "max_rank_loop_seconds": max(r["loop_seconds"] for r in ranks),
        "total_sent_bytes": sum(r["sent_bytes"] for r in ranks),
        "parameter_digest": ordered[0].artifacts["model"],
    }


def ratios(primary: Mapping[str, Any], ddp: Mapping[str, Any] | None,
           single: Mapping[str, Any] | None) -> dict[str, Any]:
    """The reference report's training ratios of an arm against DDP and single (those that are given)."""
    out: dict[str, Any] = {}
    if ddp is not None:
        out["active_seconds_vs_ddp"] = primary["max_rank_active_seconds"] / ddp["max_rank_active_seconds"]
        out["sent_bytes_vs_ddp"] = primary["total_sent_bytes"] / ddp["total_sent_bytes"]
    if single is not None:
        out["active_seconds_vs_single"] = primary["max_rank_active_seconds"] / single["max_rank_active_seconds"]
        out["loop_seconds_vs_single"] = primary["max_rank_loop_seconds"] / single["max_rank_loop_seconds"]
    return out


def check_arm_summary(ctx: KindCheckContext) -> list[str]:
    """Recompute an arm summary's figures from its train-end parents and its ratios from the summaries it cites."""
    r = ctx.receipt
    parents = [ctx.closure[p] for p in r.parents]
    ends = [p for p in parents if p.kind == "train-end" and p.run == r.run]
    others = {p.measurements.get("arm"): p.measurements for p in parents if p.kind == "arm-summary"}
    again = arm_figures(ends) | {"ratios": ratios(r.measurements, *_baselines(others))}
    for name, value in again.items():
        if r.measurements.get(name) != value:
            raise MeasurementMismatch(r.id, f"measurements.{name}", expected=value, actual=r.measurements.get(name),
                                      what="from the train-end receipts it cites")
    return [f"arm {r.measurements.get('arm')}: figures of {len(ends)} rank(s) and ratios recompute"]


def _baselines(summaries: Mapping[Any, Mapping[str, Any]]) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The every-step data-parallel arm's and the single-rank arm's summaries among ``summaries`` (by arm name)."""
    by_sync = {ARMS[a].sync: m for a, m in summaries.items() if a in ARMS}
    return by_sync.get("every-step"), by_sync.get("none")
