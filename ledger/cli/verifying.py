"""`ledger verify` and `ledger audit`: recompute receipts, their ancestry and the experiment's report; check who
signed each receipt, that the ledger extends a published head, and exported attestations (docs/transparency.md).

`ledger verify` is one command: the recomputation of a receipt's ancestry (verify/receipts.py), then the
tamper-evidence checks (verify/transparency.py). What it established is a :class:`Verification`, rendered in one
place (:func:`emit_verification`, text or ``--json``), and a failure is one line (and, with ``--json``, its
diagnostics on stdout) through :func:`failures_as_json`, whichever path (a receipt, ``--head``, ``--in-toto``) ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.cli.common import (
    ArtifactsOpt,
    DbOpt,
    JsonOpt,
    PreparedOpt,
    artifact_store,
    emit_json,
    open_store,
    out,
    read_input,
)
from ledger.errors import InputError

RequireSignaturesOpt = Annotated[bool, typer.Option("--require-signatures", help="Fail on an unsigned receipt.")]
LogKeyOpt = Annotated[
    list[str] | None,
    typer.Option("--log-key", help="A trusted log (operator) public key: the key string or a file holding it. "
                 "Repeatable. Default: the keys the ledger registers."),
]


def register(app: typer.Typer) -> None:
    app.command()(verify)
    app.command()(audit)
    app.command("report")(report_cmd)


# --------------------------------------------------------------------------------------------------- verify


@dataclass
class Verification:
    """What one `ledger verify` established: a receipt's ancestry recomputed (``receipt``: verify.receipts'
    VerifyReport), who signed what was checked (``signatures``), the head it extends (``head``), or an attestation
    (``attestation``). Each part is None when that check did not run."""

    receipt: Any = None
    signatures: Any = None
    head: Any = None
    attestation: Any = None

    def to_json(self) -> dict[str, Any]:
        if self.attestation is not None:
            return dict(self.attestation.to_json())
        value: dict[str, Any] = self.receipt.to_json() if self.receipt is not None else {"ok": True}
        if self.signatures is not None:
            value["signatures"] = self.signatures.to_json()
        if self.head is not None:
            value["log"] = self.head.to_json()
        return value

    def lines(self) -> list[str]:
        if self.attestation is not None:
            return list(self.attestation.lines())
        if self.receipt is not None:
            lines = _receipt_lines(self.receipt)
        else:
            checked = self.signatures.checked if self.signatures is not None else 0
            lines = [f"OK ledger: {checked} receipt(s) re-hashed, logged and signature-checked"]
        for part in (self.signatures, self.head):
            if part is not None:
                lines += [f"  {line}" for line in part.lines()]
        return lines


def _receipt_lines(report: Any) -> list[str]:
    verified = {a.digest for a in report.artifacts if a.status == "verified"}
    missing: dict[str, list[str]] = {}
    for a in report.missing:
        missing.setdefault(a.digest, []).append(a.name)
    lines = [f"OK {report.receipt}: {report.receipts_checked} receipt(s) recomputed and chained, "
             f"{len(verified)} distinct artifact(s) re-hashed, {len(missing)} missing"]
    lines += [f"  missing: {digest} ({', '.join(sorted(set(names)))}, cited {len(names)}x)"
              for digest, names in list(missing.items())[:10]]
    if len(missing) > 10:
        lines.append(f"  ... and {len(missing) - 10} more missing (see --json)")
    return lines + [f"  {line}" for line in report.checks]


def emit_verification(result: Verification, json_out: bool) -> None:
    """The one rendering of a verification that held: its JSON document, or its lines."""
    if json_out:
        emit_json(result.to_json())
        return
    # Plain lines, as written: no markup to interpret in ids and paths, and no rich to import (a fifth of the
    # command's start-up).
    typer.echo("\n".join(result.lines()))


@contextmanager
def failures_as_json(json_out: bool) -> Iterator[None]:
    """A failed verification stays one line on stderr (ErrorMappingGroup); with --json, scripts also get its
    structured diagnostics on stdout."""
    from ledger.errors import VerificationError

    try:
        yield
    except VerificationError as exc:
        if json_out:
            emit_json({"ok": False, **exc.diagnostics()})
        raise


def verifier_key(value: str) -> Any:
    """A verifier key given as the key string or as a file holding it."""
    from ledger.signing import load_verifier_key

    return load_verifier_key(value)


def verify(
    ref: Annotated[str | None, typer.Argument(help="Receipt id or unique hex prefix (optional with --head).")] = None,
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    require_artifacts: Annotated[
        bool, typer.Option("--require-artifacts", help="Fail (exit 3) when an artifact's bytes are missing.")
    ] = False,
    rescore: Annotated[
        int, typer.Option("--rescore", min=0, help="Also re-score N random documents of each eval from its checkpoint.")
    ] = 0,
    head: Annotated[Path | None, typer.Option("--head", help="A signed checkpoint published earlier: prove the "
                                              "ledger extends it and includes what is verified.")] = None,
    in_toto: Annotated[Path | None, typer.Option("--in-toto", help="Verify an attestation (DSSE envelope) "
                                                 "instead of a receipt.")] = None,
    log_key: LogKeyOpt = None,
    witness_key: Annotated[list[str] | None, typer.Option("--witness-key", help="Require the head to be cosigned "
                                                          "by this witness (key string or file). Repeatable.")]
    = None,
    require_signatures: RequireSignaturesOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Recompute a receipt's id and every ancestor's, check parent links, chain rules, artifact digests and who signed
    each receipt; with --head, that the ledger extends that head and includes them (without an id: every receipt of
    the ledger); with --in-toto, an exported attestation."""
    with failures_as_json(json_out):
        trusted = [verifier_key(k) for k in log_key] if log_key else None
        if in_toto is not None:
            result = _verify_attestation(in_toto, db, artifacts, trusted)
        elif ref is None and head is None:
            raise InputError("give a receipt id, --head FILE or --in-toto FILE")
        else:
            result = _verify_ledger(ref, db, artifacts, require_artifacts, rescore, head, trusted,
                                    [verifier_key(k) for k in witness_key or ()], require_signatures)
    emit_verification(result, json_out)


def _verify_ledger(ref: str | None, db: str | None, artifacts: Path | None, require_artifacts: bool, rescore: int,
                   head: Path | None, trusted: list[Any] | None, witnesses: list[Any],
                   require_signatures: bool) -> Verification:
    """A receipt's ancestry recomputed (when ``ref`` is given), then the signatures of that ancestry (else of every
    receipt) and, with ``head``, the ledger against that head."""
    from verify.receipts import verify_receipt
    from verify.transparency import check_signatures, verify_head

    store = open_store(db)
    result = Verification()
    closure: list[str] | None = None
    if ref is not None:
        result.receipt = verify_receipt(store, ref, artifacts=artifact_store(store.url, artifacts),
                                        require_artifacts=require_artifacts, rescore=rescore,
                                        runner=_model_runner(rescore))
        closure = [s.receipt.id for s in store.ancestors(result.receipt.receipt)]
    # The head first: it names what happened to the log's history (truncated, rewritten, reordered, forked), which
    # a batch signature would otherwise report, less precisely, as failing for a receipt appended beside the change.
    if head is not None:
        from ledger.note import MAX_NOTE_BYTES

        result.head = verify_head(store, read_input(head, MAX_NOTE_BYTES), trusted=trusted, witnesses=witnesses,
                                  receipts=closure)
    result.signatures = check_signatures(store, closure, require=require_signatures)
    return result


def _verify_attestation(path: Path, db: str | None, artifacts: Path | None, trusted: list[Any] | None
                        ) -> Verification:
    """Trust the keys given, else the keys the ledger given by --db registers; with --db the ledger must also
    extend the attested checkpoint and include the receipt."""
    from ledger.transparency import registered_keys
    from verify.transparency import verify_attestation

    store = open_store(db) if db is not None else None
    if trusted is None:
        if store is None:
            raise InputError("no trusted key: give --log-key KEY, or --db with a ledger that registers the key")
        trusted = [k.verifier for k in registered_keys(store).values()]
    arts = artifact_store(store.url, artifacts) if store is not None else (
        artifact_store("", artifacts) if artifacts is not None else None)
    from ledger.dsse import MAX_ENVELOPE_BYTES

    envelope = read_input(path, MAX_ENVELOPE_BYTES)
    return Verification(attestation=verify_attestation(envelope, trusted, artifacts=arts, store=store))


def audit(
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    prepared: PreparedOpt = None,
    record: Annotated[bool, typer.Option("--record/--no-record", help="Append audit and settlement receipts.")]
    = True,
    output: Annotated[Path | None, typer.Option("--output", help="Also write the report (JSON) here.")] = None,
    require_signatures: RequireSignaturesOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Verify every receipt an experiment's report draws on, recompute the report (training, recovery, learning,
    contracts, settlement) from the ledger and artifacts, check who signed the experiment's receipts, and record
    it. Exit 1 if anything fails to verify."""
    from ledger.artifacts import atomic_write
    from verify.audit import audit as run_audit

    store = open_store(db)
    result = run_audit(store, artifact_store(store.url, artifacts), prepared, record=record,
                       require_signatures=require_signatures)
    report = result.report
    assert result.signatures is not None
    if output is not None:
        atomic_write(output, (json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())
    if json_out:
        recorded = result.recorded and result.receipt is not None and result.settlement is not None
        emit_json({"report": report, "audit": result.receipt.id if recorded else None,  # type: ignore[union-attr]
                   "settlement": result.settlement.id if recorded else None,  # type: ignore[union-attr]
                   "checks": result.checks, "signatures": result.signatures.to_json()})
        return
    for line in result.checks:
        out.print(f"  {line}")
    for line in result.signatures.lines():
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
    require_signatures: RequireSignaturesOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Audit the experiment (every receipt verified, the report recomputed) and render the report as one
    self-contained HTML page; with --record its digest goes into a `report` receipt that `ledger verify` renders
    again."""
    from ledger.artifacts import atomic_write
    from verify.audit import audit as run_audit
    from verify.report_page import render_page, report_receipt

    store = open_store(db)
    arts = artifact_store(store.url, artifacts)
    result = run_audit(store, arts, prepared, record=record, require_signatures=require_signatures)
    assert result.receipt is not None
    page = render_page(store, arts, result.receipt, result.report)
    atomic_write(out_path, page)
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
