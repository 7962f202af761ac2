"""A stored receipt as the store reads it, and the rules for naming one: a ``receipts`` row, a full id or a unique
hex prefix. Without SQLAlchemy, so that :func:`read_sqlite` can serve `ledger show` on an SQLite ledger with the
standard library alone (opening SQLAlchemy costs 0.15 s, three times the rest of the command; benchmarks/README.md,
audit_bench). :class:`~ledger.store.Store` resolves and parses with the same functions and the same columns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

from ledger.database import (
    BUSY_TIMEOUT_S,
    REVISION_SQL,
    check_revision,
    check_sqlite_file,
    plain_sqlite_path,
    unwritable,
)
from ledger.errors import AmbiguousReceipt, InputError, MalformedDigest, MalformedReceipt, UnknownReceipt
from ledger.receipts import Receipt

MIN_PREFIX: Final = 4
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

    def to_receipt(self) -> Receipt:
        body = self.body if isinstance(self.body, bytes) else str(self.body).encode("utf-8", "surrogatepass")
        return Receipt.from_bytes(body)


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
        raise MalformedReceipt(f"stored body does not parse: {exc.one_line()}", row.id) from exc
    return Stored(receipt, row.seq, row.recorded_ns)


def id_range(ref: str) -> tuple[str, str]:
    """The ids a reference may name, ``[lo, hi)``: one full id (``blake3:<64 hex>``) or every id starting with a hex
    prefix of at least MIN_PREFIX digits; anything else is refused here, before a query."""
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
    return lo, lo + "g"  # "g" sorts after every hex digit


def pick(ref: str, found: Iterable[str]) -> str:
    """The one id a reference names among the (at most MATCHES) ids of its range."""
    ids = list(found)
    if not ids:
        raise UnknownReceipt(ref)
    if len(ids) > 1:
        raise AmbiguousReceipt(ref, ids)
    return ids[0]


_SELECT_IDS = f"SELECT id FROM receipts WHERE id >= ? AND id < ? LIMIT {MATCHES}"
_SELECT_ROW = SELECT_ROWS + " WHERE id = ?"


def read_sqlite(url: str, ref: str) -> Stored | None:
    """The receipt ``ref`` names in the SQLite ledger file of a plain ``sqlite:///path`` URL, read with the standard
    library; None when this path does not apply and the store must read it: any other URL, a file this process may
    not write (the store opens it through a read-only URI), or any error from SQLite (the store then says what is
    wrong in its words). Otherwise the same checks and errors as ``Store.open`` and ``Store.get``."""
    path = plain_sqlite_path(url)
    if path is None:
        return None
    check_sqlite_file(path)
    if unwritable(path) is not None:
        return None
    lo, hi = id_range(ref)
    import sqlite3

    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            try:
                found = conn.execute(REVISION_SQL).fetchone()
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc):
                    return None
                found = None  # not a ledger of ours, or not one yet
            check_revision(url, None if found is None else found[0])
            rid = pick(ref, (r for (r,) in conn.execute(_SELECT_IDS, (lo, hi))))
            row = conn.execute(_SELECT_ROW, (rid,)).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return parsed(StoredRow._make(row))
