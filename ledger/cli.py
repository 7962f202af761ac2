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

import click
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from ledger.errors import EXIT_USAGE, InputError, LedgerError

ENV_DEBUG = "LEDGER_DEBUG"

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class _Group(TyperGroup):
    """Maps library errors to one line and an exit code, in one place, for every sub-command."""

    def invoke(self, ctx: click.Context) -> Any:
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

# ----------------------------------------------------------------------------------- shared options

DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Ledger database: a path (SQLite) or an SQLAlchemy URL. Default $LEDGER_DB or ./ledger.db"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
ArtifactsOpt = Annotated[
    Path | None,
    typer.Option("--artifacts", help="Artifact directory. Default $LEDGER_ARTIFACTS or artifacts/ beside the db."),
]


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


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
    json_out: JsonOpt = False,
) -> None:
    """Recompute a receipt's id and every ancestor's, check parent links, chain rules and artifact digests."""
    from verify.receipts import verify_receipt

    store = _open(db)
    report = verify_receipt(store, ref, artifacts=_artifact_store(store.url, artifacts),
                            require_artifacts=require_artifacts)
    if json_out:
        emit_json(report.to_json())
        return
    verified = sum(a.status == "verified" for a in report.artifacts)
    out.print(f"OK {report.receipt}: {report.receipts_checked} receipt(s) recomputed and chained, "
              f"{verified} artifact(s) re-hashed, {len(report.missing)} missing")
    for a in report.missing:
        out.print(f"  missing: {a.name} {a.digest} (cited by {a.receipt[:19]})")


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


def main() -> None:
    app(prog_name="ledger")


if __name__ == "__main__":
    main()
