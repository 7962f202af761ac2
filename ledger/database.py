"""Database URLs and engines: which database a command means, how it is shown, how writers are made safe, and
which schema revision it carries. Both the store and the migrations stand on this module."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import OperationalError

DEFAULT_DB = "ledger.db"
ENV_DB = "LEDGER_DB"
BUSY_TIMEOUT_S = 120.0


def resolve_url(db: str | os.PathLike[str] | None = None) -> str:
    """``--db`` value, else ``$LEDGER_DB``, else ``./ledger.db``; a plain path means an SQLite file."""
    value = os.fspath(db) if db is not None else os.environ.get(ENV_DB) or DEFAULT_DB
    if "://" in value:
        return value
    return f"sqlite:///{Path(value).expanduser().resolve()}"


def display_url(url: str) -> str:
    return url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else re.sub(r"//[^@/]*@", "//***@", url)


def make_engine(url: str) -> Engine:
    """An engine configured for safe concurrent appends (see the module docstring)."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S, "isolation_level": None})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("ledger_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def schema_revision(engine: Engine) -> str | None:
    """The Alembic revision stamped in the database, or None for a database without our schema."""
    with engine.connect() as conn:
        try:
            row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
        except OperationalError:
            return None
        except Exception as exc:  # PostgreSQL: undefined table is a ProgrammingError
            if "alembic_version" in str(exc):
                return None
            raise
    return row[0] if row else None
