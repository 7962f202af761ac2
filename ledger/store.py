"""The append-only ledger store: SQLAlchemy 2 over SQLite (WAL) by default, any SQLAlchemy URL otherwise.

Writers take the database write lock up front (SQLite ``BEGIN IMMEDIATE``) so several processes appending at once
neither fork chains nor fail with "database is locked"; readers use plain deferred transactions. The library
never updates or deletes a receipt row.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, bindparam, create_engine, event, insert, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from ledger import chain
from ledger.errors import (
    AmbiguousReceipt,
    DatabaseError,
    InputError,
    MalformedDigest,
    MissingParents,
    SchemaOutOfDate,
    UnknownReceipt,
    UnknownSchema,
)
from ledger.models import KNOWN_REVISIONS, SCHEMA_HEAD, ArtifactRow, LocationRow, ParentRow, ReceiptRow
from ledger.receipts import Receipt

DEFAULT_DB = "ledger.db"
ENV_DB = "LEDGER_DB"
BUSY_TIMEOUT_S = 120.0
MIN_PREFIX = 4
_HEX_RE = re.compile(r"^[0-9a-f]+$")
_CHUNK = 500  # bound on bound parameters per IN (...) query

# The append path's statements, built once: building a SQLAlchemy statement per call costs more than running it.
_SEQS_BY_ID = select(ReceiptRow.id, ReceiptRow.seq, ReceiptRow.recorded_ns).where(
    ReceiptRow.id.in_(bindparam("ids", expanding=True))
)
_BODIES_BY_ID = select(ReceiptRow.id, ReceiptRow.seq, ReceiptRow.recorded_ns, ReceiptRow.body).where(
    ReceiptRow.id.in_(bindparam("ids", expanding=True))
)
_INSERT_RECEIPTS = insert(ReceiptRow)
_INSERT_PARENTS = insert(ParentRow)
_INSERT_ARTIFACTS = insert(ArtifactRow)


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


class ParentEdge(NamedTuple):
    """A ``receipt_parents`` row as stored: ``child`` cites ``parent``."""

    child: str
    parent: str


class ArtifactRef(NamedTuple):
    """A ``receipt_artifacts`` row as stored."""

    receipt: str
    name: str
    digest: str


@dataclass(frozen=True)
class Stored:
    """A receipt as stored: the domain object plus its row metadata."""

    receipt: Receipt
    seq: int
    recorded_ns: int


class Store:
    """An open ledger. Create with :meth:`open`; safe to use from one thread; one per process."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self._writer = engine.execution_options(ledger_write=True)

    # --------------------------------------------------------------------------------------------- open

    @classmethod
    def open(cls, db: str | os.PathLike[str] | None = None, *, create: bool = False) -> Store:
        """Open a ledger, checking its schema revision. ``create`` initialises an empty database."""
        url = resolve_url(db)
        if url.startswith("sqlite:///") and not create:
            path = Path(url.removeprefix("sqlite:///"))
            if not path.exists():
                raise DatabaseError(f"no ledger at {path}: run `ledger init` (or pass --db / set {ENV_DB})")
        engine = make_engine(url)
        try:
            current = schema_revision(engine)
        except OperationalError as exc:
            raise DatabaseError(f"cannot open {display_url(url)}: {exc.orig}") from exc
        if current is None and create:
            from ledger.migrate import upgrade  # alembic only when a schema must be created

            upgrade(url)
            current = schema_revision(engine)
        if current != SCHEMA_HEAD:
            if current is None or current in KNOWN_REVISIONS:
                raise SchemaOutOfDate(display_url(url), current, SCHEMA_HEAD)
            raise UnknownSchema(display_url(url), current, SCHEMA_HEAD)
        return cls(engine, url)

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

    def append(self, receipt: Receipt, *, check: bool = True) -> Stored:
        """Append one receipt in its own transaction. Appending an existing id returns the stored one."""
        return self.append_many([receipt], check=check)[0]

    def append_many(self, receipts: Sequence[Receipt], *, check: bool = True) -> list[Stored]:
        """Append receipts atomically (all or none). Parents must be stored already or come earlier here.

        With ``check`` the chain rules run against the parents before anything is written.
        """
        for attempt in range(8):
            try:
                return self._append_many(receipts, check)
            except IntegrityError:
                # Another writer stored one of these ids between our read and insert (only possible on
                # databases without BEGIN IMMEDIATE); retry: the existing rows make it a no-op.
                if attempt == 7:
                    raise
            except OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _append_many(self, receipts: Sequence[Receipt], check: bool) -> list[Stored]:
        # Core statements on one connection, not ORM objects: the append path is the ledger's hot loop, and ORM
        # unit-of-work and row instances cost more than the SQL itself (benchmarks/README.md).
        now = time.time_ns()
        with self._writer.begin() as conn:
            given = {r.id: r for r in receipts}
            # One query finds which given receipts are stored already and fetches the stored parents (their
            # bodies only when the chain rules will read them).
            found = self._lookup(conn, given.keys() | {p for r in receipts for p in r.parents}, with_body=check)
            stored = {rid: (seq, ns) for rid, (seq, ns, _) in found.items() if rid in given}
            outside_bodies = {rid: body for rid, (_, _, body) in found.items() if rid not in given}
            parsed: dict[str, Receipt] = {}  # each stored parent parsed once, however many receipts cite it
            batch: dict[str, Receipt] = {}
            new_rows: list[dict[str, Any]] = []
            edges: list[dict[str, str]] = []
            arts: list[dict[str, str]] = []
            for r in receipts:
                if r.id in stored or r.id in batch:
                    continue
                parents: dict[str, Receipt] = {}
                missing: list[str] = []
                for p in r.parents:
                    if p in batch or p in stored:  # earlier in this call, or given here and already stored
                        parents[p] = given[p]
                    elif p in outside_bodies:
                        if check:
                            if p not in parsed:
                                parsed[p] = Receipt.from_bytes(outside_bodies[p])
                            parents[p] = parsed[p]
                    else:  # absent, or given later in this call: a parent must come first
                        missing.append(p)
                if missing:
                    raise MissingParents(r.id, sorted(missing))
                if check:
                    chain.check_receipt(r, parents)
                batch[r.id] = r
                new_rows.append(
                    {
                        "id": r.id,
                        "kind": r.kind,
                        "run": r.run,
                        "rank": r.rank,
                        "step": r.step,
                        "prepared": r.prepared,
                        "selection": r.selection,
                        "body": r.body,
                        "recorded_ns": now,
                    }
                )
                edges.extend({"child": r.id, "parent": p} for p in r.parents)
                arts.extend({"receipt": r.id, "name": k, "digest": v} for k, v in r.artifacts.items())
            if len(new_rows) == 1:  # the common single append: its seq comes back with the insert
                key = conn.execute(_INSERT_RECEIPTS, new_rows[0]).inserted_primary_key
                assert key is not None  # SQLAlchemy reports the key of a single-row insert on every backend
                stored[new_rows[0]["id"]] = (key[0], now)
            elif new_rows:
                conn.execute(_INSERT_RECEIPTS, new_rows)
            if edges:
                conn.execute(_INSERT_PARENTS, edges)
            if arts:
                conn.execute(_INSERT_ARTIFACTS, arts)
            if len(new_rows) > 1:
                stored.update(self._seqs(conn, batch))
            return [Stored(r, *stored[r.id]) for r in receipts]

    @staticmethod
    def _seqs(conn: Connection, ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """``id -> (seq, recorded_ns)`` for those of ``ids`` that are stored."""
        out: dict[str, tuple[int, int]] = {}
        listed = sorted(ids)
        for i in range(0, len(listed), _CHUNK):
            rows = conn.execute(_SEQS_BY_ID, {"ids": listed[i : i + _CHUNK]})
            out.update((rid, (seq, ns)) for rid, seq, ns in rows)
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
    def _rows_by_id(session: Session, ids: set[str]) -> dict[str, ReceiptRow]:
        out: dict[str, ReceiptRow] = {}
        listed = sorted(ids)
        for i in range(0, len(listed), _CHUNK):
            chunk = listed[i : i + _CHUNK]
            for row in session.scalars(select(ReceiptRow).where(ReceiptRow.id.in_(chunk))):
                out[row.id] = row
        return out

    def add_location(self, digest: str, uri: str) -> None:
        """Record where an artifact's bytes can be found (idempotent)."""
        with self._write() as session:
            have = session.get(LocationRow, (digest, uri))
            if have is None:
                session.add(LocationRow(digest=digest, uri=uri, recorded_ns=time.time_ns()))

    def locations(self, digest: str) -> list[str]:
        with Session(self.engine) as session:
            stmt = select(LocationRow.uri).where(LocationRow.digest == digest).order_by(LocationRow.recorded_ns)
            return list(session.scalars(stmt))

    # -------------------------------------------------------------------------------------------- reads

    def resolve(self, ref: str) -> str:
        """Turn a full id or a unique hex prefix (at least 4 digits) into a full id."""
        ref = ref.strip()
        if ref.startswith("blake3:"):
            hexpart = ref.removeprefix("blake3:")
            if len(hexpart) != 64 or not _HEX_RE.fullmatch(hexpart):
                raise MalformedDigest("receipt id", ref)
        else:
            hexpart = ref.lower()
            if not _HEX_RE.fullmatch(hexpart) or len(hexpart) > 64:
                raise InputError(f"receipt reference {ref!r} is neither blake3:<64 hex> nor a hex prefix")
            if len(hexpart) < MIN_PREFIX:
                raise InputError(f"receipt prefix {ref!r} is too short: give at least {MIN_PREFIX} hex digits")
        lo = "blake3:" + hexpart
        with Session(self.engine) as session:
            stmt = select(ReceiptRow.id).where(ReceiptRow.id >= lo, ReceiptRow.id < lo + "g").limit(16)
            found = list(session.scalars(stmt))
        if not found:
            raise UnknownReceipt(ref)
        if len(found) > 1:
            raise AmbiguousReceipt(ref, found)
        return found[0]

    def get(self, ref: str) -> Stored:
        """The receipt with this id or unique prefix."""
        rid = self.resolve(ref)
        with Session(self.engine) as session:
            row = session.scalars(select(ReceiptRow).where(ReceiptRow.id == rid)).one()
            return Stored(row.to_receipt(), row.seq, row.recorded_ns)

    def contains(self, rid: str) -> bool:
        with Session(self.engine) as session:
            return session.scalar(select(ReceiptRow.seq).where(ReceiptRow.id == rid)) is not None

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
        stmt = select(ReceiptRow).order_by(ReceiptRow.seq)
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
        with Session(self.engine) as session:
            return [Stored(row.to_receipt(), row.seq, row.recorded_ns) for row in session.scalars(stmt)]

    def count(self) -> int:
        with Session(self.engine) as session:
            return int(session.scalar(text("SELECT count(*) FROM receipts")) or 0)

    def _closure(self, rid: str, up: bool) -> list[ReceiptRow]:
        """Ancestors (up) or descendants of ``rid``, itself included, in one recursive query."""
        start = select(ReceiptRow.id.label("rid")).where(ReceiptRow.id == rid).cte("closure", recursive=True)
        if up:
            step = select(ParentRow.parent).join(start, ParentRow.child == start.c.rid)
        else:
            step = select(ParentRow.child).join(start, ParentRow.parent == start.c.rid)
        closure = start.union(step)
        stmt = select(ReceiptRow).join(closure, ReceiptRow.id == closure.c.rid).order_by(ReceiptRow.seq)
        with Session(self.engine) as session:
            rows = list(session.scalars(stmt))
            session.expunge_all()
            return rows

    def ancestors(self, ref: str) -> list[Stored]:
        """The receipt and all its ancestors, in append order (one recursive query)."""
        return [Stored(r.to_receipt(), r.seq, r.recorded_ns) for r in self._closure(self.resolve(ref), True)]

    def descendants(self, ref: str) -> list[Stored]:
        """The receipt and everything that cites it, directly or not, in append order."""
        return [Stored(r.to_receipt(), r.seq, r.recorded_ns) for r in self._closure(self.resolve(ref), False)]

    # ----------------------------------------------------------------------------- raw rows for verify

    def raw_closure(self, rid: str) -> tuple[list[ReceiptRow], list[ParentEdge], list[ArtifactRef]]:
        """Rows of a receipt's ancestry exactly as stored (nothing parsed), for the verifier to re-check."""
        rows = self._closure(rid, True)
        return (rows, *self._index_rows([r.id for r in rows]))

    def raw_rows(self, ids: Iterable[str]) -> tuple[list[ReceiptRow], list[ParentEdge], list[ArtifactRef]]:
        ids = sorted(set(ids))
        with Session(self.engine) as session:
            rows = list(self._rows_by_id(session, set(ids)).values())
            session.expunge_all()
        return (rows, *self._index_rows(ids))

    def _index_rows(self, ids: list[str]) -> tuple[list[ParentEdge], list[ArtifactRef]]:
        # Plain column tuples, not ORM instances: a 1,000-deep verify reads thousands of these (benchmarks/README.md)
        edges: list[ParentEdge] = []
        arts: list[ArtifactRef] = []
        with self.engine.connect() as conn:
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                stmt = select(ParentRow.child, ParentRow.parent).where(ParentRow.child.in_(chunk))
                edges.extend(ParentEdge(*row) for row in conn.execute(stmt))
                stmt_a = select(ArtifactRow.receipt, ArtifactRow.name, ArtifactRow.digest).where(
                    ArtifactRow.receipt.in_(chunk)
                )
                arts.extend(ArtifactRef(*row) for row in conn.execute(stmt_a))
        return edges, arts

    def iter_rows(self, batch: int = 5000) -> Iterator[ReceiptRow]:
        """Every receipt row in append order, streamed in batches (bounded memory)."""
        last = 0
        while True:
            with Session(self.engine) as session:
                stmt = select(ReceiptRow).where(ReceiptRow.seq > last).order_by(ReceiptRow.seq).limit(batch)
                rows = list(session.scalars(stmt))
                session.expunge_all()
            if not rows:
                return
            yield from rows
            last = rows[-1].seq
