"""Database URLs and engines: which database a command means, how it is shown, how writers are made safe, and
which schema revision it carries. Both the store and the migrations stand on this module.

An SQLite ledger that this process cannot write (a read-only file, directory or mount: an auditor's copy) is
opened read-only through an SQLite URI (``file:...?mode=ro``). WAL mode needs its ``-shm`` file beside the
database; in a directory where that cannot be created, ``immutable=1`` reads the file alone, which is exact only
when no ``-wal`` file holds changes not yet written back (see :func:`readonly_url`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlparse

from ledger.errors import DatabaseError, InputError, quoted

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine

# SQLAlchemy is imported inside the functions that need it: resolving a URL, reading a plain SQLite URL's path and
# the file checks serve `ledger show`, which reads SQLite with the standard library (ledger/reads.py).

# The Alembic revision this code reads and writes. tests/ledger/test_migrations.py checks it is the only head.
SCHEMA_HEAD = "0005_signature_index"
# Every revision this code knows, oldest first: a database at one of these but not the head needs an upgrade.
KNOWN_REVISIONS = ("0001_initial", "0002_seq_keyed_index_rows", "0003_receipt_locations", "0004_transparency_log",
                   "0005_signature_index")

REVISION_SQL = "SELECT version_num FROM alembic_version"  # where Alembic stamps it

DEFAULT_DB = "ledger.db"
ENV_DB = "LEDGER_DB"
BUSY_TIMEOUT_S = 120.0
# PostgreSQL writers wait on this transaction-level advisory lock, the counterpart of SQLite's BEGIN IMMEDIATE: a
# sequence hands out seqs before commit, so without it two appends could commit out of seq order (the log's leaves
# follow seq order; a reader streaming by seq would skip a row committed late) or both extend the log at one index.
PG_WRITE_LOCK = 0x6C6564676572  # b"ledger"


def expand_home(value: str) -> Path:
    """``value`` as a path, a leading ``~`` or ``~user`` expanded; InputError (not pathlib's RuntimeError) for a user
    this machine does not know."""
    try:
        return Path(value).expanduser()
    except RuntimeError as exc:  # "Could not determine home directory"
        raise InputError(f"{value}: cannot expand {value.split(os.sep)[0]!r}: no such user here") from exc


def resolve_url(db: str | os.PathLike[str] | None = None) -> str:
    """``--db`` value, else ``$LEDGER_DB``, else ``./ledger.db``; a plain path means an SQLite file. An empty
    ``$LEDGER_DB`` is unset, as shells have it; an empty ``--db`` (``--db "$DB"`` with DB unset, say) is refused
    rather than taken as the current directory."""
    if db is not None and not os.fspath(db):
        raise InputError("the ledger database is empty: give an SQLite path or an SQLAlchemy URL (--db)")
    value = os.fspath(db) if db is not None else os.environ.get(ENV_DB) or DEFAULT_DB
    if "://" in value:
        _check_url(value)
        if value.startswith("sqlite") and sqlite_path(value) is None:
            raise InputError(f"the ledger database {value} is an in-memory SQLite database: it would hold nothing from "
                             f"one command to the next; give a file path or a server's URL")
        return value
    return f"sqlite:///{expand_home(value).resolve()}"


def _check_url(value: str) -> None:
    """An SQLAlchemy URL that parses, else InputError (SQLAlchemy raises a bare ValueError for a port that is not a
    number, ``postgresql://host:abc/db``). Plain ``sqlite:///path`` URLs are not parsed here (no SQLAlchemy)."""
    if _PLAIN_SQLITE.fullmatch(value):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(value)
    except (ArgumentError, ValueError) as exc:
        raise InputError(f"the ledger database {quoted(_masked(value))} is not a database URL ({exc})") from None


_PLAIN_SQLITE = re.compile(r"sqlite:///([^?#%]+)")  # what resolve_url makes of a path: no query, nothing quoted


def plain_sqlite_path(url: str) -> Path | None:
    """The file of a plain ``sqlite:///path`` URL (no query, nothing percent-encoded), read without SQLAlchemy;
    None for any other URL (:func:`sqlite_path` reads those)."""
    m = _PLAIN_SQLITE.fullmatch(url)
    return None if m is None or m.group(1) == ":memory:" else expand_home(m.group(1))


def sqlite_path(url: str) -> Path | None:
    """The file of an SQLite URL: ``sqlite:///path`` or the URI form ``sqlite:///file:path?...&uri=true``;
    None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite"):
        return None
    plain = plain_sqlite_path(url)
    if plain is not None:
        return plain
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    db = parsed.database
    if not db or db == ":memory:":
        return None
    if _truthy(parsed.query.get("uri")) and db.startswith("file:"):
        if parsed.query.get("mode") == "memory":  # file:name?mode=memory: a named in-memory database, no file
            return None
        db = unquote(urlparse(db).path)
        if not db or db == ":memory:":
            return None
    return expand_home(db)


def is_readonly_url(url: str) -> bool:
    """Whether an SQLite URI asks for read-only access (``mode=ro`` or ``immutable=1``)."""
    if not url.startswith("sqlite") or plain_sqlite_path(url) is not None:
        return False
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        query = make_url(url).query
    except ArgumentError:
        return False
    return query.get("mode") == "ro" or _truthy(query.get("immutable"))


def _truthy(value: Any) -> bool:
    return isinstance(value, str) and value.lower() in ("1", "true", "yes", "on")


def unwritable(path: Path) -> str | None:
    """Why this process may not write the SQLite ledger file ``path`` (None: it may). Writing needs the file and
    its directory (WAL's -wal and -shm files live beside it); ``os.access`` says no on a read-only mount too."""
    if _on_readonly_mount(path):
        return "the file system is mounted read-only"
    if not os.access(path, os.W_OK):
        return "the file is not writable by this user"
    if not os.access(path.parent, os.W_OK):
        return "its directory is not writable by this user"
    return None


def _on_readonly_mount(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only (False when that cannot be told)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_creatable(path: Path) -> None:
    """DatabaseError unless a new SQLite ledger file can be made at ``path`` as far as its directory goes: SQLite
    says only "unable to open database file" for a directory that does not exist, is a file, or is read-only."""
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise DatabaseError(f"cannot create a ledger at {path}: the directory {parent} {what}")
    if _on_readonly_mount(parent):
        raise DatabaseError(f"cannot create a ledger at {path}: the file system is mounted read-only")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DatabaseError(f"cannot create a ledger at {path}: the directory {parent} is not writable by this user")


def _readonly_query(path: Path) -> dict[str, str]:
    """The URI parameters that read ``path`` without writing anything, or DatabaseError when none can be exact."""
    query = {"mode": "ro"}
    if not os.access(path.parent, os.W_OK):  # SQLite cannot create the -shm file it reads a WAL through
        wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
        pending = wal.exists() and wal.stat().st_size > 0
        if not pending:
            query["immutable"] = "1"  # nothing outside the main file: read it alone, without locks
        elif not shm.exists():
            # immutable=1 would silently skip the receipts still in the -wal file
            raise DatabaseError(f"cannot read {path} in a read-only directory: {wal.name} holds changes not yet "
                                f"written back and {shm.name} is missing; open it once where it is writable, or "
                                f"copy the ledger with its -wal file to a writable directory")
    return query


def readonly_url(path: Path) -> str:
    """An SQLAlchemy URL that reads ``path`` without writing anything (an SQLite URI), or DatabaseError when none
    can be exact."""
    from sqlalchemy.engine import URL

    query = {**_readonly_query(path), "uri": "true"}
    return URL.create("sqlite", database="file:" + quote(str(path)), query=query).render_as_string(
        hide_password=False)


def readonly_uri(path: Path) -> str:
    """:func:`readonly_url` as the URI the standard library opens (``sqlite3.connect(uri, uri=True)``)."""
    query = _readonly_query(path)
    return f"file:{quote(str(path))}?" + "&".join(f"{k}={v}" for k, v in query.items())


def failure(url: str, detail: str) -> DatabaseError:
    """One line for a database failure, naming the ledger and, where SQLite says it, what is wrong with it.
    ``detail`` is the driver's message (its first line is kept)."""
    where = display_url(url)
    detail = " ".join(detail.split("\n")[0].split())
    low = detail.lower()
    if "file is not a database" in low:
        return DatabaseError(f"cannot read {where}: it is not an SQLite ledger ({detail})")
    if "malformed" in low:
        return DatabaseError(f"cannot read {where}: the database file is damaged ({detail}); restore it from a copy")
    if "disk is full" in low or "no space" in low:  # SQLite rolled the transaction back
        return DatabaseError(f"cannot write to {where}: the disk is full ({detail}); nothing was written, and "
                             f"everything stored before is intact")
    if "readonly" in low or "read-only" in low:
        return DatabaseError(f"cannot write to {where}: it is read-only ({detail})")
    if "disk i/o error" in low:  # e.g. no room left to create the -shm file WAL reads through
        return DatabaseError(f"cannot use {where}: {detail}; is its disk full or failing?")
    return DatabaseError(f"database {where}: {detail}")


def display_url(url: str) -> str:
    path = sqlite_path(url)
    if path is not None:
        return str(path)
    return _masked(url)


def _masked(url: str) -> str:
    """``url`` without its credentials (``//user:secret@`` becomes ``//***@``): what an error line may show."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def make_engine(url: str) -> Engine:
    """An engine configured for safe concurrent appends (see the module docstring)."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url

    if not url.startswith("sqlite"):
        postgres = make_url(url).get_backend_name() == "postgresql"
        # READ COMMITTED whatever the server's default: each statement after the lock sees every append committed
        # before it was granted (under REPEATABLE READ the snapshot would be taken before the lock).
        try:
            engine = create_engine(url, pool_pre_ping=True,
                                   **({"isolation_level": "READ COMMITTED"} if postgres else {}))
        except ImportError as exc:  # the dialect's DBAPI module (mysql:// without MySQLdb, say)
            raise DatabaseError(f"database {display_url(url)}: its driver is not installed (no module "
                                f"{exc.name or exc!s})") from None
        if postgres:

            @event.listens_for(engine, "begin")
            def _on_pg_begin(conn: Any) -> None:
                if conn.get_execution_options().get("ledger_write", False):
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_WRITE_LOCK})")

        return engine
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S, "isolation_level": None})
    readonly = is_readonly_url(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        if not readonly:  # a read-only connection cannot change the journal; a WAL ledger stays WAL
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
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    with engine.connect() as conn:
        try:
            row = conn.execute(text(REVISION_SQL)).first()
        except OperationalError:
            return None
        except Exception as exc:  # PostgreSQL: undefined table is a ProgrammingError
            if "alembic_version" in str(exc):
                return None
            raise
    return row[0] if row else None


def check_sqlite_file(path: Path) -> None:
    """An existing SQLite ledger file must be a regular file (DatabaseError naming what it is otherwise)."""
    if not path.exists():
        raise DatabaseError(f"no ledger at {path}: run `ledger init` (or pass --db / set {ENV_DB})")
    if not path.is_file():
        from ledger.digests import file_kind

        raise DatabaseError(f"cannot open {path}: it is {file_kind(path.stat().st_mode)}, not an SQLite ledger file")


def check_revision(url: str, current: str | None) -> None:
    """The database must be at :data:`SCHEMA_HEAD`: SchemaOutOfDate for a revision this code knows (or none),
    UnknownSchema for one it does not (written by newer software)."""
    if current == SCHEMA_HEAD:
        return
    from ledger.errors import SchemaOutOfDate, UnknownSchema

    if current is None or current in KNOWN_REVISIONS:
        raise SchemaOutOfDate(display_url(url), current, SCHEMA_HEAD)
    raise UnknownSchema(display_url(url), current, SCHEMA_HEAD)


@contextmanager
def driver_cursor(conn: Connection, what: str) -> Iterator[Any]:
    """The DBAPI cursor of ``conn``'s connection (inside its transaction), its errors raised as SQLAlchemy's
    (IntegrityError, OperationalError...): the store's retries and typed errors expect those. For the hot paths
    where SQLAlchemy's per-statement and per-row work costs more than the database's (the log's appends on SQLite,
    bulk rows through PostgreSQL's COPY: :func:`copy_rows`)."""
    from sqlalchemy.exc import DBAPIError

    error = conn.dialect.loaded_dbapi.Error  # sqlite3.Error, psycopg.Error
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        yield cur
    except error as exc:
        raise DBAPIError.instance(what, None, exc, error) from exc
    finally:
        cur.close()


def copy_rows(conn: Connection, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Insert ``rows`` into ``table`` in the caller's PostgreSQL transaction with one ``COPY ... FROM STDIN``: an
    executemany sends a statement per row, which the server runs one at a time (about 50 us a row here), where a
    COPY streams them all (benchmarks/README.md, ledger_bench)."""
    if not rows:
        return
    with driver_cursor(conn, f"COPY into {table}") as cur, cur.copy(
            f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
