"""Schema migrations through Alembic, with the scripts shipped inside the installed package (``migrations``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import inspect
from sqlalchemy.exc import DBAPIError

import migrations
from ledger.database import display_url, make_engine, schema_revision
from ledger.errors import DatabaseError, InputError, UnknownSchema
from ledger.models import SCHEMA_HEAD, Base


def alembic_config(url: str, script_location: str | Path | None = None) -> Config:
    """An Alembic config for ``url``; the scripts are the ``migrations`` package installed with the ledger unless
    another directory is given (tests use a copy with an extra revision)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location or Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def heads(url: str = "sqlite://") -> list[str]:
    """The head revision(s) of the shipped scripts; exactly one unless someone branched the history."""
    return list(ScriptDirectory.from_config(alembic_config(url)).get_heads())


@contextmanager
def _database_errors(action: str) -> Iterator[None]:
    """Driver and Alembic failures become one-line DatabaseErrors (exit 4) saying what was being done."""
    try:
        yield
    except DBAPIError as exc:
        raise DatabaseError(f"{action} failed: {' '.join(str(exc.orig).split())}") from exc
    except CommandError as exc:
        raise DatabaseError(f"{action} failed: {exc}") from exc


def schema_diff(url: str) -> list[Any]:
    """Alembic autogenerate's differences between the database and the models (empty when they match)."""
    engine = make_engine(url)
    try:
        with _database_errors(f"comparing {display_url(url)} with the models"), engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def _has_ledger_tables(url: str) -> bool:
    engine = make_engine(url)
    try:
        with _database_errors(f"inspecting {display_url(url)}"), engine.connect() as conn:
            return bool(set(inspect(conn).get_table_names()) & set(Base.metadata.tables))
    finally:
        engine.dispose()


def _run(action: Callable[..., Any], cfg: Config, revision: str, url: str) -> None:
    with _database_errors(f"migrating {display_url(url)} to {revision}"):
        action(cfg, revision)


def upgrade(url: str, revision: str = "head", *, script_location: str | Path | None = None) -> None:
    """Bring the database to ``revision`` (creating the schema in an empty one).

    A database stamped with a revision no script knows raises UnknownSchema. One that holds the ledger tables but
    no stamp (made by ``Base.metadata.create_all``) is adopted when it equals the head schema exactly, and refused
    otherwise: creating tables over it would fail halfway.
    """
    cfg = alembic_config(url, script_location)
    script = ScriptDirectory.from_config(cfg)
    _check_target(script, revision)
    cur = current(url)
    if cur is not None and cur not in {s.revision for s in script.walk_revisions()}:
        raise UnknownSchema(display_url(url), cur, script.get_current_head() or SCHEMA_HEAD)
    if cur is None and _has_ledger_tables(url):
        diff = schema_diff(url)
        if diff:
            raise DatabaseError(f"database {display_url(url)} holds ledger tables without a schema revision and "
                                f"they differ from {SCHEMA_HEAD} ({len(diff)} difference(s), first: {diff[0]}); "
                                f"refusing to migrate it")
        _run(command.stamp, cfg, SCHEMA_HEAD, url)
    _run(command.upgrade, cfg, revision, url)


def downgrade(url: str, revision: str, *, script_location: str | Path | None = None) -> None:
    """Downgrade the schema to ``revision`` ("base" drops every table). Destroys data newer revisions hold."""
    cfg = alembic_config(url, script_location)
    _check_target(ScriptDirectory.from_config(cfg), revision)
    _run(command.downgrade, cfg, revision, url)


def _check_target(script: ScriptDirectory, revision: str) -> None:
    """A target the scripts know (head, base, a relative step, a revision or a unique prefix of one): a typo is
    the user's (InputError, exit 2), not the database's."""
    if revision in ("head", "heads", "base") or re.fullmatch(r"[+-]\d+", revision):
        return
    try:
        found = script.get_revision(revision)
    except Exception:  # noqa: BLE001 - alembic's ResolutionError, CommandError...: all say "not a revision"
        found = None
    if found is None:
        known = [r.revision for r in script.walk_revisions()]
        raise InputError(f"unknown schema revision {revision!r} (known: head, base, {', '.join(reversed(known))})")


def current(url: str) -> str | None:
    """The revision stamped in the database, or None when it has none (a new or empty database)."""
    engine = make_engine(url)
    try:
        with _database_errors(f"reading the schema revision of {display_url(url)}"):
            return schema_revision(engine)
    finally:
        engine.dispose()
