"""Four OS processes append into one SQLite ledger at once: nothing lost, nothing twice, no error, chains intact.

Each writer chains its own receipts and, every few appends, reads the latest committed receipt of another writer
(a read before the write, under contention) and cites it. With deferred transactions this is the case that forks
chains or fails with "database is locked"; the store's BEGIN IMMEDIATE writers must make it clean.
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from ledger import digests
from ledger.digests import prepared_digest
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from verify.receipts import verify_receipt

WRITERS = 4
PER_WRITER = 2000
CITE_EVERY = 7  # every 7th receipt also cites another writer's latest committed receipt
# The bulk is one receipt per transaction (the contended case); the last BATCHED of each writer go through
# append_many in batches of BATCH, so batches contend with single appends too.
BATCH = 20
BATCHED = 400

ARTIFACTS = {"data": digests.raw_digest(b"concurrency data"), "config": digests.raw_digest(b"concurrency config")}
PREPARED = prepared_digest(ARTIFACTS)


def _root() -> Receipt:
    return make_receipt("prepare", prepared=PREPARED, artifacts=ARTIFACTS)


def _run(w: int) -> str:
    return f"writer-{w}"


def _latest_step(store: Store, run: str, known: int) -> int:
    """The highest committed step of ``run`` (steps of one writer are contiguous), found by galloping search."""

    def present(step: int) -> bool:
        return bool(store.find(run=run, kind="note", step=step, limit=1))

    lo, gap = known, 1  # invariant: step lo is present (or lo == -1)
    while present(lo + gap):
        lo, gap = lo + gap, gap * 2
    hi = lo + gap  # absent
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if present(mid) else (lo, mid)
    return lo


def _writer(db: str, w: int, start: Any, results: Any) -> None:
    """Child process body: report ("ok", w, counts) or ("error", w, traceback) on the queue."""
    try:
        store = Store.open(db)
        start.wait()
        root = _root()
        store.append(root)  # all four append the same root at once: one row (same bytes, same id)
        prev = root
        known = {v: -1 for v in range(WRITERS) if v != w}
        cited = 0
        pending: list[Receipt] = []
        t0 = time.perf_counter()
        for step in range(PER_WRITER):
            parents = [prev]
            if step % CITE_EVERY == CITE_EVERY - 1:
                other = (w + 1 + (step // CITE_EVERY) % (WRITERS - 1)) % WRITERS
                known[other] = _latest_step(store, _run(other), known[other])
                if known[other] >= 0:
                    found = store.find(run=_run(other), kind="note", step=known[other], limit=1)
                    parents.append(found[0].receipt)
                    cited += 1
            r = make_receipt(
                "note",
                run=_run(w),
                rank=w,
                step=step,
                prepared=PREPARED,
                parents=parents,
                artifacts={"out": digests.raw_digest(b"%d/%d" % (w, step))},
                measurements={"loss": 1.0 / (step + 1), "writer": w},
            )
            if len(parents) > 1 or step < PER_WRITER - BATCHED:
                # A receipt citing another writer goes alone, right after the read that found its parent.
                if pending:
                    store.append_many(pending)
                    pending = []
                store.append(r)
            else:
                pending.append(r)
                if len(pending) == BATCH:
                    store.append_many(pending)
                    pending = []
            prev = r
        if pending:
            store.append_many(pending)
        results.put(("ok", w, {"appended": PER_WRITER, "cited": cited, "tip": prev.id,
                               "seconds": time.perf_counter() - t0}))
        store.close()
    except BaseException:  # report everything: the parent asserts no exception reached any writer
        results.put(("error", w, traceback.format_exc()))


@pytest.mark.slow
def test_four_processes_append_into_one_sqlite_file(tmp_path: Path) -> None:
    db = str(tmp_path / "ledger.db")
    Store.open(db, create=True).close()
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db, w, start, results)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let every child import and open its store, so they really start together
    t0 = time.perf_counter()
    start.set()
    reports = [results.get(timeout=300) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    errors = [r for r in reports if r[0] != "ok"]
    assert not errors, "\n".join(f"writer {w}:\n{tb}" for _, w, tb in errors)
    by_writer = {w: info for _, w, info in reports}
    assert sorted(by_writer) == list(range(WRITERS))
    assert all(info["appended"] == PER_WRITER for info in by_writer.values())
    assert all(info["cited"] > 0 for info in by_writer.values()), by_writer  # cross-writer reads really happened
    print(f"\n{WRITERS * PER_WRITER} appends by {WRITERS} processes in {elapsed:.1f} s; "
          + ", ".join(f"w{w}: {i['seconds']:.1f} s, {i['cited']} cross-citations" for w, i in by_writer.items()))

    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("SELECT count(*) FROM receipts").fetchone() == (WRITERS * PER_WRITER + 1,)
        assert con.execute("SELECT count(*) FROM receipts WHERE kind = 'note'").fetchone() == (WRITERS * PER_WRITER,)
        assert con.execute("SELECT count(*) FROM receipts WHERE kind = 'prepare'").fetchone() == (1,)
        assert con.execute("SELECT count(DISTINCT id) FROM receipts").fetchone() == (WRITERS * PER_WRITER + 1,)
        per_run = dict(con.execute("SELECT run, count(DISTINCT step) FROM receipts WHERE kind='note' GROUP BY run"))
        assert per_run == {_run(w): PER_WRITER for w in range(WRITERS)}
        dangling = con.execute(
            "SELECT count(*) FROM receipt_parents e LEFT JOIN receipts r ON r.seq = e.parent_seq WHERE r.seq IS NULL"
        ).fetchone()
        assert dangling == (0,)
        edges = con.execute("SELECT count(*) FROM receipt_parents").fetchone()[0]
        cited = sum(info["cited"] for info in by_writer.values())
        assert edges == WRITERS * PER_WRITER + cited  # one edge to the previous receipt, plus each cross-citation
        # A parent is always stored before its child: the append order respects the DAG.
        late = con.execute(
            "SELECT count(*) FROM receipt_parents WHERE parent_seq >= child_seq"
        ).fetchone()
        assert late == (0,)
    finally:
        con.close()

    with Store.open(db) as store:
        for w, info in by_writer.items():
            tip = store.find(run=_run(w), step=PER_WRITER - 1)
            assert [s.receipt.id for s in tip] == [info["tip"]]
            report = verify_receipt(store, info["tip"])
            # At least its own chain and the root; cross-citations pull in parts of the other chains.
            assert report.receipts_checked >= PER_WRITER + 1
