"""The append-only ledger store: SQLite (WAL) by default, any SQLAlchemy URL otherwise.

Writes go through SQLAlchemy 2, imported at the first write. Reads are plain SQL through the database driver
(ledger/reads.py): on an SQLite ledger file the standard library's ``sqlite3``, so a command that only reads never
imports SQLAlchemy; elsewhere the driver under a SQLAlchemy connection.

Writers take the database write lock up front (SQLite ``BEGIN IMMEDIATE``) so several processes appending at once
neither fork chains nor fail with "database is locked"; readers use plain deferred transactions. The library
never updates or deletes a receipt row.

Every database failure leaves a public method as a typed :class:`~ledger.errors.DatabaseError` naming the ledger
(not a SQLAlchemy exception): a file that is not SQLite or is damaged, a read-only ledger asked to append, a full
disk. A failed append has rolled back: every receipt stored before it is still there.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from ledger.database import (
    REVISION_SQL,
    SCHEMA_HEAD,
    check_creatable,
    check_revision,
    check_sqlite_file,
    copy_rows,
    display_url,
    failure,
    is_readonly_url,
    make_engine,
    plain_sqlite_path,
    readonly_uri,
    readonly_url,
    resolve_url,
    schema_revision,
    sqlite_path,
    unwritable,
)
from ledger.errors import (
    ChainBroken,
    DatabaseError,
    InputError,
    MissingParents,
    RecordMismatch,
    StoredBodyInvalid,
    UnknownExperiment,
    UnknownReceipt,
)
from ledger.reads import (
    MATCHES,
    MIN_PREFIX,
    ROW_COLUMNS,
    SELECT_ROWS,
    DriverReads,
    Reads,
    SqliteReads,
    Stored,
    StoredRow,
    connect_sqlite,
    id_range,
    marks,
    parsed,
    pick,
    scalar,
    stored_bytes,
)
from ledger.receipts import Receipt

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.orm import Session

    from ledger.note import Signer

__all__ = ["MIN_PREFIX", "ENV_SIGNING_KEY", "ArtifactRef", "ParentEdge", "Store", "Stored", "StoredRow"]

# A key file whose key signs every receipt a Store opened without an explicit signer appends: set by the main job so
# that rank processes it launches sign too (docs/transparency.md). Empty counts as unset.
ENV_SIGNING_KEY = "LEDGER_SIGNING_KEY"
_CHUNK = 500  # bound on bound parameters per IN (...) query

# Every read is plain SQL run through the driver (ledger/reads.py): on an SQLite file the standard library's sqlite3,
# so reading a ledger imports no SQLAlchemy; writes import it when they first happen. The columns of a receipt row
# are StoredRow's (ledger/reads.py), read as plain tuples (9.8 us a row through an ORM session against 2.3 us).
_COLS = ", ".join(f"r.{c}" for c in ROW_COLUMNS)  # the same columns where a join makes names ambiguous
_ROWS_AFTER = f"{SELECT_ROWS} WHERE seq > ? ORDER BY seq LIMIT ?"
_SEQ = operator.attrgetter("seq")
_ROWS_AFTER_UP_TO = f"{SELECT_ROWS} WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?"
# An experiment's seq range and count, by its rows' prepared column (its index); the audit's readers share it.
EXPERIMENT_SPAN = "SELECT MIN(seq), MAX(seq), COUNT(*) FROM receipts WHERE prepared = ?"
_ROW_BY_ID = f"{SELECT_ROWS} WHERE id = ?"
_SELECT_IDS = f"SELECT id FROM receipts WHERE id >= ? AND id < ? ORDER BY id LIMIT {MATCHES}"


@functools.cache
def _rows_by_id(n: int) -> str:
    return f"{SELECT_ROWS} WHERE id IN ({marks(n)})"


@functools.cache
def _seqs_by_id(n: int, with_body: bool) -> str:
    return f"SELECT id, seq, recorded_ns{', body' if with_body else ''} FROM receipts WHERE id IN ({marks(n)})"


@functools.cache
def _locations(n: int) -> str:
    return (f"SELECT digest, uri FROM artifact_locations WHERE digest IN ({marks(n)}) "
            f"ORDER BY digest, recorded_ns")


@functools.cache
def _receipt_locations(n: int) -> str:
    return (f"SELECT r.id, l.name, l.uri FROM receipt_locations l JOIN receipts r ON r.seq = l.receipt_seq "
            f"WHERE r.id IN ({marks(n)}) ORDER BY r.id, l.name, l.uri")


def _closure_sql(up: bool) -> str:
    """Receipt rows reachable from the one with id ``?`` over parent edges (up) or child edges (down)."""
    step = ("SELECT p.parent_seq FROM receipt_parents p JOIN closure c ON p.child_seq = c.seq" if up else
            "SELECT p.child_seq FROM receipt_parents p JOIN closure c ON p.parent_seq = c.seq")  # the parent_seq index
    return (f"WITH RECURSIVE closure(seq) AS (SELECT seq FROM receipts WHERE id = ? UNION {step}) "
            f"SELECT {_COLS} FROM receipts r JOIN closure c ON r.seq = c.seq ORDER BY r.seq")


_ANCESTORS = _closure_sql(up=True)
_DESCENDANTS = _closure_sql(up=False)
# The verifier's index rows: for a range of seqs (lo..hi) one range of each table's primary key, else by lists of
# seqs. A parent's id is looked up by its seq, among the rows read with it first (most parents are), else by
# _IDS_OF_SEQS; a join did every look-up in the database, a third of reading the index rows.
_EDGES = "SELECT child_seq, parent_seq FROM receipt_parents WHERE child_seq "
_ARTIFACTS = "SELECT receipt_seq, name, digest FROM receipt_artifacts WHERE receipt_seq "
_IDS_OF_SEQS = "SELECT seq, id FROM receipts WHERE seq IN "
_LOCATION_OWNERS = ("SELECT DISTINCT r.id, r.seq FROM receipts r JOIN receipt_locations l ON r.seq = l.receipt_seq "
                    "WHERE l.uri = ? ORDER BY r.seq")


@functools.cache
def _write_statements() -> dict[str, Any]:
    """The append path's SQLAlchemy statements off SQLite (PostgreSQL), built once on the first write: building a
    statement per call costs more than running it."""
    from sqlalchemy import insert

    from ledger.models import ReceiptRow

    return {"receipts": insert(ReceiptRow)}


# The columns _insert fills, in the order of its tuples (seq is assigned by the database or by _insert).
_RECEIPT_COLUMNS = ("id", "kind", "run", "rank", "step", "prepared", "selection", "body", "recorded_ns")
_PARENT_COLUMNS = ("child_seq", "parent_seq")
_ARTIFACT_COLUMNS = ("receipt_seq", "name", "digest")


def _sqlite_insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_SQLITE_TOP_SEQ = "SELECT coalesce(max(seq), 0) FROM receipts"
# PostgreSQL: n values of the receipts' sequence, taken under the write lock (so in commit order across writers).
_NEXT_SEQS = "SELECT nextval(pg_get_serial_sequence('receipts', 'seq')) FROM generate_series(1, ?)"
_SQLITE_INSERT_RECEIPTS = _sqlite_insert("receipts", ("seq", *_RECEIPT_COLUMNS))
_SQLITE_INSERT_PARENTS = _sqlite_insert("receipt_parents", _PARENT_COLUMNS)
_SQLITE_INSERT_ARTIFACTS = _sqlite_insert("receipt_artifacts", _ARTIFACT_COLUMNS)


def _insert(conn: Connection, new: list[Receipt], now: int, seq_of: dict[str, int]) -> dict[str, int]:
    """Insert new receipts (parents before children) and their edge and artifact rows; returns ``id -> seq``.

    ``seq_of`` maps every stored parent of ``new`` to its seq (the new seqs are added to it). Edge and artifact
    rows are keyed by seq (ledger/models.py), so the new receipts' seqs must be known before those rows are written.

    On SQLite the rows go in as plain tuples through the driver's executemany (SQLAlchemy's per-row parameter
    handling cost more than SQLite's own work, benchmarks/README.md), and the seqs are assigned here: the writer
    holds the write lock from its first statement (BEGIN IMMEDIATE), so max(seq) cannot move under it. Were the
    lock ever missing, a clash would be an IntegrityError or a busy snapshot, both retried by append_many.
    Elsewhere (PostgreSQL) the database's sequence assigns them: a single insert returns its seq; a batch takes its
    seqs from the sequence under the write lock and goes in, with its edge and artifact rows, by COPY
    (ledger.database.copy_rows: a statement per row cost the server about 50 us a row).
    """
    sqlite = conn.dialect.name == "sqlite"
    if sqlite:
        top = conn.exec_driver_sql(_SQLITE_TOP_SEQ).scalar_one()
        rows = [(top + i, r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body, now)
                for i, r in enumerate(new, start=1)]
        conn.exec_driver_sql(_SQLITE_INSERT_RECEIPTS, rows)
        new_seqs = {row[1]: row[0] for row in rows}
    else:
        if len(new) == 1:  # the common single append: its seq comes back with the insert
            r = new[0]
            key = conn.execute(_write_statements()["receipts"], dict(zip(_RECEIPT_COLUMNS, (
                r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body, now), strict=True))
            ).inserted_primary_key
            assert key is not None  # SQLAlchemy reports the key of a single-row insert on every backend
            new_seqs = {new[0].id: key[0]}
        else:  # seqs from the sequence, then one COPY (an INSERT of many rows costs psycopg 70 us a row to parse)
            seqs = sorted(seq for seq, in DriverReads(conn).all(_NEXT_SEQS, (len(new),)))
            copy_rows(conn, "receipts", ("seq", *_RECEIPT_COLUMNS),
                      [(seq, r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body, now)
                       for seq, r in zip(seqs, new, strict=True)])
            new_seqs = {r.id: seq for seq, r in zip(seqs, new, strict=True)}
    seq_of.update(new_seqs)
    edges = [(new_seqs[r.id], seq_of[p]) for r in new for p in r.parents]
    arts = [(new_seqs[r.id], name, digest) for r in new for name, digest in r.artifacts.items()]
    for sql, table, columns, index_rows in (
        (_SQLITE_INSERT_PARENTS, "receipt_parents", _PARENT_COLUMNS, edges),
        (_SQLITE_INSERT_ARTIFACTS, "receipt_artifacts", _ARTIFACT_COLUMNS, arts),
    ):
        if not index_rows:
            continue
        if sqlite:
            conn.exec_driver_sql(sql, index_rows)
        else:
            copy_rows(conn, table, columns, index_rows)
    return new_seqs


def missing_parent(seq: int) -> str:
    """What :class:`ParentEdge` holds for a parent seq that has no receipt row (never a well-formed id)."""
    return f"<no receipt at seq {seq}>"


class ParentEdge(NamedTuple):
    """A ``receipt_parents`` row as stored, its seqs turned into ids: ``child`` cites ``parent``."""

    child: str
    parent: str


class ArtifactRef(NamedTuple):
    """A ``receipt_artifacts`` row as stored, its seq turned into the receipt's id."""

    receipt: str
    name: str
    digest: str


class RowBatch(NamedTuple):
    """Receipt rows as stored with their index rows (those of these receipts only)."""

    rows: list[StoredRow]
    edges: list[ParentEdge]
    artifacts: list[ArtifactRef]


class _Unsure(Exception):
    """An optimistic append (Store.append_many) met something only a careful one can decide; rolls it back."""


def _parsed_body(rid: str, body: bytes) -> Receipt:
    try:
        return Receipt.from_bytes(body)
    except InputError as exc:
        raise StoredBodyInvalid(rid, exc.one_line()) from exc


def database_error(url: str, exc: DBAPIError) -> DatabaseError:
    """One line for a database failure raised through SQLAlchemy (ledger.database.failure's words)."""
    return failure(url, str(exc.orig if exc.orig is not None else exc))


@contextmanager
def _typed(url: str) -> Iterator[None]:
    """A SQLAlchemy DBAPIError raised inside as a DatabaseError (see :func:`database_error`); without SQLAlchemy
    imported, nothing raised can be one."""
    try:
        yield
    except Exception as exc:
        sa = sys.modules.get("sqlalchemy.exc")
        if sa is not None and isinstance(exc, sa.DBAPIError):
            raise database_error(url, exc) from exc
        raise


P = ParamSpec("P")
T = TypeVar("T")


def _typed_errors(method: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    """Raise a database failure inside ``method`` as a DatabaseError (see :func:`database_error`)."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: P.args, **kwargs: P.kwargs) -> T:
        with _typed(self.url):
            return method(self, *args, **kwargs)

    return wrapper


class Store:
    """An open ledger. Create with :meth:`open`; one per process. Reads may come from several threads (each reads
    through its own connection); appends from one at a time."""

    def __init__(self, engine: Engine | None, url: str, *, readonly: str | None = None, signer: Signer | None = None,
                 sqlite_file: Path | None = None) -> None:
        """``engine`` reads and writes; without one, ``sqlite_file`` (the plain SQLite file of ``url``) is read
        with the standard library and the engine that writes is made on the first write."""
        self.url = url
        self.readonly = readonly  # why this store cannot write (None: it can)
        # Signs every receipt appended without a signer of its own (None: such receipts are stored unsigned).
        self.signer = signer
        self._engine = engine
        self._sqlite_file = sqlite_file if engine is None else None
        self._local = threading.local()  # each thread's (pid, SqliteReads)
        self._opened: list[SqliteReads] = []
        path = sqlite_path(url)
        self._directory = path.parent if path is not None else None

    # --------------------------------------------------------------------------------------------- open

    @classmethod
    def open(cls, db: str | os.PathLike[str] | None = None, *, create: bool = False,
             signer: Signer | None = None) -> Store:
        """Open a ledger, checking its schema revision. ``create`` initialises an empty database.

        An SQLite ledger this process cannot write (file, directory or mount read-only) opens read-only: reads
        work, appends raise DatabaseError. Relative locations then resolve against the ledger's directory.

        ``signer`` becomes the store's default signer (:attr:`signer`): every receipt it appends is signed and the
        signature stored beside it, committed to by its log leaf. Without one, the key file named by
        ``$LEDGER_SIGNING_KEY`` is loaded if set (a 0600 file, ledger/signing.py).
        """
        if signer is None and os.environ.get(ENV_SIGNING_KEY):
            # Ed25519 and the note format only where a key is named: reading a ledger never signs
            from ledger.signing import load_private_key, operator_key

            signer = operator_key(load_private_key(os.environ[ENV_SIGNING_KEY]), "receipts",
                                  given=f"{ENV_SIGNING_KEY}={os.environ[ENV_SIGNING_KEY]}")
        url = resolve_url(db)
        plain = plain_sqlite_path(url)
        if plain is not None:
            return cls._open_file(url, plain, create, signer)
        connect, readonly = url, None
        path = sqlite_path(url)
        if path is not None and (path.exists() or not create):
            check_sqlite_file(path)
            readonly = "the URL asks for mode=ro" if is_readonly_url(url) else unwritable(path)
            if readonly is not None:
                connect = readonly_url(path)
        elif path is not None and not is_readonly_url(url):
            check_creatable(path)
        from sqlalchemy.exc import DBAPIError

        engine = make_engine(connect)
        try:
            current = schema_revision(engine)
            if current is None and create:
                if readonly is not None:
                    raise DatabaseError(f"cannot create a ledger in {display_url(url)}: {readonly}")
                from ledger.migrate import upgrade  # alembic only when a schema must be created

                upgrade(url)
                current = schema_revision(engine)
        except DBAPIError as exc:
            engine.dispose()
            raise database_error(url, exc) from exc
        if current != SCHEMA_HEAD:
            engine.dispose()
            check_revision(url, current)
        return cls(engine, url, readonly=readonly, signer=signer)

    @classmethod
    def _open_file(cls, url: str, path: Path, create: bool, signer: Signer | None) -> Store:
        """An SQLite ledger file named by a plain URL: read with the standard library (no SQLAlchemy until a
        write), its schema revision checked the same way."""
        if create and not path.exists():
            check_creatable(path)
            from ledger.migrate import upgrade  # alembic only when a schema must be created

            upgrade(url)
        check_sqlite_file(path)
        readonly = unwritable(path)
        store = cls(None, url, readonly=readonly, signer=signer, sqlite_file=path)
        try:
            current = store._revision()
            if current is None and create:
                if readonly is not None:
                    raise DatabaseError(f"cannot create a ledger in {display_url(url)}: {readonly}")
                from ledger.migrate import upgrade

                upgrade(url)
                current = store._revision()
            check_revision(url, current)
        except BaseException:
            store.close()
            raise
        return store

    def _revision(self) -> str | None:
        import sqlite3

        conn = self._sqlite_reads().conn
        try:
            found = conn.execute(REVISION_SQL).fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise failure(self.url, str(exc)) from exc
            return None  # not a ledger of ours, or not one yet
        except sqlite3.Error as exc:
            raise failure(self.url, str(exc)) from exc
        return None if found is None else found[0]

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (writes; reads off an SQLite file), made when first needed."""
        if self._engine is None:
            assert self._sqlite_file is not None
            self._engine = make_engine(self.url if self.readonly is None else readonly_url(self._sqlite_file))
        return self._engine

    @functools.cached_property
    def _writer(self) -> Engine:
        return self.engine.execution_options(ledger_write=True)

    def _sqlite_reads(self) -> SqliteReads:
        """This thread's reading connection to the SQLite file (a new one in a forked child)."""
        held = getattr(self._local, "reads", None)
        if held is not None and held[0] == os.getpid():
            return held[1]
        assert self._sqlite_file is not None
        if self.readonly is None:
            conn = connect_sqlite(str(self._sqlite_file), self.url)
        else:
            conn = connect_sqlite(readonly_uri(self._sqlite_file), self.url, uri=True)
        reads = SqliteReads(conn, self.url)
        self._local.reads = (os.getpid(), reads)
        self._opened.append(reads)
        return reads

    @contextmanager
    def reading(self) -> Iterator[Reads]:
        """One read transaction (its statements see one state of the ledger), failures as DatabaseError."""
        if self._sqlite_file is not None:
            with self._sqlite_reads().snapshot() as reads:
                yield reads
            return
        with _typed(self.url), self.engine.connect() as conn:
            yield DriverReads(conn)

    @property
    def directory(self) -> Path | None:
        """The directory of an SQLite ledger file (relative locations resolve against it); None otherwise."""
        return self._directory

    def _check_writable(self) -> None:
        if self.readonly is not None:
            raise DatabaseError(f"cannot write to {display_url(self.url)}: opened read-only ({self.readonly})")

    def close(self) -> None:
        for reads in self._opened:
            if reads.conn is not None:
                reads.conn.close()
        self._opened.clear()
        self._local = threading.local()
        if self._engine is not None:
            self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction holding the write lock from its first statement (BEGIN IMMEDIATE on SQLite)."""
        from sqlalchemy.orm import Session

        with Session(self._writer) as session, session.begin():
            yield session

    # ------------------------------------------------------------------------------------------- append

    def append(self, receipt: Receipt, *, check: bool = True, signer: Signer | None = None) -> Stored:
        """Append one receipt in its own transaction. Appending an existing id returns the stored one."""
        return self.append_many([receipt], check=check, signer=signer)[0]

    @_typed_errors
    def append_many(self, receipts: Sequence[Receipt], *, check: bool = True,
                    signer: Signer | None = None) -> list[Stored]:
        """Append receipts atomically (all or none). Parents must be stored already or come earlier here.

        With ``check`` the chain rules run against the parents before anything is written. Each returned
        :class:`Stored` says whether this call stored it (``new``) or found it stored already.

        Each new receipt gets a leaf of the transparency log (ledger/tlog.py) in the same transaction, committing to
        its id and its signature by ``signer`` (default: :attr:`signer`; none: unsigned). A receipt already stored
        keeps the signatures it was stored with: its leaf cannot change.
        """
        self._check_writable()
        from sqlalchemy.exc import IntegrityError

        signer = signer if signer is not None else self.signer
        # First assume none of the given receipts is stored yet, the usual case: that saves looking each one up
        # in the id index (a tenth of a batched append's time). Whatever that assumption could get wrong (an id
        # already stored makes the insert fail; a parent given later or a failed chain rule might be about a
        # stored receipt) rolls back and is decided again with every given id looked up.
        try:
            return self._append_retrying(receipts, check, signer, careful=False)
        except (_Unsure, IntegrityError):
            return self._append_retrying(receipts, check, signer, careful=True)

    def _append_retrying(self, receipts: Sequence[Receipt], check: bool, signer: Signer | None,
                         careful: bool) -> list[Stored]:
        from sqlalchemy.exc import IntegrityError, OperationalError

        for attempt in range(8):
            try:
                return self._append_many(receipts, check, signer, careful)
            except IntegrityError:
                # Careful: another writer stored one of these ids between our read and insert (only possible on
                # databases without BEGIN IMMEDIATE); retry: the existing rows make it a no-op.
                if not careful or attempt == 7:
                    raise
            except OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == 7:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _append_many(self, receipts: Sequence[Receipt], check: bool, signer: Signer | None,
                     careful: bool) -> list[Stored]:
        # Core statements on one connection, not ORM objects: the append path is the ledger's hot loop, and ORM
        # unit-of-work and row instances cost more than the SQL itself (benchmarks/README.md).
        from ledger import chain, tlog

        now = time.time_ns()
        with self._writer.begin() as conn:
            given = {r.id: r for r in receipts}
            # One query fetches the stored parents (their bodies only when the chain rules will read them) and,
            # when careful, finds which given receipts are stored already.
            cited = {p for r in receipts for p in r.parents}
            ids = cited | given.keys() if careful else cited - given.keys()
            found = self._lookup(conn, ids, with_body=check)
            stored = {rid: (seq, ns) for rid, (seq, ns, _) in found.items() if rid in given}
            outside = {rid: (seq, body) for rid, (seq, _, body) in found.items() if rid not in given}
            parsed: dict[str, Receipt] = {}  # each stored parent parsed once, however many receipts cite it
            batch: dict[str, Receipt] = {}
            for r in receipts:
                if r.id in stored or r.id in batch:
                    continue
                parents: dict[str, Receipt] = {}
                missing: list[str] = []
                for p in r.parents:
                    if p in batch or p in stored:  # earlier in this call, or given here and already stored
                        parents[p] = given[p]
                    elif p in outside:
                        if check:
                            if p not in parsed:
                                parsed[p] = _parsed_body(p, outside[p][1])
                            parents[p] = parsed[p]
                    elif p in given and not careful:  # given later: unless it is stored already, it comes too late
                        raise _Unsure
                    else:  # absent, or given later in this call: a parent must come first
                        missing.append(p)
                if missing:
                    raise MissingParents(r.id, sorted(missing))
                if check:
                    try:
                        chain.check_receipt(r, parents)
                    except ChainBroken:
                        if not careful:  # a stored receipt is not checked again: find out whether r is one
                            raise _Unsure from None
                        raise
                batch[r.id] = r
            if batch:
                seq_of = {rid: seq for rid, (seq, _) in outside.items()}
                seq_of.update((rid, seq) for rid, (seq, _) in stored.items())
                new_seqs = _insert(conn, list(batch.values()), now, seq_of)
                # The log grows in the same transaction, in the order the receipts were inserted (seq order). The
                # new receipts are signed here, once they are known: a batch signature (ledger/signing.py) signs
                # exactly the receipts stored with it, in log order, and costs one Ed25519 signature per 1,024.
                logged = sorted(batch, key=new_seqs.__getitem__)
                signed = {} if signer is None else tlog.sign_ids(signer, logged)
                tlog.append_leaves(conn, [tlog.LogEntry(new_seqs[rid], rid, signed.get(rid, ())) for rid in logged])
                stored.update((rid, (seq, now)) for rid, seq in new_seqs.items())
            out: list[Stored] = []
            for r in receipts:
                out.append(Stored(r, *stored[r.id], new=r.id in batch))
                batch.pop(r.id, None)  # a receipt given twice is new once
            return out

    @staticmethod
    def _lookup(conn: Connection, ids: Iterable[str], *, with_body: bool) -> dict[str, tuple[int, int, bytes]]:
        """``id -> (seq, recorded_ns, body)`` for those of ``ids`` that are stored (``b""`` bodies unless asked)."""
        out: dict[str, tuple[int, int, bytes]] = {}
        listed = sorted(ids)
        reads = DriverReads(conn)
        for i in range(0, len(listed), _CHUNK):
            chunk = listed[i : i + _CHUNK]
            for row in reads.all(_seqs_by_id(len(chunk), with_body), chunk):
                out[row[0]] = (row[1], row[2], row[3] if with_body else b"")
        return out

    @staticmethod
    def _rows_by_id(reads: Reads, ids: set[str]) -> list[StoredRow]:
        out: list[StoredRow] = []
        listed = sorted(ids)
        for i in range(0, len(listed), _CHUNK):
            chunk = listed[i : i + _CHUNK]
            out.extend(map(StoredRow._make, reads.all(_rows_by_id(len(chunk)), chunk)))
        return out

    @_typed_errors
    def add_location(self, digest: str, uri: str) -> None:
        """Record where an artifact's bytes can be found (idempotent). A relative path is kept as given and read
        relative to the ledger's directory (see :meth:`locations`)."""
        self._check_writable()
        from ledger.models import LocationRow

        with self._write() as session:
            have = session.get(LocationRow, (digest, uri))
            if have is None:
                session.add(LocationRow(digest=digest, uri=uri, recorded_ns=time.time_ns()))

    def locations(self, digest: str) -> list[str]:
        """Where the artifact's bytes may be, in the order recorded. A relative path is resolved against the
        ledger's directory, not the current one, so a ledger moved with its artifacts still finds them."""
        return self.locations_of([digest])[digest]

    @_typed_errors
    def locations_of(self, digests: Iterable[str]) -> dict[str, list[str]]:
        """:meth:`locations` of each digest (an empty list for one without any), in a query per 500 digests."""
        out: dict[str, list[str]] = {d: [] for d in digests}
        listed = sorted(out)
        with self.reading() as reads:
            for i in range(0, len(listed), _CHUNK):
                chunk = listed[i : i + _CHUNK]
                for digest, uri in reads.all(_locations(len(chunk)), chunk):
                    out[digest].append(self._resolved(uri))
        return out

    def _resolved(self, uri: object) -> str:
        """A recorded location with a relative path made relative to the ledger's directory. A value that is not
        text (a writer can store a BLOB or an integer in the column) names no place: it is kept as its repr, which
        the artifact check then reports as a copy missing there."""
        if type(uri) is not str:
            return repr(uri)
        base = self.directory
        if base is None or not uri or "://" in uri or os.path.isabs(uri):
            return uri
        return str(base / uri)

    @_typed_errors
    def add_receipt_locations(self, rid: str, places: Mapping[str, str]) -> None:
        """Record where receipt ``rid`` says the bytes of its artifacts are (artifact name -> location), in one
        transaction (idempotent); the receipt must be stored. Each place is recorded under the digest too, so
        lookups by digest find it."""
        from sqlalchemy import select

        from ledger.models import LocationRow, ReceiptLocationRow, ReceiptRow

        with self._write() as session:
            row = session.execute(select(ReceiptRow.seq, ReceiptRow.body).where(ReceiptRow.id == rid)).first()
            if row is None:
                raise UnknownReceipt(rid)
            seq, body = row
            receipt = Receipt.from_bytes(stored_bytes(body))
            for name, uri in sorted(places.items()):
                if name not in receipt.artifacts:
                    raise InputError(f"receipt {rid} has no artifact {name!r} to locate")
                if session.get(ReceiptLocationRow, (seq, name, uri)) is None:
                    session.add(ReceiptLocationRow(receipt_seq=seq, name=name, uri=uri))
                digest = receipt.artifacts[name]
                if session.get(LocationRow, (digest, uri)) is None:
                    session.add(LocationRow(digest=digest, uri=uri, recorded_ns=time.time_ns()))

    def evidence_locations(self, rid: str, name: str, digest: str) -> list[str]:
        """Where to read receipt ``rid``'s artifact ``name`` (of ``digest``) from: the receipt's own locations,
        else (a receipt written before schema 0003) every location of the digest."""
        return self.receipt_locations(rid).get(name) or self.locations(digest)

    @_typed_errors
    def location_owners(self, uri: str) -> list[str]:
        """The receipts that recorded ``uri`` as their own evidence (receipt locations), in append order."""
        with self.reading() as reads:
            return [rid for rid, _ in reads.all(_LOCATION_OWNERS, (uri,))]

    def receipt_locations(self, rid: str) -> dict[str, list[str]]:
        """Where receipt ``rid`` says its artifacts' bytes are: artifact name -> locations (empty if none); relative
        paths resolved as in :meth:`locations`."""
        return self.receipt_locations_of([rid])[rid]

    @_typed_errors
    def receipt_locations_of(self, rids: Iterable[str]) -> dict[str, dict[str, list[str]]]:
        """:meth:`receipt_locations` of each receipt, in a query per 500 receipts."""
        out: dict[str, dict[str, list[str]]] = {rid: {} for rid in rids}
        listed = sorted(out)
        with self.reading() as reads:
            for i in range(0, len(listed), _CHUNK):
                chunk = listed[i : i + _CHUNK]
                for rid, name, uri in reads.all(_receipt_locations(len(chunk)), chunk):
                    out[rid].setdefault(name, []).append(self._resolved(uri))
        return out

    # -------------------------------------------------------------------------------------------- reads

    @_typed_errors
    def resolve(self, ref: str) -> str:
        """Turn a full id or a unique hex prefix (at least 4 digits) into a full id (ledger/reads.py's rules)."""
        lo, hi = id_range(ref)
        with self.reading() as reads:
            return pick(ref, (rid for rid, in reads.all(_SELECT_IDS, (lo, hi))))

    @_typed_errors
    def ids(self, *, prepared: str) -> list[str]:
        """The stored ids of every receipt with this prepared digest, in append order (the rows' ids, whatever
        their bodies say: the verifier recomputes each)."""
        with self.reading() as reads:
            return [rid for rid, in reads.all("SELECT id FROM receipts WHERE prepared = ? ORDER BY seq", (prepared,))]

    def latest_prepared(self, prepared: str | None = None) -> str:
        """``prepared`` if a prepare receipt has that digest, else the latest prepare receipt's digest."""
        found = self.find(kind="prepare", prepared=prepared)
        if not found or found[-1].receipt.prepared is None:
            # Receipts of such an experiment without its prepare receipt: a broken chain, not a missing step.
            where = "prepared IS NOT NULL" if prepared is None else "prepared = ?"
            with self.reading() as reads:
                orphan = reads.all(f"SELECT id, prepared FROM receipts WHERE {where} ORDER BY seq LIMIT 1",
                                   () if prepared is None else (prepared,))
            if orphan:
                rid, digest = orphan[0]
                raise ChainBroken(rid, f"its experiment (prepared {digest}) has no prepare receipt in the ledger",
                                  field="prepared", expected="a prepare receipt with that digest", actual=None)
            raise UnknownExperiment(prepared)
        return found[-1].receipt.prepared

    @_typed_errors
    def get(self, ref: str) -> Stored:
        """The receipt with this id or unique prefix."""
        with self.reading() as reads:
            rid = self.resolve(ref)
            return parsed(StoredRow._make(reads.all(_ROW_BY_ID, (rid,))[0]))

    @_typed_errors
    def contains(self, rid: str) -> bool:
        with self.reading() as reads:
            return bool(reads.all("SELECT seq FROM receipts WHERE id = ?", (rid,)))

    @_typed_errors
    def find(
        self,
        *,
        kind: str | None = None,
        run: str | None = None,
        prepared: str | None = None,
        selection: str | None = None,
        rank: int | None = None,
        step: int | None = None,
        limit: int | None = None,
    ) -> list[Stored]:
        """Receipts matching every given field, in append order. The match is by the index columns; a receipt whose
        body disagrees with a column it was matched by (a tampered row) is RecordMismatch, never returned as a match
        (``ledger log --kind note`` listing an eval receipt)."""
        given = [(column, value) for column, value in (("kind", kind), ("run", run), ("prepared", prepared),
                                                      ("selection", selection), ("rank", rank), ("step", step))
                 if value is not None]
        sql = SELECT_ROWS
        if given:
            sql += " WHERE " + " AND ".join(f"{column} = ?" for column, _ in given)
        sql += " ORDER BY seq"
        params: list[Any] = [value for _, value in given]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        with self.reading() as reads:
            found = [parsed(StoredRow._make(row)) for row in reads.all(sql, params)]
        for stored in found:
            for column, value in given:
                if getattr(stored.receipt, column) != value:
                    raise RecordMismatch(stored.receipt.id, column, expected=getattr(stored.receipt, column),
                                         actual=value)
        return found

    @_typed_errors
    def count(self) -> int:
        with self.reading() as reads:
            return int(scalar(reads, "SELECT count(*) FROM receipts") or 0)

    def _closure(self, rid: str, up: bool) -> list[StoredRow]:
        """Ancestors (up) or descendants of ``rid``, itself included, in one recursive query over seqs."""
        with self.reading() as reads:
            return list(map(StoredRow._make, reads.all(_ANCESTORS if up else _DESCENDANTS, (rid,))))

    @_typed_errors
    def ancestors(self, ref: str) -> list[Stored]:
        """The receipt and all its ancestors, in append order (one recursive query)."""
        return [parsed(r) for r in self._closure(self.resolve(ref), True)]

    @_typed_errors
    def descendants(self, ref: str) -> list[Stored]:
        """The receipt and everything that cites it, directly or not, in append order."""
        return [parsed(r) for r in self._closure(self.resolve(ref), False)]

    # ----------------------------------------------------------------------------- raw rows for verify

    @_typed_errors
    def raw_closure(self, rid: str) -> tuple[list[StoredRow], list[ParentEdge], list[ArtifactRef]]:
        """Rows of a receipt's ancestry exactly as stored (nothing parsed), for the verifier to re-check."""
        with self.reading():
            rows = self._closure(rid, True)
            return (rows, *self._index_rows(rows))

    @_typed_errors
    def raw_rows(self, ids: Iterable[str]) -> RowBatch:
        """The rows of these receipts (those stored, in append order) and their index rows, exactly as stored."""
        with self.reading() as reads:
            rows = self._rows_by_id(reads, set(ids))
            rows.sort(key=_SEQ)
            return RowBatch(rows, *self._index_rows(rows))

    def _index_rows(self, rows: list[StoredRow]) -> tuple[list[ParentEdge], list[ArtifactRef]]:
        """The edge and artifact rows of ``rows``, their seqs turned back into receipt ids.

        A parent seq with no receipt row (a row deleted behind the library's back) comes back as
        :func:`missing_parent` so that the verifier sees the edge and reports it.

        Rows whose seqs are dense (an experiment's receipts, read a batch at a time) have their index rows read as
        one range of each table's primary key, the few rows of other receipts in it left out; others by seq lists.
        """
        id_of = {r.seq: r.id for r in rows}
        seqs = sorted(id_of)
        if not seqs:
            return [], []
        dense = seqs[-1] - seqs[0] < 2 * len(seqs)
        spans: list[tuple[str, Sequence[int]]] = (
            [("BETWEEN ? AND ?", (seqs[0], seqs[-1]))] if dense else
            [(f"IN ({marks(len(chunk))})", chunk) for chunk in (seqs[i : i + _CHUNK]
                                                                for i in range(0, len(seqs), _CHUNK))])
        pairs: list[tuple[int, int]] = []
        arts: list[ArtifactRef] = []
        with self.reading() as reads:
            for where, params in spans:
                pairs.extend((child, pseq) for child, pseq in reads.all(_EDGES + where, params) if child in id_of)
                arts.extend(ArtifactRef(id_of[rseq], name, digest)
                            for rseq, name, digest in reads.all(_ARTIFACTS + where, params) if rseq in id_of)
            parent_of = dict(id_of)
            elsewhere = sorted({pseq for _, pseq in pairs if pseq not in parent_of})
            for i in range(0, len(elsewhere), _CHUNK):
                chunk = elsewhere[i : i + _CHUNK]
                parent_of.update(reads.all(f"{_IDS_OF_SEQS}({marks(len(chunk))})", chunk))
        # a parent seq with no row (deleted) is an edge all the same, to a marker the verifier reports
        edges = [ParentEdge(id_of[child], parent_of.get(pseq) or missing_parent(pseq)) for child, pseq in pairs]
        return edges, arts

    def experiment_rows(self, *, prepared: str, batch: int = 512) -> Generator[RowBatch, None, None]:
        """The rows with this prepared digest (the column, as stored) in append order, a batch at a time with their
        index rows: what Verifier.verify_experiment reads to audit an experiment.

        An experiment whose rows fill most of their seq range (a ledger of one experiment, or of a few run one
        after another) is read as that range of the primary key, other receipts' rows in it left out here: a row
        costs about what reading it does. Otherwise the ids are listed first and their rows read by id."""
        with self.reading() as reads:
            first, last, count = reads.all(EXPERIMENT_SPAN, (prepared,))[0]
        if not count:
            return
        if last - first >= 2 * count:
            ids = self.ids(prepared=prepared)
            for start in range(0, len(ids), batch):
                yield self.raw_rows(ids[start : start + batch])
            return
        yield from self._row_batches(first - 1, last, batch, prepared)

    def all_rows(self, batch: int = 512) -> Generator[RowBatch, None, None]:
        """Every receipt row in append order, a batch at a time with its index rows (``ledger verify --head``
        compares each row's columns, edges and artifact rows with its body)."""
        return self._row_batches(0, None, batch)

    def _row_batches(self, after: int, last: int | None, batch: int, prepared: str | None = None
                     ) -> Generator[RowBatch, None, None]:
        """The rows with seq in (``after``, ``last``] (no upper bound for None) in append order, a batch at a time
        with their index rows; with ``prepared``, only those whose column holds it."""
        while last is None or after < last:
            with self.reading() as reads:  # yielded outside it: a caller that stops early leaves no transaction open
                read = (reads.all(_ROWS_AFTER, (after, batch)) if last is None
                        else reads.all(_ROWS_AFTER_UP_TO, (after, last, batch)))
                if not read:
                    return
                rows = [row for row in map(StoredRow._make, read) if prepared is None or row.prepared == prepared]
                got = RowBatch(rows, *self._index_rows(rows))
            yield got
            after = read[-1][0]

    def iter_rows(self, batch: int = 512) -> Iterator[StoredRow]:
        """Every receipt row in append order, streamed in batches: bounded memory, and small enough (512 rows) to stay
        in the processor's cache while the caller parses them (5,000 cost a scan a third more per row)."""
        last = 0
        while True:
            with self.reading() as reads:  # failures typed there (a generator cannot take the decorator)
                rows = reads.all(_ROWS_AFTER, (last, batch))
            if not rows:
                return
            yield from map(StoredRow._make, rows)
            last = rows[-1][0]
