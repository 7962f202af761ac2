"""Ladder level 3 for recovery: recompute each rank's uninterrupted-vs-recovered comparison from the checkpoint
files and the receipts' loss trajectories, and fail naming the first divergence (rank, step, component, tensor).

Registered as a check of ``comparison`` receipts whose measurements carry a recovery format; other comparison
receipts (evaluation) are left to their own checks.
"""

from __future__ import annotations

from typing import Any

from ledger.errors import InputError, LedgerError, LookupFailed, MeasurementMismatch, ResumeDivergence
from ledger.experiment.formats import RECOVERY_RANK_FORMAT, RECOVERY_SUMMARY_FORMAT
from ledger.receipts import Receipt, a_kind
from ledger.rules import recovery_rank_passed
from ledger.store import Store
from verify.context import KindCheckContext

RANK_FORMAT = RECOVERY_RANK_FORMAT
SUMMARY_FORMAT = RECOVERY_SUMMARY_FORMAT
RANK_SCOPE = ("Same operated group and rank identities; exact tensor/scalar/RNG contents after restoring the common "
              "checkpoint")
SUMMARY_SCOPE = ("Consistency of exact tensor/scalar/RNG comparisons under one operator; no elastic membership, "
                 "Byzantine recovery or cryptographic execution proof")


def trajectory(store: Store, end: Receipt, after_step: int) -> dict[int, float]:
    """The loss of every step after ``after_step`` on the chain that ends at ``end`` (from its checkpoints)."""
    out: dict[int, float] = {}
    for s in store.ancestors(end.id):
        r = s.receipt
        if r.kind == "checkpoint" and r.rank == end.rank and (r.step or 0) > after_step:
            for step, loss in r.measurements.get("losses", []):
                if step > after_step:
                    out[int(step)] = loss
    return dict(sorted(out.items()))


def compare_rank(store: Store, uninterrupted: Receipt, recovered: Receipt, resume_step: int) -> dict[str, Any]:
    """Everything the reference report shows per rank, recomputed from the checkpoint files and receipts."""
    from verify.state import compare_states, resolve_checkpoint

    a, b = resolve_checkpoint(store, uninterrupted.id), resolve_checkpoint(store, recovered.id)
    cmp = compare_states(a, b, files=True)
    counts = {c.component: dict(c.counts_a or {}) for c in cmp.components}
    ua, ub = trajectory(store, uninterrupted, resume_step), trajectory(store, recovered, resume_step)
    first_loss = next((s for s in sorted(set(ua) | set(ub)) if ua.get(s) != ub.get(s)), None)
    binding_a = dict(uninterrupted.measurements.get("binding", {}))
    binding_b = dict(recovered.measurements.get("binding", {}))
    identity = ("arm", "rank", "world", "host", "device", "backend", "threads", "cpu", "torch")
    binding_equal = all(binding_a.get(k) == binding_b.get(k) for k in identity)
    first = cmp.first_difference
    return {
        "format": RANK_FORMAT,
        "rank": recovered.rank,
        "resume_step": resume_step,
        "uninterrupted_receipt": uninterrupted.id,
        "recovered_receipt": recovered.id,
        "comparisons": counts,
        "contents_exactly_equal": cmp.contents_exactly_equal,
        "file_hashes_equal": bool(cmp.file_hashes_equal),
        "parameter_digest": recovered.artifacts["model"],
        "outer_digest": recovered.artifacts.get("outer"),
        "binding": {k: binding_b.get(k) for k in identity},
        "binding_equal": binding_equal,
        "trajectory_steps": len(ub),
        "trajectory_equal": ua == ub and len(ua) > 0,
        "first_trajectory_divergence": first_loss,
        "first_state_difference": first.one_line() if first is not None else None,
        "scope": RANK_SCOPE,
    }


rank_passed = recovery_rank_passed


def divergence(m: dict[str, Any]) -> ResumeDivergence:
    """The first place a rank's recovered run parts from the uninterrupted one, as an error."""
    if m["first_trajectory_divergence"] is not None:
        what = f"loss at step {m['first_trajectory_divergence']}"
    elif m["first_state_difference"]:
        what = m["first_state_difference"]
    elif not m["binding_equal"]:
        what = "rank binding differs"
    else:
        what = "file hashes differ"
    return ResumeDivergence(f"rank {m['rank']}: recovered run diverges from the uninterrupted run: {what}",
                            receipt=m["recovered_receipt"], field="rank", expected=m["uninterrupted_receipt"],
                            actual=m["recovered_receipt"])


def _run_ends(store: Store, ref: str) -> dict[int, Receipt]:
    """The latest train-end receipt of every rank of a run, given its name or one of its train-end receipts."""
    run = ref
    if "/" not in ref or ref.startswith("blake3:"):
        try:
            r = store.get(ref).receipt
        except LedgerError:
            r = None
        if r is not None:
            if r.kind != "train-end":
                raise InputError(f"receipt {r.id} is {a_kind(r.kind)} receipt; compare-runs takes runs or train-end "
                                 "receipts")
            run = r.run or ""
    ends: dict[int, Receipt] = {}
    for s in store.find(kind="train-end", run=run):
        ends[s.receipt.rank or 0] = s.receipt
    if not ends:
        raise LookupFailed(f"no train-end receipts for run {run!r}")
    return ends


def compare_runs(store: Store, uninterrupted: str, recovered: str,
                 resume_step: int | None = None) -> list[dict[str, Any]]:
    """Compare two runs rank by rank (see :func:`compare_rank`). The resume step defaults to the step the recovered
    run's ranks restored (0, the whole trajectory, when it never restored)."""
    a, b = _run_ends(store, uninterrupted), _run_ends(store, recovered)
    if sorted(a) != sorted(b):
        raise InputError(f"the runs have different ranks: {sorted(a)} vs {sorted(b)}")
    rows = []
    for rank in sorted(a):
        step = resume_step
        if step is None:
            restores = [s.receipt.step or 0 for s in store.ancestors(b[rank].id) if s.receipt.kind == "restore"]
            step = max(restores) if restores else 0
        rows.append(compare_rank(store, a[rank], b[rank], step))
    return rows


# Fields recomputed exactly; "seconds" is a timing the verifier cannot recompute.
_RECOMPUTED = ("rank", "resume_step", "uninterrupted_receipt", "recovered_receipt", "comparisons",
               "contents_exactly_equal", "file_hashes_equal", "parameter_digest", "outer_digest", "binding",
               "binding_equal", "trajectory_steps", "trajectory_equal", "first_trajectory_divergence",
               "first_state_difference")


def check_rank_comparison(ctx: KindCheckContext) -> list[str]:
    r = ctx.receipt
    m = r.measurements
    if m.get("format") != RANK_FORMAT:
        return []
    unint = ctx.closure[m["uninterrupted_receipt"]]
    recov = ctx.closure[m["recovered_receipt"]]
    again = compare_rank(ctx.store, unint, recov, int(m["resume_step"]))
    for name in _RECOMPUTED:
        if _norm(again[name]) != _norm(m.get(name)):
            raise MeasurementMismatch(r.id, f"measurements.{name}", expected=again[name], actual=m.get(name),
                                      what="from the checkpoint files and losses")
    if not rank_passed(again):
        raise divergence(again)
    return [f"recovery rank {m['rank']}: state, files, RNG, binding and {m['trajectory_steps']} losses after step "
            f"{m['resume_step']} equal the uninterrupted run"]


def check_recovery_summary(ctx: KindCheckContext) -> list[str]:
    """A recovery summary's claims equal its fault's and its rank comparisons' (a chain rule, ledger/rules.py);
    here the verdict itself must hold: a recovery whose ranks diverged fails verification."""
    r = ctx.receipt
    m = r.measurements
    if m.get("format") != SUMMARY_FORMAT:
        return []
    ranks = [ctx.closure[p] for p in r.parents if ctx.closure[p].kind == "comparison"]
    failed = [dict(p.measurements) for p in ranks if p.measurements.get("format") == RANK_FORMAT
              and not rank_passed(dict(p.measurements))]
    if failed or not m.get("all_rank_state_and_trajectory_comparisons_passed"):
        raise ResumeDivergence(f"receipt {r.id}: not every rank's recovery comparison passed", receipt=r.id,
                                field="measurements.all_rank_state_and_trajectory_comparisons_passed",
                                expected=True, actual=m.get("all_rank_state_and_trajectory_comparisons_passed"))
    return [f"recovery: {len(ranks)} rank comparison(s) passed after restoring step {m['restore_step']}"]


def _norm(value: Any) -> Any:
    """Compare as canonical JSON would store it (tuples are lists)."""
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value

