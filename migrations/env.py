"""Alembic environment: runs against the URL ledger.migrate passes in, in batch mode for SQLite."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from ledger.database import make_engine
from ledger.errors import DatabaseError
from ledger.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise DatabaseError("no database URL: run migrations through `ledger db upgrade` (ledger.migrate)")
    engine = make_engine(url)
    try:
        # ledger_write: BEGIN IMMEDIATE on SQLite, so a migration waits for appenders instead of failing busy.
        with engine.connect() as conn:
            conn.execution_options(ledger_write=True)
            sqlite = conn.dialect.name == "sqlite"
            raw = conn.connection.driver_connection
            if sqlite and raw is not None:
                # Batch mode recreates a table (copy, DROP, rename). With foreign keys on, dropping `receipts`
                # while receipt_parents rows cite it fails. The pragma is ignored inside a transaction, so it is
                # set on the DBAPI connection before the migration's transaction begins; checked again below.
                raw.execute("PRAGMA foreign_keys=OFF")
            try:
                _run(conn, check_foreign_keys=sqlite)
            finally:
                if sqlite and raw is not None:
                    raw.execute("PRAGMA foreign_keys=ON")
    finally:
        engine.dispose()


def _run(connection: Connection, check_foreign_keys: bool = False) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        compare_type=True,
        # Alembic assumes pysqlite's implicit commits before DDL; make_engine issues a real BEGIN, so on SQLite
        # too the whole upgrade is one transaction and a failure leaves the previous revision intact.
        transactional_ddl=True if connection.dialect.name == "sqlite" else None,
    )
    with context.begin_transaction():
        context.run_migrations()
        if check_foreign_keys:
            # Foreign keys were off during the migration: refuse to commit one that broke a reference.
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise DatabaseError(f"migration left {len(broken)} dangling foreign key(s), first: {tuple(broken[0])}")


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run `ledger db upgrade`")
run_migrations_online()
