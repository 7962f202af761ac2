"""How the ledger is read: a stored receipt as a row, the rules for naming one (a full id or a unique hex prefix),
and :class:`Reads`, the one way every reader (the store, the transparency log, the verifier) runs its SQL.

Reads are plain SQL with ``?`` placeholders, run through the database driver: on an SQLite ledger file the standard
library's ``sqlite3`` (:class:`SqliteReads`), elsewhere the driver under a SQLAlchemy connection
(:class:`DriverReads`, PostgreSQL's ``%s`` placeholders made here). So a command that only reads an SQLite ledger
(`ledger show`, `ledger verify`) never imports SQLAlchemy: importing it costs 0.15 s, more than the rest of such a
command (benchmarks/README.md, audit_bench). Writes go through SQLAlchemy (ledger/store.py).
"""

from __future__ import annotations

import functools
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from ledger.database import (
    BUSY_TIMEOUT_S,
    failure,
)
from ledger.errors import AmbiguousReceipt, InputError, StoredBodyInvalid, UnknownReceipt, quoted
from ledger.receipts import Receipt

if TYPE_CHECKING:
    from sqlalchemy import Connection

MIN_PREFIX: Final = 4
_UNDECODABLE: Final = re.compile(r"Could not decode to UTF-8 column '(\w+)'")
_HEX_RE: Final = re.compile(r"^[0-9a-f]+$")
# A receipts row's columns, in StoredRow's order (the store selects the same, tests/ledger/test_reads.py checks).
ROW_COLUMNS: Final = ("seq", "id", "kind", "run", "rank", "step", "prepared", "selection", "body", "recorded_ns")
MATCHES: Final = 16  # ids fetched for a prefix: enough to say it is ambiguous and name some
SELECT_ROWS: Final = f"SELECT {', '.join(ROW_COLUMNS)} FROM receipts"  # as SQL, for reads through the driver


class StoredRow(NamedTuple):
    """A ``receipts`` row exactly as stored, nothing parsed: what the verifier re-checks (every column but the body
    is an index derived from it, ledger/models.py)."""

    seq: int
    id: str
    kind: str
    run: str | None
    rank: int | None
    step: int | None
    prepared: str | None
    selection: str | None
    body: bytes  # str when the sqlite3 shell rewrote the BLOB as TEXT: the verifier hashes whatever is there
    recorded_ns: int

    def body_bytes(self) -> bytes:
        """The body as the bytes it holds (see :func:`stored_bytes`)."""
        return stored_bytes(self.body)

    def to_receipt(self) -> Receipt:
        return Receipt.from_bytes(self.body_bytes())


def stored_bytes(value: object) -> bytes:
    """The bytes of a stored BLOB (a body, a signature, a hash) as the driver returns it: bytes as they are, a
    memoryview or bytearray copied, anything else as its text's UTF-8. SQLite stores whatever a writer gives it:
    ``replace()`` on a BLOB stores TEXT, an UPDATE can store an integer; a tampered row must be verified (and fail
    there), never crash the reader or allocate what an integer names. Every reader of such a column goes through
    here."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return str(value).encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Stored:
    """A receipt as stored: the domain object plus its row metadata.

    ``new`` is set by :meth:`Store.append_many` on the receipts that call itself stored (at a receipt's first
    occurrence in the call), so a caller counts its own appends however many writers run at once.
    """

    receipt: Receipt
    seq: int
    recorded_ns: int
    new: bool = False


def parsed(row: StoredRow) -> Stored:
    """A stored row as a receipt; a body that does not parse is an error naming the receipt (ledger corruption,
    or a body written by software that did not enforce the limits of receipts.md)."""
    try:
        receipt = row.to_receipt()
    except InputError as exc:
        raise StoredBodyInvalid(row.id, exc.one_line()) from exc
    return Stored(receipt, row.seq, row.recorded_ns)


def id_range(ref: str) -> tuple[str, str]:
    """The ids a reference may name, ``[lo, hi)``: every id whose hex part starts with the reference's, at least
    MIN_PREFIX digits and at most 64 (64: one full id), written bare (``61abc5``, any case) or after ``blake3:`` (in
    lowercase, as ids are printed: ``ledger log`` and the error messages show ``blake3:`` and a prefix, and what the
    tool prints it takes back); anything else is refused here, before a query. Surrounding blanks are ignored."""
    ref = ref.strip()
    full = ref.startswith("blake3:")
    hexpart = ref.removeprefix("blake3:") if full else ref.lower()
    if not _HEX_RE.fullmatch(hexpart) or len(hexpart) > 64:
        raise InputError(f"receipt reference {quoted(ref)} is neither an id nor a prefix of one: give blake3:<hex> (in "
                         f"lowercase) or <hex>, {MIN_PREFIX} to 64 digits")
    if len(hexpart) < MIN_PREFIX:
        raise InputError(f"receipt prefix {ref!r} is too short: give at least {MIN_PREFIX} hex digits")
    lo = "blake3:" + hexpart
    return lo, lo + "g"  # "g" sorts after every hex digit


def pick(ref: str, found: Iterable[str]) -> str:
    """The one id a reference names among the (at most MATCHES) ids of its range."""
    ids = list(found)
    if not ids:
        raise UnknownReceipt(ref)
    if len(ids) > 1:
        raise AmbiguousReceipt(ref, ids)
    return ids[0]


# ------------------------------------------------------------------------------------------------ running SQL


class Reads(Protocol):
    """Runs one read statement: SQL with ``?`` placeholders, its parameters in order, every row as a tuple. Raises
    :class:`~ledger.errors.DatabaseError` (SqliteReads) or SQLAlchemy's DBAPIError (DriverReads, which the store's
    methods turn into DatabaseError)."""

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...


@functools.cache
def marks(n: int) -> str:
    """``n`` placeholders for an ``IN (...)`` list."""
    return ", ".join("?" * n)


def scalar(reads: Reads, sql: str, params: Sequence[Any] = ()) -> Any:
    """The first column of the first row (None without a row)."""
    rows = reads.all(sql, params)
    return rows[0][0] if rows else None


class SqliteReads:
    """Reads through a standard-library ``sqlite3`` connection (in autocommit mode: each statement sees every
    commit before it, unless :meth:`snapshot` holds one read transaction)."""

    def __init__(self, conn: sqlite3.Connection, url: str) -> None:
        self.conn = conn
        self.url = url
        self._depth = 0

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self.conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            undecodable = _UNDECODABLE.match(str(exc))
            found = self._undecodable(undecodable.group(1)) if undecodable else None
            if found is not None:
                raise found from exc
            raise failure(self.url, str(exc)) from exc

    def _undecodable(self, column: str) -> StoredBodyInvalid | None:
        """The receipt whose ``column`` holds TEXT that is not UTF-8 (sqlite3 cannot return it, and names only the
        column): written behind the library's back, e.g. ``CAST(body || x'ff' AS TEXT)`` in the sqlite3 shell."""
        if column not in ROW_COLUMNS:
            return None
        try:
            rows = self.conn.execute(f"SELECT CAST(id AS BLOB), seq, CAST({column} AS BLOB) FROM receipts "
                                     f"WHERE typeof({column}) = 'text' ORDER BY seq").fetchall()
        except sqlite3.Error:
            return None
        for rid, seq, value in rows:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as exc:
                name = rid.decode("utf-8", "backslashreplace") if column != "id" else f"at seq {seq}"
                return StoredBodyInvalid(name, f"its {column} column holds TEXT that is not UTF-8 (byte {exc.start}): "
                                               "written behind the library's back")
        return None

    @contextmanager
    def snapshot(self) -> Iterator[SqliteReads]:
        """One read transaction: the statements inside see the same database (nested calls join the outer one)."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self.all("BEGIN")
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")  # a read transaction: nothing to keep or lose


def connect_sqlite(target: str, url: str, *, uri: bool = False) -> sqlite3.Connection:
    """A reading connection to an SQLite ledger file (a path, or a URI with ``uri``); DatabaseError if SQLite
    cannot open it."""
    try:
        # Any thread may close it (Store.close); each thread reads through its own (Store._sqlite_reads).
        conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, isolation_level=None, uri=uri, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    except sqlite3.Error as exc:
        raise failure(url, str(exc)) from exc
    return conn


class CursorReads:
    """Reads through a DBAPI cursor inside its caller's transaction, the driver's own errors left as they are (the
    SQLite append path's cursor: ledger.database.driver_cursor turns them into what the store retries)."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self.cur.execute(sql, params).fetchall())


@functools.cache
def _pyformat(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


class DriverReads:
    """Reads through the DBAPI driver under a SQLAlchemy connection, inside its transaction (``?`` becomes ``%s``
    for drivers that want it, PostgreSQL's): no statement compiled, no result processed."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._format = conn.dialect.paramstyle in ("format", "pyformat")

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        result = self.conn.exec_driver_sql(_pyformat(sql) if self._format else sql, tuple(params))
        return [tuple(row) for row in result.all()] if result.returns_rows else []
