"""`ledger verify` and `ledger audit`: recompute receipts, their ancestry and the experiment's report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.cli.common import ArtifactsOpt, DbOpt, JsonOpt, PreparedOpt, artifact_store, emit_json, open_store, out


def register(app: typer.Typer) -> None:
    app.command()(verify)
    app.command()(audit)
    app.command("report")(report_cmd)


def verify(
    ref: Annotated[str, typer.Argument(help="Receipt id or unique hex prefix.")],
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    require_artifacts: Annotated[
        bool, typer.Option("--require-artifacts", help="Fail (exit 3) when an artifact's bytes are missing.")
    ] = False,
    rescore: Annotated[
        int, typer.Option("--rescore", min=0, help="Also re-score N random documents of each eval from its checkpoint.")
    ] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Recompute a receipt's id and every ancestor's, check parent links, chain rules and artifact digests."""
    from ledger.errors import VerificationError
    from verify.receipts import verify_receipt

    store = open_store(db)
    try:
        report = verify_receipt(store, ref, artifacts=artifact_store(store.url, artifacts),
                                require_artifacts=require_artifacts, rescore=rescore, runner=_model_runner(rescore))
    except VerificationError as exc:
        if json_out:  # scripts get the structured failure on stdout as well as the one line on stderr
            emit_json({"ok": False, **exc.diagnostics()})
        raise
    if json_out:
        emit_json(report.to_json())
        return
    verified = {a.digest for a in report.artifacts if a.status == "verified"}
    missing: dict[str, list[str]] = {}
    for a in report.missing:
        missing.setdefault(a.digest, []).append(a.name)
    out.print(f"OK {report.receipt}: {report.receipts_checked} receipt(s) recomputed and chained, "
              f"{len(verified)} distinct artifact(s) re-hashed, {len(missing)} missing")
    for digest, names in list(missing.items())[:10]:
        out.print(f"  missing: {digest} ({', '.join(sorted(set(names)))}, cited {len(names)}x)")
    if len(missing) > 10:
        out.print(f"  ... and {len(missing) - 10} more missing (see --json)")
    for line in report.checks:
        out.print(f"  {line}")


def audit(
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    prepared: PreparedOpt = None,
    record: Annotated[bool, typer.Option("--record/--no-record", help="Append audit and settlement receipts.")]
    = True,
    output: Annotated[Path | None, typer.Option("--output", help="Also write the report (JSON) here.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Verify every receipt an experiment's report draws on, recompute the report (training, recovery, learning,
    contracts, settlement) from the ledger and artifacts, and record it. Exit 1 if anything fails to verify."""
    from verify.audit import audit as run_audit

    store = open_store(db)
    result = run_audit(store, artifact_store(store.url, artifacts), prepared, record=record)
    report = result.report
    if output is not None:
        output.write_text(json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    if json_out:
        recorded = result.recorded and result.receipt is not None and result.settlement is not None
        emit_json({"report": report, "audit": result.receipt.id if recorded else None,  # type: ignore[union-attr]
                   "settlement": result.settlement.id if recorded else None,  # type: ignore[union-attr]
                   "checks": result.checks})
        return
    for line in result.checks:
        out.print(f"  {line}")
    t = report["training"]
    for arm, a in t["arms"].items():
        out.print(f"training {arm:<12} world {a['world']}  active {a['max_rank_active_seconds']:.1f}s  loop "
                  f"{a['max_rank_loop_seconds']:.1f}s  sent {a['total_sent_bytes']:,} B  model {a['parameter_digest']}")
    out.print("ratios " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(t["ratios"].items())))
    rec = report["recovery"]
    if "killed_rank" in rec:
        out.print(f"recovery: rank {rec['killed_rank']} killed after step {rec['last_observed_step_before_kill']}, "
                  f"restored step {rec['restore_step']}; every rank exactly equal: "
                  f"{rec['all_rank_state_and_trajectory_comparisons_passed']}")
    learning = report["learning"]
    for arm, c in learning.get("comparisons_to_seed", {}).items():
        out.print(f"learning {arm:<12} gain {c['accuracy_gain']:+.4f}  gained {c['gained']} lost {c['lost']}  "
                  f"p {c['exact_one_sided_p']:.3g}  99% [{c['normal_99pct_lower']:.4f}, {c['normal_99pct_upper']:.4f}]")
    out.print("contracts " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in report["contracts"].items())
              + f"; tokens issued {learning['tokens_issued']}")
    if result.recorded and result.receipt is not None:
        out.print(f"audit {result.receipt.id}\nsettlement {result.settlement.id if result.settlement else ''}")


def _model_runner(rescore: int) -> Any:
    """Re-executing a model is a runner capability handed to the verifier only when asked for (imports torch)."""
    if not rescore:
        return None
    from runners.reexecute import TorchModelRunner

    return TorchModelRunner()


def report_cmd(
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    prepared: PreparedOpt = None,
    out_path: Annotated[Path, typer.Option("--out", help="Where to write the page.")] = Path("report.html"),
    record: Annotated[bool, typer.Option("--record/--no-record", help="Append audit, settlement and report "
                                         "receipts (the page's digest).")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Audit the experiment (every receipt verified, the report recomputed) and render the report as one
    self-contained HTML page; with --record its digest goes into a `report` receipt that `ledger verify` renders
    again."""
    from verify.audit import audit as run_audit
    from verify.report_page import render_page, report_receipt

    store = open_store(db)
    arts = artifact_store(store.url, artifacts)
    result = run_audit(store, arts, prepared, record=record)
    assert result.receipt is not None
    page = render_page(store, arts, result.receipt, result.report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(page)
    assert result.settlement is not None
    receipt = report_receipt(result.receipt, result.settlement, page)
    if record:  # nothing is written anywhere but --out without it (a read-only copy can be reported on)
        arts.put_bytes(page)
        store.append(receipt)
    value = {"path": str(out_path), "bytes": len(page), "digest": receipt.artifacts["html"],
             "report_receipt": receipt.id if record else None, "audit": result.receipt.id if record else None,
             "contracts": result.report["contracts"]}
    if json_out:
        emit_json(value)
    else:
        out.print(f"report {out_path} ({len(page):,} bytes, {receipt.artifacts['html']})")
        if record:
            out.print(f"report receipt {receipt.id} (ledger verify renders it again)")
