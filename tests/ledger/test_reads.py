"""ledger/reads.py: `ledger show` reads an SQLite ledger with the standard library, by the store's own rules. The
same receipt, row and errors as Store.open and Store.get (unknown, ambiguous, malformed or short references, a
missing file, a directory, a schema out of date or from newer software); every other case left to the store; and
`ledger show` then imports no SQLAlchemy."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ledger import reads
from ledger import store as store_module
from ledger.database import resolve_url
from ledger.errors import (
    AmbiguousReceipt,
    DatabaseError,
    InputError,
    MalformedDigest,
    SchemaOutOfDate,
    UnknownReceipt,
    UnknownSchema,
)
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store

REPO = Path(__file__).resolve().parents[2]


def notes(n: int) -> list[Receipt]:
    return [make_receipt("note", run="reads", step=i, measurements={"i": i}) for i in range(n)]


@pytest.fixture
def ledger(tmp_path: Path) -> tuple[Path, list[Receipt]]:
    db = tmp_path / "ledger.db"
    receipts = notes(40)
    with Store.open(db, create=True) as store:
        store.append_many(receipts)
    return db, receipts


def test_the_columns_are_the_stores() -> None:
    assert reads.ROW_COLUMNS == reads.StoredRow._fields
    assert tuple(c.key for c in store_module._ROW_COLUMNS) == reads.ROW_COLUMNS


def test_the_same_receipt_as_the_store(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    url = resolve_url(db)
    with Store.open(db) as store:
        for r in (receipts[0], receipts[17], receipts[-1]):
            for ref in (r.id, r.id[7:19], " " + r.id[7:15].upper() + " "):
                got = reads.read_sqlite(url, ref)
                assert got == store.get(ref) and got is not None and got.receipt.body == r.body


def _errors_alike(db: Path, ref: str, error: type[Exception]) -> None:
    with pytest.raises(error) as by_store:
        with Store.open(db) as store:
            store.get(ref)
    with pytest.raises(error) as by_reads:
        reads.read_sqlite(resolve_url(db), ref)
    assert str(by_reads.value) == str(by_store.value)


def test_the_same_errors_as_the_store(ledger: tuple[Path, list[Receipt]], tmp_path: Path) -> None:
    db, _ = ledger
    _errors_alike(db, "blake3:" + "0" * 64, UnknownReceipt)
    _errors_alike(db, "blake3:" + "0" * 63, MalformedDigest)
    _errors_alike(db, "abc", InputError)
    _errors_alike(db, "xyz123", InputError)
    _errors_alike(tmp_path / "absent.db", "abcd", DatabaseError)
    (tmp_path / "dir.db").mkdir()
    _errors_alike(tmp_path / "dir.db", "abcd", DatabaseError)


def test_an_ambiguous_prefix_names_its_matches_alike(tmp_path: Path) -> None:
    by_prefix: dict[str, Receipt] = {}
    for r in (make_receipt("note", measurements={"n": i}) for i in range(100_000)):
        other = by_prefix.setdefault(r.id[7:11], r)
        if other is not r:
            pair = [other, r]
            break
    db = tmp_path / "ledger.db"
    with Store.open(db, create=True) as store:
        store.append_many(pair)
    _errors_alike(db, pair[0].id[7:11], AmbiguousReceipt)


@pytest.mark.parametrize(("revision", "error"), [("0004_transparency_log", SchemaOutOfDate),
                                                 ("9999_from_the_future", UnknownSchema)])
def test_a_schema_other_than_the_head_is_refused_alike(ledger: tuple[Path, list[Receipt]], revision: str,
                                                       error: type[Exception]) -> None:
    db, receipts = ledger
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    conn.close()
    _errors_alike(db, receipts[0].id, error)


@pytest.mark.parametrize("make", [
    lambda db: f"sqlite:///file:{db}?mode=ro&uri=true",  # a URI: the store's read-only opening
    lambda db: "postgresql+psycopg://nobody@127.0.0.1:1/none",
    lambda db: "sqlite://",
])
def test_other_urls_are_left_to_the_store(ledger: tuple[Path, list[Receipt]], make: Callable[[Path], str]) -> None:
    db, receipts = ledger
    assert reads.read_sqlite(make(db), receipts[0].id) is None


def test_a_file_that_is_not_a_database_is_left_to_the_store(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not an sqlite database, just bytes\n" * 100)
    assert reads.read_sqlite(resolve_url(junk), "abcd") is None


def _show(*args: str) -> tuple[str, set[str]]:
    code = ("import sys\nfrom ledger.cli import main\nsys.argv = ['ledger', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('MODULES', ' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=REPO)
    text, _, modules = out.stdout.rpartition("MODULES ")
    return text, set(modules.split())


def test_ledger_show_reads_sqlite_without_sqlalchemy(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    r = receipts[3]
    text, modules = _show("show", r.id[7:20], "--db", str(db), "--json")
    assert not {m for m in modules if m.startswith("sqlalchemy")}
    with Store.open(db) as store:
        stored = store.get(r.id)
    assert json.loads(text) == {"id": r.id, "seq": stored.seq, "recorded_ns": stored.recorded_ns,
                                "receipt": r.to_document()}
    raw, _ = _show("show", r.id, "--db", str(db), "--raw")
    assert raw.encode() == r.body + b"\n"
    table, modules = _show("show", r.id, "--db", str(db))
    assert table.startswith("note receipt") and r.id[:40] in table
    assert not {m for m in modules if m.startswith("sqlalchemy")}
