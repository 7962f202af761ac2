"""The store (ledger/store.py) on real databases: appends, lookups, closures, the write lock, pragmas.

Tests taking ``ledger_url`` (or ``db_url``) run twice, on an SQLite file and on PostgreSQL (tests/pg.py). Those on
``ledger_db`` are about SQLite itself (its file, its PRAGMAs) or refuse their input before any query is made."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from ledger import digests
from ledger.errors import (
    AmbiguousReceipt,
    ChainBroken,
    DatabaseError,
    InputError,
    MissingParents,
    RecordMismatch,
    SchemaOutOfDate,
    UnknownExperiment,
    UnknownReceipt,
    UnknownSchema,
)
from ledger.receipts import Receipt, make_receipt
from ledger.store import ArtifactRef, ParentEdge, Store, Stored, StoredRow
from tests.conftest import ReceiptChain
from tests.pg import raw_count, raw_rows
from verify.receipts import verify_receipt

MakeChain = Callable[..., ReceiptChain]


@pytest.fixture
def store(ledger_url: str) -> Iterator[Store]:
    """An empty ledger, on SQLite and on PostgreSQL."""
    with Store.open(ledger_url) as s:
        yield s


@pytest.fixture
def sqlite_store(ledger_db: Path) -> Iterator[Store]:
    """An empty SQLite ledger, for the tests whose input is refused before any query (no backend to compare)."""
    with Store.open(ledger_db) as s:
        yield s


def note(i: int, parents: list[Receipt] | None = None, **fields: Any) -> Receipt:
    return make_receipt("note", parents=parents or [], measurements={"i": i}, **fields)


def two_sharing_a_prefix(width: int = 4) -> tuple[Receipt, Receipt]:
    """Two receipts whose ids share their first ``width`` hex digits (found by a birthday search)."""
    seen: dict[str, Receipt] = {}
    i = 0
    while True:
        r = note(i)
        key = r.id[7 : 7 + width]
        if key in seen:
            return seen[key], r
        seen[key] = r
        i += 1


# ------------------------------------------------------------------------------------------------- open


def test_open_missing_path_without_create(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    with pytest.raises(DatabaseError, match="ledger init") as info:
        Store.open(path)
    assert info.value.exit_code == 4
    assert not path.exists()


# SQLite only: its journal, durability and foreign keys are per-connection PRAGMAs (PostgreSQL's are server-wide).
def test_open_sets_wal_full_sync_and_foreign_keys(sqlite_store: Store) -> None:
    with sqlite_store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert (conn.exec_driver_sql("PRAGMA busy_timeout").scalar() or 0) >= 1000


def test_wal_mode_persists_in_the_file(ledger_db: Path) -> None:
    with sqlite3.connect(ledger_db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_open_checks_the_schema_revision(db_url: str, ledger_url: str) -> None:
    with pytest.raises(SchemaOutOfDate, match="ledger db upgrade") as info:
        Store.open(db_url)  # an empty database: no schema yet
    assert info.value.exit_code == 4
    raw_rows(ledger_url, "UPDATE alembic_version SET version_num = 'zzzz'")
    with pytest.raises(UnknownSchema, match="zzzz") as unknown:
        Store.open(ledger_url)
    assert unknown.value.exit_code == 4


def test_create_on_an_existing_ledger_keeps_it(ledger_url: str) -> None:
    with Store.open(ledger_url) as s:
        s.append(note(1))
    with Store.open(ledger_url, create=True) as s:
        assert s.count() == 1


# ----------------------------------------------------------------------------------------------- append


def test_append_returns_stored(store: Store) -> None:
    r = note(1)
    stored = store.append(r)
    assert isinstance(stored, Stored)
    assert stored.receipt == r and stored.seq >= 1 and stored.recorded_ns > 0
    ((body, kind),) = raw_rows(store.url, "SELECT body, kind FROM receipts WHERE id = :id", {"id": r.id})
    assert bytes(body) == r.body and kind == "note"


def test_append_twice_is_one_row(store: Store) -> None:
    r = note(1)
    first = store.append(r)
    store.append(note(2))
    again = store.append(Receipt.from_bytes(r.body))
    assert again.seq == first.seq and again.recorded_ns == first.recorded_ns
    assert raw_count(store.url) == 2
    both = store.append_many([r, r])
    assert [s.seq for s in both] == [first.seq, first.seq]
    assert raw_count(store.url) == 2


def test_seq_gaps_break_nothing(store: Store, backend: str) -> None:
    """receipts.md 5.1: seq increases with append order but may have gaps. On PostgreSQL a sequence skips the
    values of a rolled-back insert (here the optimistic insert of a stored receipt); SQLite counts max(seq) + 1."""
    a = store.append(note(1))
    assert store.append(note(1)).seq == a.seq  # stored already: the optimistic insert failed and rolled back
    b = store.append(note(2, [a.receipt]))
    assert (b.seq > a.seq + 1) if backend == "postgresql" else (b.seq == a.seq + 1)
    assert [row.id for row in store.iter_rows(batch=1)] == [a.receipt.id, b.receipt.id]
    assert [s.receipt.id for s in store.ancestors(b.receipt.id)] == [a.receipt.id, b.receipt.id]
    # The log's leaf indexes stay contiguous from 0 whatever the seqs are.
    assert raw_rows(store.url, "SELECT leaf_index, receipt_seq FROM log_leaves ORDER BY leaf_index") == \
        [(0, a.seq), (1, b.seq)]
    verify_receipt(store, b.receipt.id)


def test_a_writer_waits_for_the_write_lock_and_readers_do_not(ledger_url: str) -> None:
    """A write transaction takes the write lock first (SQLite BEGIN IMMEDIATE, PostgreSQL an advisory lock), so a
    second writer waits for it instead of interleaving; reads go on meanwhile."""
    with Store.open(ledger_url) as holder, Store.open(ledger_url) as writer, Store.open(ledger_url) as reader:
        holder.append(note(0))
        appended = threading.Event()

        def append() -> None:  # a Store is used from one thread: this one is the writer's
            writer.append(note(1))
            appended.set()

        with holder.engine.execution_options(ledger_write=True).begin():  # holds the lock until the block ends
            waiting = threading.Thread(target=append)
            waiting.start()
            assert not appended.wait(0.3), "a second writer went ahead while the write lock was held"
            assert reader.count() == 1
        waiting.join(timeout=30)
        assert appended.is_set() and reader.count() == 2


def test_append_with_missing_parent_writes_nothing(store: Store) -> None:
    parent = note(1)
    child = note(2, parents=[parent], artifacts={"x": digests.raw_digest(b"x")})
    with pytest.raises(MissingParents) as info:
        store.append(child)
    assert info.value.missing == [parent.id] and info.value.receipt == child.id
    assert info.value.exit_code == 3
    for table in ("receipts", "receipt_parents", "receipt_artifacts"):
        assert raw_count(store.url, table) == 0


def test_append_many_is_atomic(store: Store, make_chain: MakeChain) -> None:
    c = make_chain()
    orphan = note(9, parents=[note(8)])
    with pytest.raises(MissingParents):
        store.append_many([*c.receipts(), orphan])
    assert raw_count(store.url) == 0 and raw_count(store.url, "receipt_parents") == 0
    # A chain-rule failure late in the batch also writes nothing.
    bad_end = make_receipt("train-end", run="run-a", rank=0, step=1, prepared=c.prepared,
                           parents=[c.checkpoints[-1]])
    with pytest.raises(ChainBroken):
        store.append_many([*c.receipts(), bad_end])
    assert raw_count(store.url) == 0 and raw_count(store.url, "receipt_artifacts") == 0


def test_parents_inside_the_same_batch(store: Store, make_chain: MakeChain) -> None:
    c = make_chain()
    stored = store.append_many(c.receipts())
    assert [s.receipt.id for s in stored] == [r.id for r in c.receipts()]
    seqs = [s.seq for s in stored]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert raw_count(store.url) == len(c.receipts())
    assert raw_count(store.url, "receipt_parents") == sum(len(r.parents) for r in c.receipts())
    assert raw_count(store.url, "receipt_artifacts") == sum(len(r.artifacts) for r in c.receipts())


def test_child_before_its_parent_in_a_batch_is_refused(store: Store) -> None:
    a = note(1)
    b = note(2, parents=[a])
    with pytest.raises(MissingParents):
        store.append_many([b, a])
    assert store.count() == 0


def test_a_batch_may_hold_stored_receipts_in_any_order(store: Store, make_chain: MakeChain) -> None:
    """append_many first assumes no given receipt is stored; a stored one (cited before it comes, failing a chain
    rule it was stored without, or just repeated) must still be a no-op and get its own seq back."""
    a, c = note(1), make_chain()
    first = store.append(a)
    b = note(2, parents=[a])
    out = store.append_many([b, a])  # b cites a, which comes later in the batch but is stored already
    assert [s.seq for s in out] == [first.seq + 1, first.seq] and out[1].recorded_ns == first.recorded_ns
    store.append_many(c.receipts()[:4])
    bad = make_receipt("checkpoint", run="run-a", rank=0, step=1, prepared=c.prepared, parents=[c.train_start])
    kept = store.append(bad, check=False)  # breaks a chain rule (no artifacts.state): stored without checks
    child = note(3, parents=[bad], prepared=c.prepared)
    out = store.append_many([bad, child, b])  # with checks: the stored bad is not checked again
    assert [s.seq for s in out] == [kept.seq, kept.seq + 1, first.seq + 1]
    everything = [a, b, *c.receipts()[:4], bad, child]
    assert raw_count(store.url) == len(everything)
    assert raw_count(store.url, "receipt_parents") == sum(len(r.parents) for r in everything)


def test_append_checks_chain_rules_unless_told_not_to(store: Store, make_chain: MakeChain) -> None:
    c = make_chain()
    store.append_many(c.receipts()[:4])
    bad = make_receipt("checkpoint", run="run-a", rank=0, step=1, prepared=c.prepared,
                       parents=[c.train_start])  # no artifacts.state
    with pytest.raises(ChainBroken):
        store.append(bad)
    assert store.append(bad, check=False).receipt == bad


# ----------------------------------------------------------------------------------------------- resolve


def test_resolve_full_id_and_prefixes(store: Store) -> None:
    r = note(1)
    store.append(r)
    store.append(note(2))
    hexpart = r.id.removeprefix("blake3:")
    assert store.resolve(r.id) == r.id
    assert store.resolve(hexpart) == r.id
    assert store.resolve(hexpart[:12]) == r.id
    assert store.resolve(hexpart[:12].upper()) == r.id
    assert store.resolve(f"  {hexpart[:12]}\n") == r.id
    assert store.get(hexpart[:10]).receipt == r


# This test and the next two on SQLite only: the reference is refused before any query reaches the database.
@pytest.mark.parametrize("ref", ["abc", "a", ""])
def test_prefix_too_short(sqlite_store: Store, ref: str) -> None:
    sqlite_store.append(note(1))
    with pytest.raises(InputError) as info:
        sqlite_store.resolve(ref)
    assert info.value.exit_code == 2


@pytest.mark.parametrize("ref", ["xyz12", "blake3", "12 34", "abcd\nef01", "0" * 65])
def test_non_hex_reference(sqlite_store: Store, ref: str) -> None:
    with pytest.raises(InputError) as info:
        sqlite_store.resolve(ref)
    assert type(info.value) is InputError
    assert info.value.exit_code == 2


def test_an_id_cut_short_is_a_prefix(sqlite_store: Store) -> None:
    """What the tool prints (`ledger log`'s ``blake3:79b3754936513a18``) it takes back: ``blake3:`` and a prefix."""
    r = note(1)
    sqlite_store.append(r)
    for ref in (r.id[:-1], r.id[:20], r.id[:11], f" {r.id[:23]}\n"):
        assert sqlite_store.resolve(ref) == r.id
    for ref in ("blake3:", r.id + "0", r.id.upper().replace("BLAKE3", "blake3"), r.id[:9] + "zz", "blake3:" + " " * 8):
        with pytest.raises(InputError, match="is neither an id nor a prefix of one") as info:
            sqlite_store.resolve(ref)
        assert info.value.exit_code == 2
    with pytest.raises(InputError, match="too short: give at least 4 hex digits"):
        sqlite_store.resolve(r.id[:10])
    with pytest.raises(InputError) as info:  # a reference of any length is shown in a bounded line
        sqlite_store.resolve(r.id + "0" * 1_000_000)
    assert len(info.value.one_line()) < 250 and "(1,000,071 characters)" in info.value.one_line()


def test_unknown_reference(store: Store) -> None:
    r = note(1)
    store.append(r)
    other = note(2)
    with pytest.raises(UnknownReceipt) as info:
        store.resolve(other.id)
    assert info.value.exit_code == 3
    # A prefix of another receipt's hex that does not prefix r's.
    prefix = next(other.id[7 : 7 + n] for n in range(4, 64) if not r.id[7:].startswith(other.id[7 : 7 + n]))
    with pytest.raises(UnknownReceipt):
        store.resolve(prefix)


def test_ambiguous_prefix(store: Store) -> None:
    a, b = two_sharing_a_prefix()
    store.append_many([a, b])
    prefix = a.id[7:11]
    with pytest.raises(AmbiguousReceipt) as info:
        store.resolve(prefix)
    assert info.value.exit_code == 3
    assert sorted(info.value.candidates) == sorted([a.id, b.id])
    # Enough digits disambiguate.
    n = next(n for n in range(5, 65) if a.id[7 : 7 + n] != b.id[7 : 7 + n])
    assert store.resolve(a.id[7 : 7 + n]) == a.id


# -------------------------------------------------------------------------------------------------- find


def test_find_by_each_field(store: Store, make_chain: MakeChain) -> None:
    a = make_chain()
    b = make_chain(run="run-b", rank=1, salt="b-")
    store.append_many(a.receipts())
    store.append_many(b.receipts())
    ids = lambda found: [s.receipt.id for s in found]  # noqa: E731
    assert ids(store.find(kind="checkpoint")) == [r.id for r in (*a.checkpoints, *b.checkpoints)]
    assert ids(store.find(run="run-b")) == [b.train_start.id, *(r.id for r in b.checkpoints), b.train_end.id,
                                            b.eval.id]
    assert set(ids(store.find(prepared=b.prepared))) == {r.id for r in b.receipts()}
    assert ids(store.find(selection=a.selection.selection)) == [a.selection.id, a.eval.id]
    assert ids(store.find(rank=1)) == [b.train_start.id, *(r.id for r in b.checkpoints), b.train_end.id]
    assert ids(store.find(kind="checkpoint", run="run-a", step=4)) == [a.checkpoints[1].id]
    assert ids(store.find(rank=0, kind="train-start")) == [a.train_start.id]
    assert len(store.find(limit=3)) == 3
    assert len(store.find()) == store.count() == 2 * len(a.receipts())
    assert store.find(kind="audit") == []
    found = store.find(kind="eval")
    assert [s.seq for s in found] == sorted(s.seq for s in found)


# --------------------------------------------------------------------------------------------- closures


def test_ancestors_and_descendants_with_diamonds(store: Store) -> None:
    #      a
    #     / \
    #    b   c        e (unrelated)
    #     \ / \
    #      d   f
    #       \ /
    #        g
    a = note(1)
    b, c = note(2, [a]), note(3, [a])
    d = note(4, [b, c])
    f = note(5, [c])
    g = note(6, [d, f])
    e = note(7)
    store.append_many([a, b, c, e, d, f, g])
    ids = lambda found: [s.receipt.id for s in found]  # noqa: E731
    assert ids(store.ancestors(g.id)) == [a.id, b.id, c.id, d.id, f.id, g.id]
    assert ids(store.ancestors(d.id)) == [a.id, b.id, c.id, d.id]
    assert ids(store.ancestors(a.id)) == [a.id]
    assert ids(store.descendants(a.id)) == [a.id, b.id, c.id, d.id, f.id, g.id]
    assert ids(store.descendants(c.id)) == [c.id, d.id, f.id, g.id]
    assert ids(store.descendants(b.id[7:15])) == [b.id, d.id, g.id]
    assert ids(store.descendants(g.id)) == [g.id]
    assert ids(store.ancestors(e.id)) == ids(store.descendants(e.id)) == [e.id]


@contextmanager
def counting_statements(store: Store) -> Iterator[list[str]]:
    """The statements the store runs inside the block: through SQLite's own trace on a ledger file read with the
    standard library, else through the engine's events."""
    statements: list[str] = []
    if store._sqlite_file is not None:
        conn = store._sqlite_reads().conn
        conn.set_trace_callback(statements.append)
        try:
            yield statements
        finally:
            conn.set_trace_callback(None)
        return

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


def test_ancestors_use_a_bounded_number_of_statements(store: Store) -> None:
    receipts = [note(0)]
    for i in range(1, 200):
        receipts.append(note(i, [receipts[-1]]))
    store.append_many(receipts)
    with counting_statements(store) as statements:
        found = store.ancestors(receipts[-1].id)
        up = len(statements)
        statements.clear()
        below = store.descendants(receipts[0].id)
        down = len(statements)
    assert len(found) == len(below) == 200
    assert [s.receipt.id for s in found] == [r.id for r in receipts]
    assert 1 <= up < 10 and 1 <= down < 10, (up, down)


def test_rows_are_never_rewritten(store: Store) -> None:
    r = note(1)
    first = store.append(r)
    for _ in range(3):
        store.append(r)
    assert raw_rows(store.url, "SELECT seq, recorded_ns FROM receipts") == [(first.seq, first.recorded_ns)]


def test_locations_are_idempotent(store: Store) -> None:
    d = digests.raw_digest(b"artifact")
    store.add_location(d, "/somewhere/a")
    store.add_location(d, "/somewhere/a")
    store.add_location(d, "file:///elsewhere/b")
    assert store.locations(d) == ["/somewhere/a", "file:///elsewhere/b"]
    assert store.locations(digests.raw_digest(b"other")) == []


def test_a_location_stored_as_another_type_names_no_place(sqlite_store: Store, ledger_db: Path) -> None:
    """SQLite keeps a BLOB written into the TEXT column of locations: read as its repr, it names no place (the
    artifact check reports the copy missing there), and never fails the read (a TypeError before)."""
    d = digests.raw_digest(b"artifact")
    for uri in ("/somewhere/a", "/somewhere/b", "/somewhere/c"):
        sqlite_store.add_location(d, uri)
    with sqlite3.connect(ledger_db) as conn:
        conn.execute("UPDATE artifact_locations SET uri = X'00ff' WHERE uri = '/somewhere/a'")
        conn.execute("UPDATE artifact_locations SET uri = 17 WHERE uri = '/somewhere/b'")
    # the integer took the column's TEXT affinity: '17', a relative path like any other
    assert sqlite_store.locations(d) == ["b'\\x00\\xff'", str(ledger_db.parent / "17"), "/somewhere/c"]
    assert sqlite_store.locations_of([d]) == {d: sqlite_store.locations(d)}


def test_iter_rows_streams_in_append_order(store: Store) -> None:
    receipts = [note(i) for i in range(12)]
    store.append_many(receipts)
    rows = list(store.iter_rows(batch=5))
    assert [row.id for row in rows] == [r.id for r in receipts]
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM receipts")).scalar() == 12


@pytest.mark.parametrize("foreign", [3, 40])
def test_experiment_rows_are_its_rows_in_append_order_with_their_index_rows(store: Store, foreign: int) -> None:
    """An experiment's rows among another's, few (read as one seq range, the other's left out) or many (by id):
    the same rows, in append order, and the index rows of those receipts only."""
    a, b = digests.raw_digest(b"experiment a"), digests.raw_digest(b"experiment b")
    mine: list[Receipt] = []
    for i in range(30):
        mine.append(note(i, parents=mine[-1:], prepared=a, artifacts={"x": digests.raw_digest(b"%d" % i)}))
        store.append(mine[-1])
        if i % 10 == 4:  # another experiment's receipts in between, with parents and artifacts of their own
            theirs = [note(1000 * i, prepared=b)]
            theirs += [note(1000 * i + j, parents=theirs[:1], prepared=b, artifacts={"y": digests.raw_digest(b"y")})
                       for j in range(1, foreign)]
            store.append_many(theirs)
    batches = list(store.experiment_rows(prepared=a, batch=7))
    rows = [row for got in batches for row in got.rows]
    assert [row.id for row in rows] == [r.id for r in mine]
    assert [row for row in store.iter_rows() if row.prepared == a] == rows
    assert [e for got in batches for e in got.edges] == [ParentEdge(c.id, p) for c in mine for p in c.parents]
    assert [x for got in batches for x in got.artifacts] == [ArtifactRef(r.id, "x", r.artifacts["x"]) for r in mine]
    assert list(store.experiment_rows(prepared=digests.raw_digest(b"none"))) == []


def test_rows_are_plain_tuples_of_every_column_as_stored(store: Store) -> None:
    """iter_rows, raw_rows and raw_closure read rows as StoredRow tuples (no ORM instance per row), every column."""
    root = note(0, run="r", rank=1, step=2, prepared=digests.raw_digest(b"p"))
    child = note(1, parents=[root], prepared=root.prepared, selection=digests.raw_digest(b"s"),
                 artifacts={"a": digests.raw_digest(b"a")})
    stored = {s.receipt.id: s for s in store.append_many([root, child])}
    closure, edges, arts = store.raw_closure(child.id)
    for rows in (list(store.iter_rows(batch=1)), store.raw_rows([child.id, root.id, "blake3:absent"])[0], closure):
        assert sorted(row.id for row in rows) == sorted([root.id, child.id])
        for row in rows:
            assert isinstance(row, StoredRow) and type(row.body) is bytes
            r, s = stored[row.id].receipt, stored[row.id]
            assert row == (s.seq, r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body, s.recorded_ns)
            assert row.to_receipt() == r
    assert edges == [ParentEdge(child.id, root.id)]
    assert arts == [ArtifactRef(child.id, "a", digests.raw_digest(b"a"))]


def test_locations_of_many_digests_and_receipts_in_one_call(store: Store) -> None:
    a, b, none = (digests.raw_digest(x) for x in (b"a", b"b", b"none"))
    store.add_location(a, "/first/a")
    store.add_location(b, "/only/b")
    store.add_location(a, "/second/a")
    assert store.locations_of([a, b, none]) == {a: ["/first/a", "/second/a"], b: ["/only/b"], none: []}
    assert store.locations_of([]) == {}
    r = note(0, artifacts={"x": a, "y": b})
    other = note(1)
    store.append_many([r, other])
    store.add_receipt_locations(r.id, {"x": "/first/a", "y": "/only/b"})
    assert store.receipt_locations_of([r.id, other.id]) == {r.id: {"x": ["/first/a"], "y": ["/only/b"]}, other.id: {}}
    assert store.receipt_locations(r.id) == {"x": ["/first/a"], "y": ["/only/b"]}
    assert store.location_owners("/first/a") == [r.id]


def test_a_batch_stores_every_byte_as_given(store: Store) -> None:
    """A batch goes in by COPY on PostgreSQL (text format, escaped by the driver): bodies with backslashes, tabs,
    newlines, NUL escapes and non-ASCII text, names with every allowed punctuation, signatures of any bytes, come back
    byte for byte, their ids recompute, and the chain verifies."""
    from ledger import signing, tlog

    signer = signing.generate_key("copy")
    tricky = ["a\\b", "tab\there", "line\nbreak", "nul\u0000x", "é ü 漢字 \U0001f600", "\\N", "\\.", "'quote\"", ","]
    root = make_receipt("note", run="copy.run_a:b/c@d+e=f-g", measurements={"root": tricky})
    batch = [root] + [make_receipt("note", run="copy", step=i, parents=[root],
                                   artifacts={f"a.{i}": digests.raw_digest(text.encode())},
                                   measurements={"text": text, "i": i}) for i, text in enumerate(tricky)]
    stored = store.append_many(batch, signer=signer)
    assert all(s.new for s in stored)
    rows = {row.id: row for row in store.iter_rows()}
    for r in batch:
        assert bytes(rows[r.id].body) == r.body and digests.receipt_id(bytes(rows[r.id].body)) == r.id
        assert store.get(r.id).receipt.artifacts == r.artifacts
    with store.reading() as reads:
        sigs = tlog.signatures_by_seq(reads, [s.seq for s in stored])
    assert {len(v) for v in sigs.values()} == {1}
    assert verify_receipt(store, batch[-1].id).receipts_checked == 2


def test_an_experiment_whose_prepare_receipt_is_gone_is_a_broken_chain(ledger_db: Path, make_chain: MakeChain
                                                                       ) -> None:
    """Receipts of an experiment without its prepare receipt (the row deleted behind the library's back) are a
    broken chain (exit 1), not a ledger that was never prepared (exit 3 and a hint to run prepare)."""
    from typer.testing import CliRunner

    from ledger.cli import app

    c = make_chain()
    with Store.open(ledger_db) as store:
        store.append_many(c.receipts())
    with sqlite3.connect(ledger_db) as conn:
        seq = conn.execute("SELECT seq FROM receipts WHERE id = ?", (c.prepare.id,)).fetchone()[0]
        conn.execute("DELETE FROM receipt_artifacts WHERE receipt_seq = ?", (seq,))
        conn.execute("DELETE FROM receipts WHERE seq = ?", (seq,))
    with Store.open(ledger_db) as store:
        with pytest.raises(ChainBroken, match="has no prepare receipt") as info:
            store.latest_prepared()
        assert info.value.field == "prepared" and info.value.receipt != c.prepare.id
        with pytest.raises(ChainBroken):
            store.latest_prepared(c.prepare.prepared)
        with pytest.raises(UnknownExperiment, match="no prepare receipt with prepared digest"):
            store.latest_prepared(digests.raw_digest(b"another experiment"))
    result = CliRunner().invoke(app, ["audit", "--no-record", "--db", str(ledger_db)])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.output
    assert "has no prepare receipt" in result.stderr
    # another experiment's digest is a lookup that failed (exit 3); a digest mistyped is named as one (exit 2)
    mistyped = digests.raw_digest(b"another experiment")[:-1]
    for prepared, code, said in ((digests.raw_digest(b"another experiment"), 3, "no prepare receipt with prepared "
                                  "digest blake3:"), (mistyped, 2, "--prepared: expected 'blake3:'")):
        for command in (["audit", "--no-record"], ["report", "--no-record"]):
            result = CliRunner().invoke(app, [*command, "--db", str(ledger_db), "--prepared", prepared])
            assert result.exit_code == code and result.stdout == "", result.output
            assert result.stderr.startswith(f"ledger: error: {said}") and result.stderr.count("\n") == 1
    with Store.open(ledger_db.with_name("empty.db"), create=True) as empty:
        with pytest.raises(UnknownExperiment, match="run `ledger run prepare` first") as none:
            empty.latest_prepared()
    assert none.value.exit_code == 3


def test_find_never_returns_a_row_its_body_does_not_match(ledger_db: Path,
                                                         make_chain: Callable[..., ReceiptChain]) -> None:
    """The match is by index columns; a row whose column was changed behind the library's back (an eval receipt's
    kind set to 'note') is named, exit 1, not listed as a note."""
    from typer.testing import CliRunner

    from ledger.cli import app

    c = make_chain()
    with Store.open(ledger_db) as store:
        store.append_many(c.receipts())
    with sqlite3.connect(ledger_db) as conn:
        conn.execute("UPDATE receipts SET kind = 'note', rank = 7 WHERE id = ?", (c.eval.id,))
    with Store.open(ledger_db) as store:
        with pytest.raises(RecordMismatch) as info:
            store.find(kind="note")
        assert (info.value.receipt, info.value.field, info.value.expected, info.value.actual) == (
            c.eval.id, "kind", "eval", "note")
        with pytest.raises(RecordMismatch, match="stored rank 7 differs from its body's"):
            store.find(rank=7)
        assert [s.receipt.id for s in store.find(kind="train-end")] == [c.train_end.id]  # other rows as before
    result = CliRunner().invoke(app, ["log", "--db", str(ledger_db), "--kind", "note"])
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr == f"ledger: error: receipt {c.eval.id}: stored kind 'note' differs from its body's 'eval'\n"
