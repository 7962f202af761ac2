"""`ledger init`, `append`, `show` and `log`: writing and reading receipts. Fast: nothing here imports torch, and rich
only to print a table."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Annotated, Any, BinaryIO

import typer

from ledger.cli.common import (
    INT64_MAX,
    DbOpt,
    JsonOpt,
    add_row,
    emit_json,
    err,
    open_store,
    out,
    plain_table,
    print_wide,
)
from ledger.errors import SHAPE_ERRORS, InputError


def register(app: typer.Typer) -> None:
    app.command()(init)
    app.command()(append)
    app.command()(show)
    app.command()(log)


def init(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Create a ledger database (or bring an empty one to the current schema)."""
    from ledger.database import display_url

    with open_store(db, create=True) as store:
        result = {"db": display_url(store.url), "receipts": store.count()}
    if json_out:
        emit_json(result)
    else:
        out.print(f"ledger ready at {result['db']} ({result['receipts']} receipts)")


def append(
    source: Annotated[str, typer.Argument(help="A file of canonical receipts (one per line), or - for stdin.")],
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Append receipts. A receipt already present is a no-op; one citing an absent parent is refused."""
    from ledger.receipts import parse_receipt

    def parsed(numbered: Iterator[tuple[int, bytes]]) -> list[Any]:
        out = []
        for number, line in numbered:
            try:
                out.append(parse_receipt(line, source=f"{name} line {number}"))
            except InputError as exc:  # which line: a file holds many receipts
                raise InputError(f"{name} line {number}: {exc.one_line()}") from exc
        return out

    name = "stdin" if source == "-" else source
    if source == "-":
        receipts = parsed(_lines(sys.stdin.buffer, name))
    else:
        from ledger.digests import open_regular

        with os.fdopen(open_regular(source), "rb") as f:  # a device or a FIFO is refused: use - for a pipe
            receipts = parsed(_lines(f, name))
    if not receipts:
        raise InputError(f"{name}: no receipt found")
    with open_store(db) as store:
        _check_revocations(store, receipts)
        stored = store.append_many(receipts)
    added = sum(s.new for s in stored)  # what this call stored: other writers may be appending meanwhile
    if json_out:
        emit_json({"appended": added, "existing": len(stored) - added, "ids": [s.receipt.id for s in stored]})
    else:
        for s in stored:
            out.print(f"{s.receipt.id}  {s.receipt.kind}")
        out.print(f"{added} appended, {len(stored) - added} already present")


SHOWN_MAX = 4000  # characters of one measurement in show's table; --json and --raw print everything
MAX_LINE = 256 << 20  # bytes of one receipt line: a line that never ends (/dev/zero on stdin) is refused here


def _clipped(text: str) -> str:
    """``text`` as show's table holds it: folding a long cell costs rich time quadratic in its length (a 16 MB value
    took 87 s), and a long name widens every row of the table to its length (a 1 MB one printed 6 MB)."""
    if len(text) <= SHOWN_MAX:
        return text
    return f"{text[:SHOWN_MAX]}... ({len(text):,} characters in all: --json or --raw prints them)"


def _lines(stream: BinaryIO, name: str) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of ``stream`` with their numbers, read one at a time (so the first bad one is met
    before the rest is read, and `yes | ledger append -` ends at line 1), each at most MAX_LINE bytes."""
    for number, line in enumerate(iter(lambda: stream.readline(MAX_LINE + 1), b""), 1):
        if len(line) > MAX_LINE:
            raise InputError(f"{name} line {number}: longer than {MAX_LINE:,} bytes, the most a receipt line may be")
        if line.strip():
            yield number, line


def _check_revocations(store: Any, receipts: list[Any]) -> None:
    """Key revocations among ``receipts`` are appended only as `ledger keys revoke` would: signed (the store's
    LEDGER_SIGNING_KEY) by a registered key not revoked (ledger.revocation.check_revoker)."""
    from ledger.rules import KEY_REVOCATION_FORMAT

    wanted = [r for r in receipts if r.kind == "key" and r.measurements.get("format") == KEY_REVOCATION_FORMAT]
    if not wanted:
        return
    from ledger.revocation import check_revoker, revocations
    from ledger.signing import load_public_key
    from ledger.transparency import registered_keys

    keys, revoked = registered_keys(store), revocations(store)
    for r in wanted:
        key = r.measurements.get("key")
        label = load_public_key(key).label if isinstance(key, str) else str(key)
        check_revoker(store.signer, label, keys, revoked)


def _receipt_json(stored: Any) -> dict[str, Any]:
    r = stored.receipt
    return {"id": r.id, "seq": stored.seq, "recorded_ns": stored.recorded_ns, "receipt": r.to_document()}


def show(
    ref: Annotated[str, typer.Argument(help="Receipt id (blake3:<hex>) or a unique hex prefix.")],
    db: DbOpt = None,
    json_out: JsonOpt = False,
    raw: Annotated[bool, typer.Option("--raw", help="Print the canonical bytes exactly as hashed.")] = False,
) -> None:
    """Show one receipt."""
    with open_store(db) as store:  # an SQLite file is read with the standard library (ledger/reads.py)
        stored = store.get(ref)
    r = stored.receipt
    if raw:
        sys.stdout.buffer.write(r.body + b"\n")
        return
    if json_out:
        emit_json(_receipt_json(stored))
        return
    from rich.table import Table  # only for the table: --json and --raw start without rich

    table = Table(title=f"{r.kind} receipt", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows: list[tuple[str, str]] = [("id", r.id)]
    rows += [(name, str(getattr(r, name))) for name in ("run", "rank", "step", "prepared", "selection")
             if getattr(r, name) is not None]
    rows += [("parent", p) for p in r.parents]
    rows += [(f"artifact {name}", digest) for name, digest in sorted(r.artifacts.items())]
    for name, value in sorted(r.measurements.items()):
        shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
        rows.append((_clipped(name), _clipped(shown)))
    for name, value in rows:
        add_row(table, name, value)
    # Wide enough that an id or a digest (71 characters) is never folded across two lines, even in an 80-column
    # pipe (a copied or grepped id must be whole); a longer measurement still folds.
    print_wide(table, at_least=max(len(name) for name, _ in rows) + len(r.id) + 7)
    if r.kind in ("eval", "comparison", "quality"):  # breakdowns, comparisons and conditions as tables
        from ledger.cli.render import render_receipt

        try:
            render_receipt(out, r)
        except SHAPE_ERRORS as exc:  # the fields above are all there is to show; judging them is verify's
            err.print(f"ledger: warning: receipt {r.id}: its measurements are not in the shape of {r.kind} "
                      f"receipts ({type(exc).__name__}: {exc}), so they are shown as fields only (see `ledger "
                      "verify`)")


def log(
    db: DbOpt = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind.")] = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    prepared: Annotated[str | None, typer.Option(help="Only this prepared digest.")] = None,
    selection: Annotated[str | None, typer.Option(help="Only this selection digest.")] = None,
    rank: Annotated[int | None, typer.Option(help="Only this rank.", min=0, max=INT64_MAX)] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many.", min=0, max=INT64_MAX)] = None,
    json_out: JsonOpt = False,
) -> None:
    """List receipts in append order, filtered by field."""
    from ledger import digests

    for name, value in (("--prepared", prepared), ("--selection", selection)):
        if value is not None:
            digests.check_digest(value, name)
    with open_store(db) as store:
        found = store.find(kind=kind, run=run, prepared=prepared, selection=selection, rank=rank, limit=limit)
    if json_out:
        emit_json([_receipt_json(s) for s in found])
        return
    rows = ((str(s.seq), s.receipt.id[:23], s.receipt.kind, s.receipt.run or "", _opt(s.receipt.rank),
             _opt(s.receipt.step), str(len(s.receipt.parents))) for s in found)
    typer.echo(plain_table(("seq", "id", "kind", "run", "rank", "step", "parents"), rows))
    typer.echo(f"{len(found)} receipt(s)")


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)
