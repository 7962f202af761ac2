"""ledger/reads.py: the store reads an SQLite ledger file with the standard library. The same receipts, rows and
errors as through SQLAlchemy's engine (unknown, ambiguous, malformed or short references), one line for a missing
file, a directory, a file that is not a database and a schema other than the head; writes made through the engine
seen by the reads; a connection per thread; a snapshot; and `ledger show` imports no SQLAlchemy."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from ledger import reads
from ledger.database import make_engine, resolve_url
from ledger.errors import (
    AmbiguousReceipt,
    DatabaseError,
    InputError,
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


def test_the_columns_are_the_models() -> None:
    from ledger.models import ReceiptRow

    assert reads.ROW_COLUMNS == reads.StoredRow._fields
    assert set(reads.ROW_COLUMNS) == set(ReceiptRow.__table__.columns.keys())


def through_the_engine(db: Path) -> Store:
    """The same ledger read through SQLAlchemy (what any other URL gets), to compare the file's reads with."""
    url = resolve_url(db)
    return Store(make_engine(url), url)


def test_a_ledger_file_is_read_with_the_standard_library(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    with Store.open(db) as store:
        assert store._sqlite_file == db and store._engine is None
        assert isinstance(store._sqlite_reads(), reads.SqliteReads)


def test_the_same_reads_as_through_the_engine(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    with Store.open(db) as store, through_the_engine(db) as engine_store:
        for r in (receipts[0], receipts[17], receipts[-1]):
            for ref in (r.id, r.id[7:19], " " + r.id[7:15].upper() + " "):
                got = store.get(ref)
                assert got == engine_store.get(ref) and got.receipt.body == r.body
        assert list(store.iter_rows(batch=7)) == list(engine_store.iter_rows(batch=7))
        assert store.find(run="reads", step=3) == engine_store.find(run="reads", step=3)
        assert store.ancestors(receipts[5].id) == engine_store.ancestors(receipts[5].id)
        ids = [r.id for r in receipts[::3]]
        assert store.raw_rows(ids) == engine_store.raw_rows(ids)
        assert store.count() == engine_store.count() == len(receipts)


def _errors_alike(db: Path, ref: str, error: type[Exception]) -> None:
    with pytest.raises(error) as by_engine:
        with through_the_engine(db) as store:
            store.get(ref)
    with pytest.raises(error) as by_file:
        with Store.open(db) as store:
            store.get(ref)
    assert str(by_file.value) == str(by_engine.value)


def test_the_same_errors_as_through_the_engine(ledger: tuple[Path, list[Receipt]]) -> None:
    db, _ = ledger
    _errors_alike(db, "blake3:" + "0" * 64, UnknownReceipt)
    _errors_alike(db, "blake3:" + "0" * 63, UnknownReceipt)
    _errors_alike(db, "blake3:" + "0" * 65, InputError)
    _errors_alike(db, "abc", InputError)
    _errors_alike(db, "xyz123", InputError)


def test_a_missing_file_or_a_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match="no ledger at"):
        Store.open(tmp_path / "absent.db")
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(DatabaseError, match="it is a directory, not an SQLite ledger file"):
        Store.open(tmp_path / "dir.db")


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
def test_a_schema_other_than_the_head_is_refused(ledger: tuple[Path, list[Receipt]], revision: str,
                                                 error: type[Exception]) -> None:
    db, receipts = ledger
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    conn.close()
    with pytest.raises(error):
        Store.open(db)


def test_a_file_that_is_not_a_database_is_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not an sqlite database, just bytes\n" * 100)
    with pytest.raises(DatabaseError, match=r"junk.db: it is not an SQLite ledger \(file is not a database\)"):
        Store.open(junk)


def test_a_write_needs_no_reopening_and_reads_see_it(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    extra = make_receipt("note", run="reads", step=99, parents=[receipts[-1]])
    with Store.open(db) as store:
        assert store.count() == len(receipts)
        store.append(extra)  # the engine is made here
        assert store._engine is not None
        assert store.get(extra.id).receipt == extra and store.count() == len(receipts) + 1


def test_each_thread_reads_through_its_own_connection(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    with Store.open(db) as store:
        mine = store._sqlite_reads()
        seen: list[object] = []

        def read() -> None:
            seen.append(store._sqlite_reads())
            assert store.get(receipts[1].id).receipt == receipts[1]

        worker = threading.Thread(target=read)
        worker.start()
        worker.join()
        assert len(seen) == 1 and seen[0] is not mine and store._sqlite_reads() is mine


def test_a_snapshot_sees_one_state_of_the_ledger(ledger: tuple[Path, list[Receipt]]) -> None:
    db, receipts = ledger
    with Store.open(db) as reader, Store.open(db) as writer, reader.reading() as snap:
        before = reads.scalar(snap, "SELECT count(*) FROM receipts")
        writer.append(make_receipt("note", run="reads", step=100))
        assert reads.scalar(snap, "SELECT count(*) FROM receipts") == before
    with Store.open(db) as reader:
        assert reader.count() == before + 1


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


def test_ledger_verify_of_a_receipt_imports_no_sqlalchemy(ledger: tuple[Path, list[Receipt]]) -> None:
    """`ledger verify ID` on a ledger file: the receipt recomputed, its signatures and log leaf checked, all through
    the standard library's sqlite3 (and the kinds' checks it does not need are not imported)."""
    db, receipts = ledger
    text, modules = _show("verify", receipts[5].id, "--db", str(db))
    assert text.startswith(f"OK {receipts[5].id}: 1 receipt(s) recomputed and chained")
    assert not {m for m in modules if m.startswith("sqlalchemy")}
    assert "verify.evaluation" not in modules and "verify.serving_receipts" not in modules


def test_a_stored_body_is_read_as_the_bytes_it_holds_whatever_the_driver_returns() -> None:
    """A BLOB comes back as bytes (memoryview or bytearray from some drivers), a TEXT body (sqlite3's replace() on a
    BLOB) as str: each is its bytes, the text its UTF-8 with lone surrogates kept, never a crash or a repr."""
    body = b'{"kind":"note","text":"\xc3\xa9"}'
    for stored in (body, bytearray(body), memoryview(body), body.decode("utf-8")):
        assert reads.stored_bytes(stored) == body and type(reads.stored_bytes(stored)) is bytes
    assert reads.stored_bytes("\ud800") == b"\xed\xa0\x80"
    assert reads.stored_bytes(10**15) == b"1000000000000000"  # an integer stored by an UPDATE: its text, no allocation
    text_body: Any = body.decode("utf-8")  # a TEXT body, as an UPDATE may leave it
    assert reads.StoredRow(1, "id", "note", None, None, None, None, None, text_body, 0).body_bytes() == body

