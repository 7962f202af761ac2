"""The experiment's report, rebuilt from receipts: shaped like the reference report
(``shared/reference/report-1.7b-four-hosts.json``): training, recovery and learning sections, the contracts and
the settlement's token count. ``check_audit`` (the audit kind's verification) rebuilds it from exactly what an
audit receipt cites and names the first field that differs from the stored report.

Serving comes from the latest ``serve-summary`` receipt (its phases verified from their request logs); without
one the section says "not run", ``serving_approved`` is false and the settlement issues nothing, since it pays
only when every contract passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ledger import digests
from ledger.errors import InputError, RecordInvalid, ReportMismatch
from ledger.experiment.config import ARMS, single_rank_arm
from ledger.experiment.formats import AUDIT_FORMAT, RECOVERY_RANK_FORMAT, RECOVERY_SUMMARY_FORMAT
from ledger.receipts import Receipt
from ledger.store import Store
from verify.context import KindCheckContext
from verify.training import RANK_FIELDS, ratios

TRAINING_SCOPE = ("Matched topology, data and global batch; active time includes local updates and synchronization, "
                  "with checkpoint and whole-process cost reported separately")
TIMING_SCOPE = ("Maximum over ranks of summed local update and sync durations. Checkpoint and loop durations are "
                "separate; process start-up and initial model loading are outside the loop")
_SENT_SCOPE = "sent_bytes: payload bytes each rank contributed to collectives, counted exactly at every call; "
# The ranks of every multi-rank arm on one host (or no host recorded): the text of reports made before it said more.
NETWORK_SCOPE = (_SENT_SCOPE + "interface_bytes: whole-host /proc/net/dev counters over the rank's loop (loopback "
                 "included, since the ranks share one host here)")
SERVING_STATUS = "not run: no serve-summary receipt in the ledger, so serving is not approved"

Pick = Callable[..., Receipt | None]


def network_scope(placements: Mapping[str, Sequence[str | None]]) -> str:
    """What the network figures measure, from where each rank ran: ``placements`` maps each multi-rank arm to its
    ranks' recorded hosts (``binding.host`` of their train-end receipts, in rank order; None where none is recorded).

    Each arm's ranks on one host, or a host not recorded: ``NETWORK_SCOPE``. Every arm's ranks one per host, on the
    same hosts: says so and names them. Anything else: each arm's ranks and hosts. A function of the receipts alone,
    so the audit rebuilds the same text."""
    if any(h is None for hs in placements.values() for h in hs) or all(len(set(hs)) <= 1
                                                                       for hs in placements.values()):
        return NETWORK_SCOPE
    layouts = {tuple(str(h) for h in hs) for hs in placements.values()}
    hosts = next(iter(layouts))
    if len(layouts) == 1 and len(set(hosts)) == len(hosts):
        return (_SENT_SCOPE + "interface_bytes: each rank's own host's /proc/net/dev counters over its loop (loopback "
                f"included). The ranks of {' and '.join(placements)} ran one per host, on {len(hosts)} separate "
                f"hosts ({', '.join(hosts)}, as their bindings record), so each host's own interfaces carry its "
                "rank's collectives and whatever else that host sent: headers, acknowledgements, rendezvous and "
                "ledger traffic")
    where = "; ".join(f"{arm}: {len(hs)} ranks on {', '.join(dict.fromkeys(str(h) for h in hs))}"
                      for arm, hs in placements.items())
    return (_SENT_SCOPE + "interface_bytes: each rank's host's /proc/net/dev counters over its loop (loopback "
            f"included; ranks that share a host count each other's traffic). Where the ranks ran, as their bindings "
            f"record: {where}")


def _placements(store: Store, summaries: Mapping[str, Receipt]) -> dict[str, list[str | None]]:
    """Each multi-rank arm's ranks' hosts, from the train-end receipts its summary cites, in rank order."""
    out: dict[str, list[str | None]] = {}
    for arm, summary in summaries.items():
        if ARMS[arm].world < 2:
            continue
        ends = sorted((e for e in (store.get(p).receipt for p in summary.parents)
                       if e.kind == "train-end" and e.run == summary.run), key=lambda e: e.rank or 0)
        out[arm] = [e.measurements.get("binding", {}).get("host") for e in ends]
    return out


def _picker(store: Store, prepared: str, among: list[Receipt] | None) -> Pick:
    """The latest receipt of a kind matching ``pred``: from the ledger, or only ``among`` (an audit's citations,
    so that verifying an audit rebuilds it from exactly what it cited, whatever was appended since)."""
    def pick(kind: str, pred: Callable[[Receipt], bool] = lambda r: True) -> Receipt | None:
        pool = among if among is not None else [s.receipt for s in store.find(kind=kind, prepared=prepared)]
        found = [r for r in pool if r.kind == kind and r.prepared == prepared and pred(r)]
        return found[-1] if found else None
    return pick


# --------------------------------------------------------------------------------------------- sections


def training_section(pick: Pick, contract: Receipt, store: Store) -> tuple[dict[str, Any], list[Receipt]]:
    """The reference's ``training`` section from each arm's summary of its ``train/<arm>`` run; its network scope
    says where the ranks ran, from the train-end receipts the summaries cite."""
    summaries = {arm: pick("arm-summary", lambda r, arm=arm: r.measurements.get("arm") == arm
                           and r.run == f"train/{arm}") for arm in ARMS}
    present = {a: s for a, s in summaries.items() if s is not None}
    arms = {arm: {"max_rank_active_seconds": s.measurements["max_rank_active_seconds"],
                  "max_rank_loop_seconds": s.measurements["max_rank_loop_seconds"],
                  "parameter_digest": s.measurements["parameter_digest"],
                  "ranks": [{k: r[k] for k in ("rank", *RANK_FIELDS)} for r in s.measurements["ranks"]],
                  "total_sent_bytes": s.measurements["total_sent_bytes"],
                  "world": s.measurements["world"]}
            for arm, s in present.items()}
    cm = contract.measurements
    primary = cm["primary_arm"]
    single = single_rank_arm()
    r = ratios(arms[primary], arms.get(cm["baseline_arm"]), arms.get(single)) if primary in arms else {}
    limits = cm["efficiency"]
    def within(ratio: str, limit: str) -> bool:
        return ratio in r and r[ratio] <= limits[limit]

    conditions = {"active_time": within("active_seconds_vs_ddp", "active_seconds_vs_ddp_max"),
                  "sent_bytes": within("sent_bytes_vs_ddp", "sent_bytes_vs_ddp_max")}
    section = {
        "arms": arms,
        "conditions": conditions,
        "efficiency_contract_passed": all(conditions.values()) and len(present) == len(ARMS),
        "missing_arms": [a for a in ARMS if a not in present],
        "network_scope": network_scope(_placements(store, present)),
        "ratios": r,
        "scope": TRAINING_SCOPE,
        "thresholds": dict(limits),
        "timing_scope": TIMING_SCOPE,
    }
    return section, list(present.values())


def recovery_section(store: Store, pick: Pick) -> tuple[dict[str, Any], list[Receipt]]:
    """The reference's ``recovery`` section from the latest recovery summary and its per-rank comparisons."""
    summary = pick("comparison", lambda r: r.measurements.get("format") == RECOVERY_SUMMARY_FORMAT)
    if summary is None:
        return {"status": "not run"}, []
    m = summary.measurements
    ranks = []
    for p in sorted(summary.parents):
        pr = store.get(p).receipt
        if pr.kind == "comparison" and pr.measurements.get("format") == RECOVERY_RANK_FORMAT:
            pm = pr.measurements
            ranks.append({k: pm[k] for k in (
                "binding", "comparisons", "contents_exactly_equal", "file_hashes_equal", "outer_digest",
                "parameter_digest", "rank", "recovered_receipt", "resume_step", "scope", "seconds",
                "trajectory_equal", "uninterrupted_receipt")} | {"prepared": pr.prepared})
    ranks.sort(key=lambda x: x["rank"])
    section = {k: m[k] for k in ("all_rank_state_and_trajectory_comparisons_passed", "failed_group_seconds",
                                 "killed_rank", "last_observed_step_before_kill", "restarted_group_seconds",
                                 "restore_step", "scope", "arm", "detect_seconds")}
    section["rank_comparisons"] = ranks
    return section, [summary]


def learning_section(pick: Pick) -> tuple[dict[str, Any], list[Receipt]]:
    """The reference's ``learning`` section, as the quality receipt recomputed it from per-document outcomes."""
    quality = pick("quality")
    if quality is None:
        return {"status": "not run", "quality_contract_passed": False}, []
    return dict(quality.measurements["learning"]), [quality]


def serving_section(pick: Pick) -> tuple[dict[str, Any], list[Receipt]]:
    """The reference's ``serving`` section, as the latest serve-summary recorded it (its check recomputes every
    field from the phases' request logs and the contract)."""
    summary = pick("serve-summary")
    if summary is None:
        return {"status": SERVING_STATUS, "serving_approved": False, "serving_fixture_passed": False}, []
    return {k: v for k, v in summary.measurements.items() if k != "format"}, [summary]


def build_report(store: Store, prepared: str,
                 among: list[Receipt] | None = None) -> tuple[dict[str, Any], list[Receipt]]:
    """The report and the receipts it draws on (not verified here: :func:`audit` verifies them first); from the
    latest receipts in the ledger, or only from ``among``."""
    pick = _picker(store, prepared, among)
    contract = pick("contract")
    if contract is None:
        raise InputError(f"no contract receipt for prepared {prepared}: contracts are recorded before training")
    training, t_cited = training_section(pick, contract, store)
    recovery, r_cited = recovery_section(store, pick)
    learning, l_cited = learning_section(pick)
    serving, s_cited = serving_section(pick)
    serving_approved = bool(serving.get("serving_fixture_passed"))
    learning["serving_approved"] = serving_approved
    contracts = {
        "quality": bool(learning.get("quality_contract_passed")),
        "efficiency": bool(training["efficiency_contract_passed"]),
        "recovery": bool(recovery.get("all_rank_state_and_trajectory_comparisons_passed")),
        "serving": serving_approved,
    }
    learning["tokens_issued"] = 0 if not all(contracts.values()) else 1
    report = {
        "format": AUDIT_FORMAT,
        "prepared": prepared,
        "contract": contract.id,
        "contracts": contracts,
        "training": training,
        "recovery": recovery,
        "learning": learning,
        "serving": serving,
    }
    return report, [contract, *t_cited, *r_cited, *l_cited, *s_cited]


# ----------------------------------------------------------------------------------------------- verify


def check_audit(ctx: KindCheckContext) -> list[str]:
    """Rebuild the report from the receipts the audit cites and compare it with the stored report artifact."""
    r = ctx.receipt
    if r.measurements.get("format") != AUDIT_FORMAT:
        return []
    stored_digest = r.artifacts.get("report")
    data = ctx.artifacts.get_bytes(stored_digest) if stored_digest else None
    if data is None:
        if ctx.require_artifacts:
            raise RecordInvalid.at(f"receipt {r.id}: report artifact {stored_digest} is missing", receipt=r.id,
                                   field="artifacts.report", expected=stored_digest, actual="missing")
        return [f"audit {r.id[:19]}: report artifact missing, not rebuilt"]
    stored = digests.parse_canonical(data)
    assert r.prepared is not None
    again, _ = build_report(ctx.store, r.prepared, [ctx.closure[p] for p in r.parents])
    for section in sorted(set(stored) | set(again)):
        if digests.canonical_bytes(stored.get(section)) != digests.canonical_bytes(again.get(section)):
            first = _first_difference(stored.get(section), again.get(section), section)
            raise ReportMismatch(r.id, first, expected=_at(again, first), actual=_at(stored, first))
    return [f"audit {r.id[:19]}: report rebuilt from the ledger, every field equal"]


def _first_difference(a: Any, b: Any, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if digests.canonical_bytes(a.get(k)) != digests.canonical_bytes(b.get(k)):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    return path



def _at(report: Any, path: str) -> Any:
    """The value at a dotted path of a report (None where it is absent)."""
    for key in path.split("."):
        report = report.get(key) if isinstance(report, dict) else None
    return report
