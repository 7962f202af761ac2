"""The append-only ledger store: SQLAlchemy 2 over SQLite (WAL) by default, any SQLAlchemy URL otherwise.

Writers take the database write lock up front (SQLite ``BEGIN IMMEDIATE``) so several processes appending at once
neither fork chains nor fail with "database is locked"; readers use plain deferred transactions. The library
never updates or deletes a receipt row.

Every database failure leaves a public method as a typed :class:`~ledger.errors.DatabaseError` naming the ledger
(not a SQLAlchemy exception): a file that is not SQLite or is damaged, a read-only ledger asked to append, a full
disk. A failed append has rolled back: every receipt stored before it is still there.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, Select, bindparam, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from ledger.database import (
    check_revision,
    check_sqlite_file,
    display_url,
    driver_cursor,
    is_readonly_url,
    make_engine,
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
    MalformedReceipt,
    MissingParents,
    UnknownReceipt,
)
from ledger.models import (
    SCHEMA_HEAD,
    ArtifactRow,
    LocationRow,
    ParentRow,
    ReceiptLocationRow,
    ReceiptRow,
)
from ledger.note import Signer
from ledger.reads import MATCHES, MIN_PREFIX, ROW_COLUMNS, SELECT_ROWS, Stored, StoredRow, id_range, parsed, pick
from ledger.receipts import Receipt
from ledger.signing import load_private_key

__all__ = ["MIN_PREFIX", "ENV_SIGNING_KEY", "ArtifactRef", "ParentEdge", "Store", "Stored", "StoredRow"]

# A key file whose key signs every receipt a Store opened without an explicit signer appends: set by the main job so
# that rank processes it launches sign too (docs/transparency.md). Empty counts as unset.
ENV_SIGNING_KEY = "LEDGER_SIGNING_KEY"
_CHUNK = 500  # bound on bound parameters per IN (...) query

# The append path's statements, built once: building a SQLAlchemy statement per call costs more than running it.
_SEQS_BY_ID = select(ReceiptRow.id, ReceiptRow.seq, ReceiptRow.recorded_ns).where(
    ReceiptRow.id.in_(bindparam("ids", expanding=True))
)
_BODIES_BY_ID = select(ReceiptRow.id, ReceiptRow.seq, ReceiptRow.recorded_ns, ReceiptRow.body).where(
    ReceiptRow.id.in_(bindparam("ids", expanding=True))
)
_INSERT_RECEIPTS = insert(ReceiptRow)
# Off SQLite (PostgreSQL) a batch learns its seqs from the insert itself (RETURNING), not from a second query.
_INSERT_RECEIPTS_RETURNING = insert(ReceiptRow).returning(ReceiptRow.id, ReceiptRow.seq)
_INSERT_PARENTS = insert(ParentRow)
_INSERT_ARTIFACTS = insert(ArtifactRow)


# A receipt row's columns in StoredRow's order: the verifier and the scans read rows as plain tuples, not ORM
# instances (9.8 µs per row through a session against 2.3 µs: benchmarks/README.md, audit_bench).
_ROW_COLUMNS = tuple(getattr(ReceiptRow, name) for name in ROW_COLUMNS)  # StoredRow's fields, in order
_ROWS = select(*_ROW_COLUMNS)
_ROWS_BY_ID = _ROWS.where(ReceiptRow.id.in_(bindparam("ids", expanding=True)))
_ROWS_AFTER = _ROWS.where(ReceiptRow.seq > bindparam("last")).order_by(ReceiptRow.seq).limit(bindparam("batch"))
_ROW_BY_ID = _ROWS.where(ReceiptRow.id == bindparam("rid"))
_LOCATIONS = (select(LocationRow.digest, LocationRow.uri)
              .where(LocationRow.digest.in_(bindparam("digests", expanding=True)))
              .order_by(LocationRow.digest, LocationRow.recorded_ns))
_RECEIPT_LOCATIONS = (select(ReceiptRow.id, ReceiptLocationRow.name, ReceiptLocationRow.uri)
                      .join(ReceiptRow, ReceiptRow.seq == ReceiptLocationRow.receipt_seq)
                      .where(ReceiptRow.id.in_(bindparam("ids", expanding=True)))
                      .order_by(ReceiptRow.id, ReceiptLocationRow.name, ReceiptLocationRow.uri))


def _closure_stmt(up: bool) -> Select:
    """Receipt rows reachable from the one with id ``:rid`` over parent edges (up) or child edges (down)."""
    start = select(ReceiptRow.seq.label("seq")).where(ReceiptRow.id == bindparam("rid")).cte("closure", recursive=True)
    if up:
        step = select(ParentRow.parent_seq).join(start, ParentRow.child_seq == start.c.seq)
    else:  # walks ix_receipt_parents_parent_seq
        step = select(ParentRow.child_seq).join(start, ParentRow.parent_seq == start.c.seq)
    closure = start.union(step)
    return _ROWS.join(closure, ReceiptRow.seq == closure.c.seq).order_by(ReceiptRow.seq)


_ANCESTORS = _closure_stmt(up=True)
_DESCENDANTS = _closure_stmt(up=False)
# The verifier's index rows. The parent's id comes from a join (an outer one: a deleted parent row must show up).
_EDGES_BY_CHILD = (
    select(ParentRow.child_seq, ParentRow.parent_seq, ReceiptRow.id)
    .outerjoin(ReceiptRow, ReceiptRow.seq == ParentRow.parent_seq)
    .where(ParentRow.child_seq.in_(bindparam("seqs", expanding=True)))
)
_ARTIFACTS_BY_RECEIPT = select(ArtifactRow.receipt_seq, ArtifactRow.name, ArtifactRow.digest).where(
    ArtifactRow.receipt_seq.in_(bindparam("seqs", expanding=True))
)
# The same for a range of seqs (lo..hi): one range of each table's primary key.
_EDGES_IN_SPAN = (
    select(ParentRow.child_seq, ParentRow.parent_seq, ReceiptRow.id)
    .outerjoin(ReceiptRow, ReceiptRow.seq == ParentRow.parent_seq)
    .where(ParentRow.child_seq.between(bindparam("lo"), bindparam("hi")))
)
_ARTIFACTS_IN_SPAN = select(ArtifactRow.receipt_seq, ArtifactRow.name, ArtifactRow.digest).where(
    ArtifactRow.receipt_seq.between(bindparam("lo"), bindparam("hi"))
)


# The columns _insert fills, in the order of its tuples (seq is assigned by the database or by _insert).
_RECEIPT_COLUMNS = ("id", "kind", "run", "rank", "step", "prepared", "selection", "body", "recorded_ns")
_PARENT_COLUMNS = ("child_seq", "parent_seq")
_ARTIFACT_COLUMNS = ("receipt_seq", "name", "digest")


def _sqlite_insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_SQLITE_TOP_SEQ = f"SELECT coalesce(max(seq), 0) FROM {ReceiptRow.__tablename__}"
_SQLITE_INSERT_RECEIPTS = _sqlite_insert(ReceiptRow.__tablename__, ("seq", *_RECEIPT_COLUMNS))
_SQLITE_INSERT_PARENTS = _sqlite_insert(ParentRow.__tablename__, _PARENT_COLUMNS)
_SQLITE_INSERT_ARTIFACTS = _sqlite_insert(ArtifactRow.__tablename__, _ARTIFACT_COLUMNS)


def _insert(conn: Connection, new: list[Receipt], now: int, seq_of: dict[str, int]) -> dict[str, int]:
    """Insert new receipts (parents before children) and their edge and artifact rows; returns ``id -> seq``.

    ``seq_of`` maps every stored parent of ``new`` to its seq (the new seqs are added to it). Edge and artifact
    rows are keyed by seq (ledger/models.py), so the new receipts' seqs must be known before those rows are written.

    On SQLite the rows go in as plain tuples through the driver's executemany (SQLAlchemy's per-row parameter
    handling cost more than SQLite's own work, benchmarks/README.md), and the seqs are assigned here: the writer
    holds the write lock from its first statement (BEGIN IMMEDIATE), so max(seq) cannot move under it. Were the
    lock ever missing, a clash would be an IntegrityError or a busy snapshot, both retried by append_many.
    Elsewhere (PostgreSQL) the database's sequence assigns them and the insert returns them.
    """
    sqlite = conn.dialect.name == "sqlite"
    if sqlite:
        top = conn.exec_driver_sql(_SQLITE_TOP_SEQ).scalar_one()
        rows = [(top + i, r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body, now)
                for i, r in enumerate(new, start=1)]
        conn.exec_driver_sql(_SQLITE_INSERT_RECEIPTS, rows)
        new_seqs = {row[1]: row[0] for row in rows}
    else:
        values = [dict(zip(_RECEIPT_COLUMNS, (r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body,
                                              now), strict=True)) for r in new]
        if len(values) == 1:  # the common single append: its seq comes back with the insert
            key = conn.execute(_INSERT_RECEIPTS, values[0]).inserted_primary_key
            assert key is not None  # SQLAlchemy reports the key of a single-row insert on every backend
            new_seqs = {new[0].id: key[0]}
        else:
            new_seqs = {rid: seq for rid, seq in conn.execute(_INSERT_RECEIPTS_RETURNING, values)}
    seq_of.update(new_seqs)
    edges = [(new_seqs[r.id], seq_of[p]) for r in new for p in r.parents]
    arts = [(new_seqs[r.id], name, digest) for r in new for name, digest in r.artifacts.items()]
    for sql, stmt, columns, index_rows in (
        (_SQLITE_INSERT_PARENTS, _INSERT_PARENTS, _PARENT_COLUMNS, edges),
        (_SQLITE_INSERT_ARTIFACTS, _INSERT_ARTIFACTS, _ARTIFACT_COLUMNS, arts),
    ):
        if not index_rows:
            continue
        if sqlite:
            conn.exec_driver_sql(sql, index_rows)
        else:
            conn.execute(stmt, [dict(zip(columns, row, strict=True)) for row in index_rows])
    return new_seqs


@functools.cache
def _sqlite_rows_by_id(n: int) -> str:
    """_ROWS_BY_ID for ``n`` ids as SQLite's own SQL (the same columns, ledger/reads.py's)."""
    return f"{SELECT_ROWS} WHERE id IN ({', '.join('?' * n)})"


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


class _Unsure(Exception):
    """An optimistic append (Store.append_many) met something only a careful one can decide; rolls it back."""


def _parsed_body(rid: str, body: bytes) -> Receipt:
    try:
        return Receipt.from_bytes(body)
    except InputError as exc:
        raise MalformedReceipt(f"stored body does not parse: {exc.one_line()}", rid) from exc


def database_error(url: str, exc: DBAPIError) -> DatabaseError:
    """One line for a database failure, naming the ledger and, where SQLite says it, what is wrong with it."""
    where = display_url(url)
    detail = " ".join(str(exc.orig if exc.orig is not None else exc).split("\n")[0].split())
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


P = ParamSpec("P")
T = TypeVar("T")


def _typed_errors(method: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    """Raise a database failure inside ``method`` as a DatabaseError (see :func:`database_error`)."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        except DBAPIError as exc:
            raise database_error(self.url, exc) from exc

    return wrapper


class Store:
    """An open ledger. Create with :meth:`open`; safe to use from one thread; one per process."""

    def __init__(self, engine: Engine, url: str, *, readonly: str | None = None, signer: Signer | None = None
                 ) -> None:
        self.engine = engine
        self.url = url
        self.readonly = readonly  # why this store cannot write (None: it can)
        # Signs every receipt appended without a signer of its own (None: such receipts are stored unsigned).
        self.signer = signer
        self._writer = engine.execution_options(ledger_write=True)
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
            signer = load_private_key(os.environ[ENV_SIGNING_KEY])
        url = resolve_url(db)
        connect, readonly = url, None
        path = sqlite_path(url)
        if path is not None and (path.exists() or not create):
            check_sqlite_file(path)
            readonly = "the URL asks for mode=ro" if is_readonly_url(url) else unwritable(path)
            if readonly is not None:
                connect = readonly_url(path)
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

    @property
    def directory(self) -> Path | None:
        """The directory of an SQLite ledger file (relative locations resolve against it); None otherwise."""
        return self._directory

    def _check_writable(self) -> None:
        if self.readonly is not None:
            raise DatabaseError(f"cannot write to {display_url(self.url)}: opened read-only ({self.readonly})")

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction holding the write lock from its first statement (BEGIN IMMEDIATE on SQLite)."""
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
        for i in range(0, len(listed), _CHUNK):
            chunk = {"ids": listed[i : i + _CHUNK]}
            if with_body:
                out.update((rid, (seq, ns, body)) for rid, seq, ns, body in conn.execute(_BODIES_BY_ID, chunk))
            else:
                out.update((rid, (seq, ns, b"")) for rid, seq, ns in conn.execute(_SEQS_BY_ID, chunk))
        return out

    @staticmethod
    def _rows_by_id(conn: Connection, ids: set[str]) -> list[StoredRow]:
        out: list[StoredRow] = []
        listed = sorted(ids)
        if conn.dialect.name == "sqlite":  # the driver's cursor: SQLAlchemy's expanding IN and rows cost SQLite's twice
            with driver_cursor(conn, "read receipt rows by id") as cur:
                for i in range(0, len(listed), _CHUNK):
                    chunk = listed[i : i + _CHUNK]
                    out.extend(map(StoredRow._make, cur.execute(_sqlite_rows_by_id(len(chunk)), chunk).fetchall()))
            return out
        for i in range(0, len(listed), _CHUNK):
            out.extend(map(StoredRow._make, conn.execute(_ROWS_BY_ID, {"ids": listed[i : i + _CHUNK]}).all()))
        return out

    @_typed_errors
    def add_location(self, digest: str, uri: str) -> None:
        """Record where an artifact's bytes can be found (idempotent). A relative path is kept as given and read
        relative to the ledger's directory (see :meth:`locations`)."""
        self._check_writable()
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
        with self.engine.connect() as conn:
            for i in range(0, len(listed), _CHUNK):
                for digest, uri in conn.execute(_LOCATIONS, {"digests": listed[i : i + _CHUNK]}).all():
                    out[digest].append(self._resolved(uri))
        return out

    def _resolved(self, uri: str) -> str:
        """A recorded location with a relative path made relative to the ledger's directory."""
        base = self.directory
        if base is None or not uri or "://" in uri or os.path.isabs(uri):
            return uri
        return str(base / uri)

    @_typed_errors
    def add_receipt_locations(self, rid: str, places: Mapping[str, str]) -> None:
        """Record where receipt ``rid`` says the bytes of its artifacts are (artifact name -> location), in one
        transaction (idempotent); the receipt must be stored. Each place is recorded under the digest too, so
        lookups by digest find it."""
        with self._write() as session:
            row = session.execute(select(ReceiptRow.seq, ReceiptRow.body).where(ReceiptRow.id == rid)).first()
            if row is None:
                raise UnknownReceipt(rid)
            seq, body = row
            receipt = Receipt.from_bytes(bytes(body))
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
        with self.engine.connect() as conn:
            stmt = (select(ReceiptRow.id, ReceiptRow.seq)
                    .join(ReceiptLocationRow, ReceiptRow.seq == ReceiptLocationRow.receipt_seq)
                    .where(ReceiptLocationRow.uri == uri).order_by(ReceiptRow.seq).distinct())
            return [rid for rid, _ in conn.execute(stmt)]

    def receipt_locations(self, rid: str) -> dict[str, list[str]]:
        """Where receipt ``rid`` says its artifacts' bytes are: artifact name -> locations (empty if none); relative
        paths resolved as in :meth:`locations`."""
        return self.receipt_locations_of([rid])[rid]

    @_typed_errors
    def receipt_locations_of(self, rids: Iterable[str]) -> dict[str, dict[str, list[str]]]:
        """:meth:`receipt_locations` of each receipt, in a query per 500 receipts."""
        out: dict[str, dict[str, list[str]]] = {rid: {} for rid in rids}
        listed = sorted(out)
        with self.engine.connect() as conn:
            for i in range(0, len(listed), _CHUNK):
                for rid, name, uri in conn.execute(_RECEIPT_LOCATIONS, {"ids": listed[i : i + _CHUNK]}).all():
                    out[rid].setdefault(name, []).append(self._resolved(uri))
        return out

    # -------------------------------------------------------------------------------------------- reads

    @_typed_errors
    def resolve(self, ref: str) -> str:
        """Turn a full id or a unique hex prefix (at least 4 digits) into a full id (ledger/reads.py's rules)."""
        lo, hi = id_range(ref)
        with self.engine.connect() as conn:
            stmt = select(ReceiptRow.id).where(ReceiptRow.id >= lo, ReceiptRow.id < hi).limit(MATCHES)
            return pick(ref, conn.scalars(stmt))

    @_typed_errors
    def ids(self, *, prepared: str) -> list[str]:
        """The stored ids of every receipt with this prepared digest, in append order (the rows' ids, whatever
        their bodies say: the verifier recomputes each)."""
        with self.engine.connect() as conn:
            stmt = select(ReceiptRow.id).where(ReceiptRow.prepared == prepared).order_by(ReceiptRow.seq)
            return list(conn.scalars(stmt))

    def latest_prepared(self, prepared: str | None = None) -> str:
        """``prepared`` if a prepare receipt has that digest, else the latest prepare receipt's digest."""
        found = self.find(kind="prepare", prepared=prepared)
        if not found or found[-1].receipt.prepared is None:
            raise InputError("no prepare receipt in the ledger: run `ledger run prepare` first" if prepared is None
                             else f"no prepare receipt with prepared digest {prepared}")
        return found[-1].receipt.prepared

    @_typed_errors
    def get(self, ref: str) -> Stored:
        """The receipt with this id or unique prefix."""
        rid = self.resolve(ref)
        with self.engine.connect() as conn:
            return parsed(StoredRow._make(conn.execute(_ROW_BY_ID, {"rid": rid}).one()))

    @_typed_errors
    def contains(self, rid: str) -> bool:
        with self.engine.connect() as conn:
            return conn.scalar(select(ReceiptRow.seq).where(ReceiptRow.id == rid)) is not None

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
        """Receipts matching every given field, in append order."""
        stmt = _ROWS.order_by(ReceiptRow.seq)
        for column, value in (
            (ReceiptRow.kind, kind),
            (ReceiptRow.run, run),
            (ReceiptRow.prepared, prepared),
            (ReceiptRow.selection, selection),
            (ReceiptRow.rank, rank),
            (ReceiptRow.step, step),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.engine.connect() as conn:
            return [parsed(StoredRow._make(row)) for row in conn.execute(stmt).all()]

    @_typed_errors
    def count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM receipts")) or 0)

    def _closure(self, rid: str, up: bool) -> list[StoredRow]:
        """Ancestors (up) or descendants of ``rid``, itself included, in one recursive query over seqs."""
        with self.engine.connect() as conn:
            return list(map(StoredRow._make, conn.execute(_ANCESTORS if up else _DESCENDANTS, {"rid": rid}).all()))

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
        rows = self._closure(rid, True)
        return (rows, *self._index_rows(rows))

    @_typed_errors
    def raw_rows(self, ids: Iterable[str]) -> tuple[list[StoredRow], list[ParentEdge], list[ArtifactRef]]:
        """The rows of these receipts (those stored) and their index rows, exactly as stored."""
        with self.engine.connect() as conn:
            rows = self._rows_by_id(conn, set(ids))
        return (rows, *self._index_rows(rows))

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
        spans = ([{"lo": seqs[0], "hi": seqs[-1]}] if dense
                 else [{"seqs": seqs[i : i + _CHUNK]} for i in range(0, len(seqs), _CHUNK)])
        edges_stmt, arts_stmt = (_EDGES_IN_SPAN, _ARTIFACTS_IN_SPAN) if dense else (_EDGES_BY_CHILD,
                                                                                     _ARTIFACTS_BY_RECEIPT)
        edges: list[ParentEdge] = []
        arts: list[ArtifactRef] = []
        with self.engine.connect() as conn:
            for span in spans:
                edges.extend(ParentEdge(id_of[child], parent if parent is not None else missing_parent(pseq))
                             for child, pseq, parent in conn.execute(edges_stmt, span).all() if child in id_of)
                arts.extend(ArtifactRef(id_of[rseq], name, digest)
                            for rseq, name, digest in conn.execute(arts_stmt, span).all() if rseq in id_of)
        return edges, arts

    def iter_rows(self, batch: int = 5000) -> Iterator[StoredRow]:
        """Every receipt row in append order, streamed in batches (bounded memory)."""
        last = 0
        while True:
            try:  # a generator: the decorator would return before the first query runs
                with self.engine.connect() as conn:
                    rows = list(map(StoredRow._make, conn.execute(_ROWS_AFTER, {"last": last, "batch": batch}).all()))
            except DBAPIError as exc:
                raise database_error(self.url, exc) from exc
            if not rows:
                return
            yield from rows
            last = rows[-1].seq
