"""The `ledger` command line: a thin layer over the library.

Errors reach the user as one line on stderr with the exit code documented in ledger.errors (and docs/cli.md);
``LEDGER_DEBUG=1`` shows the traceback instead. Commands that print a result take ``--json``. Nothing here
imports torch at module level: `ledger --help`, `show`, `log` and `verify` start in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from ledger.errors import EXIT_FAILED, EXIT_USAGE, InputError, LedgerError

ENV_DEBUG = "LEDGER_DEBUG"

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class _Group(TyperGroup):
    """Maps library errors to one line and an exit code, in one place, for every sub-command."""

    def invoke(self, ctx: Any) -> Any:  # typer >= 0.2x vendors click: not `click.Context`
        try:
            return super().invoke(ctx)
        except LedgerError as exc:
            if os.environ.get(ENV_DEBUG):
                raise
            typer.echo(f"ledger: error: {exc.one_line()}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            if os.environ.get(ENV_DEBUG):
                raise
            typer.echo(f"ledger: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), err=True)
            raise typer.Exit(EXIT_USAGE) from None


def _typer(help_text: str) -> typer.Typer:
    return typer.Typer(cls=_Group, help=help_text, no_args_is_help=True, add_completion=False,
                       pretty_exceptions_show_locals=False, rich_markup_mode=None)


app = _typer("Content-addressed receipts and verification for distributed training experiments.")
db_app = _typer("Schema migrations of the ledger database.")
app.add_typer(db_app, name="db")
run_app = _typer("Run the experiment's steps: prepare, train, recover, eval. These import torch.")
app.add_typer(run_app, name="run")

# ----------------------------------------------------------------------------------- shared options

DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Ledger: an SQLite path or an SQLAlchemy URL. Default $LEDGER_DB or ./ledger.db"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
ArtifactsOpt = Annotated[
    Path | None,
    typer.Option("--artifacts", help="Artifact directory. Default $LEDGER_ARTIFACTS or artifacts/ beside the db."),
]


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


def _open(db: str | None, create: bool = False) -> Any:
    from ledger.store import Store

    return Store.open(db, create=create)


def _artifact_store(db_url: str, root: Path | None) -> Any:
    from ledger.artifacts import ArtifactStore, default_root

    return ArtifactStore(root if root is not None else default_root(db_url))


# ------------------------------------------------------------------------------------------ commands


@app.command()
def init(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Create a ledger database (or bring an empty one to the current schema)."""
    from ledger.store import display_url

    store = _open(db, create=True)
    result = {"db": display_url(store.url), "receipts": store.count()}
    if json_out:
        emit_json(result)
    else:
        out.print(f"ledger ready at {result['db']} ({result['receipts']} receipts)")


@app.command()
def append(
    source: Annotated[str, typer.Argument(help="A file of canonical receipts (one per line), or - for stdin.")],
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Append receipts. A receipt already present is a no-op; one citing an absent parent is refused."""
    from ledger.receipts import parse_receipt

    data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    name = "stdin" if source == "-" else source
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not lines:
        raise InputError(f"{name}: no receipt found")
    receipts = [parse_receipt(line, source=f"{name} line {i + 1}") for i, line in enumerate(lines)]
    store = _open(db)
    before = store.count()
    stored = store.append_many(receipts)
    added = store.count() - before
    if json_out:
        emit_json({"appended": added, "existing": len(stored) - added, "ids": [s.receipt.id for s in stored]})
    else:
        for s in stored:
            out.print(f"{s.receipt.id}  {s.receipt.kind}")
        out.print(f"{added} appended, {len(stored) - added} already present")


def _receipt_json(stored: Any) -> dict[str, Any]:
    r = stored.receipt
    return {"id": r.id, "seq": stored.seq, "recorded_ns": stored.recorded_ns, "receipt": r.to_document()}


@app.command()
def show(
    ref: Annotated[str, typer.Argument(help="Receipt id (blake3:<hex>) or a unique hex prefix.")],
    db: DbOpt = None,
    json_out: JsonOpt = False,
    raw: Annotated[bool, typer.Option("--raw", help="Print the canonical bytes exactly as hashed.")] = False,
) -> None:
    """Show one receipt."""
    stored = _open(db).get(ref)
    r = stored.receipt
    if raw:
        sys.stdout.buffer.write(r.body + b"\n")
        return
    if json_out:
        emit_json(_receipt_json(stored))
        return
    table = Table(title=f"{r.kind} receipt", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("id", r.id)
    for name in ("run", "rank", "step", "prepared", "selection"):
        value = getattr(r, name)
        if value is not None:
            table.add_row(name, str(value))
    for p in r.parents:
        table.add_row("parent", p)
    for name, digest in sorted(r.artifacts.items()):
        table.add_row(f"artifact {name}", digest)
    for name, value in sorted(r.measurements.items()):
        shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
        table.add_row(name, shown)
    out.print(table)
    if r.kind in ("eval", "comparison", "quality"):  # breakdowns, comparisons and conditions as tables
        from ledger.cli_eval import render_receipt

        render_receipt(out, r)


@app.command()
def log(
    db: DbOpt = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind.")] = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    prepared: Annotated[str | None, typer.Option(help="Only this prepared digest.")] = None,
    selection: Annotated[str | None, typer.Option(help="Only this selection digest.")] = None,
    rank: Annotated[int | None, typer.Option(help="Only this rank.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """List receipts in append order, filtered by field."""
    from ledger import digests

    for name, value in (("--prepared", prepared), ("--selection", selection)):
        if value is not None:
            digests.check_digest(value, name)
    found = _open(db).find(kind=kind, run=run, prepared=prepared, selection=selection, rank=rank, limit=limit)
    if json_out:
        emit_json([_receipt_json(s) for s in found])
        return
    table = Table(show_edge=False)
    for col in ("seq", "id", "kind", "run", "rank", "step", "parents"):
        table.add_column(col)
    for s in found:
        r = s.receipt
        table.add_row(str(s.seq), r.id[:23], r.kind, r.run or "", _opt(r.rank), _opt(r.step), str(len(r.parents)))
    out.print(table)
    out.print(f"{len(found)} receipt(s)")


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


@app.command()
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

    store = _open(db)
    try:
        report = verify_receipt(store, ref, artifacts=_artifact_store(store.url, artifacts),
                                require_artifacts=require_artifacts, rescore=rescore)
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


@app.command()
def audit(
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    prepared: Annotated[str | None, typer.Option(help="Prepared digest (default: the latest prepare).")] = None,
    record: Annotated[bool, typer.Option("--record/--no-record", help="Append audit and settlement receipts.")]
    = True,
    output: Annotated[Path | None, typer.Option("--output", help="Also write the report (JSON) here.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Verify every receipt an experiment's report draws on, recompute the report (training, recovery, learning,
    contracts, settlement) from the ledger and artifacts, and record it. Exit 1 if anything fails to verify."""
    from verify.audit import audit as run_audit

    store = _open(db)
    result = run_audit(store, _artifact_store(store.url, artifacts), prepared, record=record)
    report = result.report
    if output is not None:
        output.write_text(json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    if json_out:
        emit_json({"report": report, "audit": result.receipt.id if result.receipt else None,
                   "settlement": result.settlement.id if result.settlement else None, "checks": result.checks})
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
    if result.receipt is not None:
        out.print(f"audit {result.receipt.id}\nsettlement {result.settlement.id if result.settlement else ''}")


# --------------------------------------------------------------------------------------------- db


@db_app.command("upgrade")
def db_upgrade(
    db: DbOpt = None,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    json_out: JsonOpt = False,
) -> None:
    """Upgrade the database schema (creates the database if it does not exist)."""
    from ledger import migrate
    from ledger.store import display_url, resolve_url

    url = resolve_url(db)
    before = migrate.current(url)
    migrate.upgrade(url, revision)
    after = migrate.current(url)
    if json_out:
        emit_json({"db": display_url(url), "from": before, "to": after})
    else:
        out.print(f"{display_url(url)}: {before or 'empty'} -> {after}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision (base removes every table).")],
    db: DbOpt = None,
) -> None:
    """Downgrade the schema. Destroys data a newer schema holds: for recovery and tests only."""
    from ledger import migrate
    from ledger.store import resolve_url

    migrate.downgrade(resolve_url(db), revision)


@db_app.command("current")
def db_current(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Print the database's schema revision and the one this ledger needs."""
    from ledger import migrate
    from ledger.models import SCHEMA_HEAD
    from ledger.store import display_url, resolve_url

    url = resolve_url(db)
    cur = migrate.current(url)
    if json_out:
        emit_json({"db": display_url(url), "current": cur, "head": SCHEMA_HEAD, "up_to_date": cur == SCHEMA_HEAD})
    else:
        note = "up to date" if cur == SCHEMA_HEAD else "run `ledger db upgrade`"
        out.print(f"{display_url(url)}: {cur or 'no schema'} (head {SCHEMA_HEAD}; {note})")


# ------------------------------------------------------------------ checkpoint state: digest and compare
# Checkpoint directories and safetensors files are read by ledger.state without torch; verify.state compares.


class _ProgressBar:
    """A transient progress bar on stderr, shown only when stderr is a terminal and the work outlasts a second.

    Passed to ledger.state as its ``progress(bytes_just_hashed, total_bytes)`` callback.
    """

    DELAY = 1.0

    def __init__(self, label: str, console: Console | None = None) -> None:
        import time

        self._clock = time.monotonic
        self._start = self._clock()
        self._console = console or err
        self._label = label
        self._done = 0
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, advance: int, total: int) -> None:
        self._done += advance
        if self._bar is None:
            if not self._console.is_terminal or self._clock() - self._start < self.DELAY:
                return
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self._bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=self._console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self._label, total=total)
        self._bar.update(self._task, completed=self._done)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _print_whole(table: Table) -> None:
    """Print a table at its natural width (digests and tensor names are never elided, even in a pipe)."""
    from rich.measure import Measurement

    need = Measurement.get(out, out.options.update(width=100_000), table).maximum
    Console(highlight=False, soft_wrap=True, width=max(out.width, need)).print(table)


def _shape_text(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@app.command()
def digest(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory, or a single .safetensors file.")],
    files: Annotated[bool, typer.Option("--files", help="Also hash every file (reads the bytes twice).")] = False,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="List every tensor's digest.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Recompute the state digest of a checkpoint (component and tensor digests) from its files, without torch.

    For a single file, the top-level digest is the component digest of its tensors (component = the file name
    up to its first '-' or '.'). A directory must be a complete checkpoint (with its manifest.json).
    """
    from ledger.state import read_state

    with _ProgressBar(f"hashing {path.name}") as bar:
        state = read_state(path, files=files, progress=bar)
    result = state.to_json(tensors=tensors)
    if state.manifest is not None and state.manifest.checkpoint != state.digest:
        typer.echo(f"ledger: warning: {path}/manifest.json records {state.manifest.checkpoint}, but the files hash "
                   f"to {state.digest} (see `ledger verify`)", err=True)
    if json_out:
        emit_json(result)
        return
    out.print(f"{state.kind} {path}")
    out.print(f"digest {state.digest}")
    table = Table(show_edge=False, title="components", title_justify="left")
    for col in ("component", "digest", "tensors", "elements", "scalars"):
        table.add_column(col, justify="right" if col in ("tensors", "elements", "scalars") else "left",
                         no_wrap=True)
    for name, c in result["components"].items():
        table.add_row(name, c["digest"], str(c["tensors"]), f"{c['tensor_elements']:,}", str(c["scalars"]))
    _print_whole(table)
    if tensors:
        ttable = Table(show_edge=False, title="tensors", title_justify="left")
        for col in ("component", "tensor", "dtype", "shape", "digest"):
            ttable.add_column(col, no_wrap=True)
        for comp, ts in result["tensors"].items():
            for name, t in ts.items():
                ttable.add_row(comp, name, t["dtype"], _shape_text(t["shape"]), t["digest"])
        _print_whole(ttable)
    if state.files is not None:
        ftable = Table(show_edge=False, title="files", title_justify="left")
        ftable.add_column("file")
        ftable.add_column("digest (b3sum)", no_wrap=True)
        for name, d in state.files.items():
            ftable.add_row(name, d)
        _print_whole(ftable)


def _checkpoint_ref(arg: str, db: str | None, stores: dict[str, Any]) -> Any:
    """A path as itself; otherwise a receipt id/prefix, resolved to its checkpoint directory via the ledger."""
    from verify.state import CheckpointRef, resolve_checkpoint

    if Path(arg).exists():
        return CheckpointRef(Path(arg), arg)
    hexpart = arg.removeprefix("blake3:")
    if not hexpart or any(ch not in "0123456789abcdefABCDEF" for ch in hexpart):
        raise InputError(f"{arg}: no such file or directory, and not a receipt id")
    if "store" not in stores:
        stores["store"] = _open(db)
    return resolve_checkpoint(stores["store"], arg)


def _counts_text(ca: Any, cb: Any, key: str) -> str:
    a = "-" if ca is None else f"{ca[key]:,}"
    b = "-" if cb is None else f"{cb[key]:,}"
    return a if a == b else f"{a} / {b}"


@app.command()
def compare(
    a: Annotated[str, typer.Argument(help="Checkpoint directory (or .safetensors file), or a checkpoint receipt.")],
    b: Annotated[str, typer.Argument(help="The other one.")],
    db: DbOpt = None,
    ignore_files: Annotated[
        bool, typer.Option("--ignore-files", help="Compare state only: skip file digests (one pass over the bytes).")
    ] = False,
    max_located: Annotated[
        int, typer.Option("--max-located", min=0, help="Locate the first differing element of at most N tensors.")
    ] = 16,
    json_out: JsonOpt = False,
) -> None:
    """Compare two checkpoints component by component. Exit 0 when equal (contents and file hashes), 1 when not.

    The table and, when they differ, a last line `DIFFERENT: <first difference>` go to stdout.
    """
    from verify.state import compare_states

    stores: dict[str, Any] = {}
    ref_a, ref_b = _checkpoint_ref(a, db, stores), _checkpoint_ref(b, db, stores)
    with _ProgressBar("comparing") as bar:
        report = compare_states(ref_a, ref_b, files=not ignore_files, max_located=max_located, progress=bar)
    if json_out:
        emit_json(report.to_json())
    else:
        out.print(f"A {report.a}  {report.digest_a}")
        out.print(f"B {report.b}  {report.digest_b}")
        table = Table(show_edge=False)
        for col in ("component", "equal", "tensors", "tensor_elements", "scalars", "differing"):
            table.add_column(col, justify="left" if col in ("component", "equal") else "right")
        for c in report.components:
            table.add_row(c.component, "yes" if c.equal else "NO", _counts_text(c.counts_a, c.counts_b, "tensors"),
                          _counts_text(c.counts_a, c.counts_b, "tensor_elements"),
                          _counts_text(c.counts_a, c.counts_b, "scalars"), str(c.differing_tensors))
        _print_whole(table)
        files_text = {None: "not compared", True: "yes", False: "NO"}[report.file_hashes_equal]
        out.print(f"contents_exactly_equal: {'yes' if report.contents_exactly_equal else 'NO'}  "
                  f"file_hashes_equal: {files_text}")
        more = [d for c in report.components for d in c.differences] + list(report.file_differences)
        for d in more[1:]:
            out.print(f"  also: {d.one_line()}")
        first = report.first_difference
        out.print("EQUAL" if report.equal else f"DIFFERENT: {first.one_line() if first else 'state digests differ'}")
    if not report.equal:
        raise typer.Exit(EXIT_FAILED)


def _register_run_commands() -> None:
    from ledger import cli_eval, cli_run

    cli_run.register(run_app)
    cli_run.replay_command(app, run_app)
    cli_eval.register(run_app, app)


_register_run_commands()


def main() -> None:
    app(prog_name="ledger")


if __name__ == "__main__":
    main()
