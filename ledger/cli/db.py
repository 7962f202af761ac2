"""`ledger db upgrade/downgrade/current`: the ledger's Alembic schema migrations."""

from __future__ import annotations

from typing import Annotated

import typer

from ledger.cli.common import DbOpt, JsonOpt, emit_json, make_typer, out


def register(app: typer.Typer) -> None:
    db_app = make_typer("Schema migrations of the ledger database.")
    db_app.command("upgrade")(db_upgrade)
    db_app.command("downgrade")(db_downgrade)
    db_app.command("current")(db_current)
    app.add_typer(db_app, name="db")


def db_upgrade(
    db: DbOpt = None,
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    json_out: JsonOpt = False,
) -> None:
    """Upgrade the database schema (creates the database if it does not exist)."""
    from ledger import migrate
    from ledger.database import display_url, resolve_url

    url = resolve_url(db)
    _sqlite_target(url, create=True)
    before = migrate.current(url)
    migrate.upgrade(url, revision)
    after = migrate.current(url)
    if json_out:
        emit_json({"db": display_url(url), "from": before, "to": after})
    else:
        out.print(f"{display_url(url)}: {before or 'empty'} -> {after}")


def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision (base removes every table).")],
    db: DbOpt = None,
) -> None:
    """Downgrade the schema. Destroys data a newer schema holds: for recovery and tests only."""
    from ledger import migrate
    from ledger.database import resolve_url

    url = resolve_url(db)
    _sqlite_target(url, create=False)
    migrate.downgrade(url, revision)


def db_current(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Print the database's schema revision and the one this ledger needs."""
    from ledger import migrate
    from ledger.database import display_url, resolve_url
    from ledger.models import SCHEMA_HEAD

    url = resolve_url(db)
    _sqlite_target(url, create=False)  # read, as `log` reads: no ledger created at a path that has none
    cur = migrate.current(url)
    if json_out:
        emit_json({"db": display_url(url), "current": cur, "head": SCHEMA_HEAD, "up_to_date": cur == SCHEMA_HEAD})
    else:
        note = "up to date" if cur == SCHEMA_HEAD else "run `ledger db upgrade`"
        out.print(f"{display_url(url)}: {cur or 'no schema'} (head {SCHEMA_HEAD}; {note})")


def _sqlite_target(url: str, *, create: bool) -> None:
    """An SQLite ledger file named by ``url`` must be a regular file (no FIFO or device opened), or, when the
    command may create it and nothing is there, creatable (its directory named otherwise); other URLs pass."""
    import os

    from ledger.database import check_creatable, check_sqlite_file, sqlite_path

    path = sqlite_path(url)
    if path is None:
        return
    if create and not os.path.lexists(path):
        check_creatable(path)
    else:
        check_sqlite_file(path)
