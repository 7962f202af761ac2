"""Four OS processes append into one ledger at once, on SQLite and on PostgreSQL: nothing lost, nothing twice, no
error, chains intact, the transparency log in append order.

Each writer chains its own receipts and, every few appends, reads the latest committed receipt of another writer
(a read before the write, under contention) and cites it. With deferred transactions this is the case that forks
chains or fails with "database is locked"; the store's writers take the write lock first (SQLite ``BEGIN
IMMEDIATE``, a PostgreSQL transaction-level advisory lock) and must make it clean. On PostgreSQL the writers reach
the server through its socket, as ranks on other hosts reach it through the network.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import pytest

from ledger import digests
from ledger.digests import prepared_digest
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.pg import raw_rows
from verify.receipts import verify_receipt

WRITERS = 4
# Appends per writer. PostgreSQL's case is smaller to keep the suite's time: the same 4 x 2,000 on PostgreSQL, with
# the same checks, is `python benchmarks/ledger_bench.py --postgres` (benchmarks/README.md).
PER_WRITER = {"sqlite": 2000, "postgresql": 500}
CITE_EVERY = 7  # every 7th receipt also cites another writer's latest committed receipt
# The bulk is one receipt per transaction (the contended case); the last fifth of each writer's receipts go through
# append_many in batches of BATCH, so batches contend with single appends too.
BATCH = 20

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


def _writer(db: str, w: int, per_writer: int, start: Any, results: Any) -> None:
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
        batched = per_writer // 5
        for step in range(per_writer):
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
            if len(parents) > 1 or step < per_writer - batched:
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
        results.put(("ok", w, {"appended": per_writer, "cited": cited, "tip": prev.id,
                               "seconds": time.perf_counter() - t0}))
        store.close()
    except BaseException:  # report everything: the parent asserts no exception reached any writer
        results.put(("error", w, traceback.format_exc()))


@pytest.mark.slow
def test_four_processes_append_into_one_ledger(ledger_url: str, backend: str) -> None:
    db, per_writer = ledger_url, PER_WRITER[backend]
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db, w, per_writer, start, results)) for w in range(WRITERS)]
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
    assert all(info["appended"] == per_writer for info in by_writer.values())
    assert all(info["cited"] > 0 for info in by_writer.values()), by_writer  # cross-writer reads really happened
    print(f"\n{backend}: {WRITERS * per_writer} appends by {WRITERS} processes in {elapsed:.1f} s; "
          + ", ".join(f"w{w}: {i['seconds']:.1f} s, {i['cited']} cross-citations" for w, i in by_writer.items()))

    def one(sql: str) -> tuple[object, ...]:
        (row,) = raw_rows(db, sql)
        return row

    if backend == "sqlite":  # PostgreSQL has no file to check; its constraints were enforced at every insert
        assert raw_rows(db, "PRAGMA integrity_check") == [("ok",)]
    assert one("SELECT count(*) FROM receipts") == (WRITERS * per_writer + 1,)
    assert one("SELECT count(*) FROM receipts WHERE kind = 'note'") == (WRITERS * per_writer,)
    assert one("SELECT count(*) FROM receipts WHERE kind = 'prepare'") == (1,)
    assert one("SELECT count(DISTINCT id) FROM receipts") == (WRITERS * per_writer + 1,)
    per_run = dict(raw_rows(db, "SELECT run, count(DISTINCT step) FROM receipts WHERE kind = 'note' GROUP BY run"))
    assert per_run == {_run(w): per_writer for w in range(WRITERS)}
    dangling = one("SELECT count(*) FROM receipt_parents e LEFT JOIN receipts r ON r.seq = e.parent_seq "
                   "WHERE r.seq IS NULL")
    assert dangling == (0,)
    edges = one("SELECT count(*) FROM receipt_parents")[0]
    cited = sum(info["cited"] for info in by_writer.values())
    assert edges == WRITERS * per_writer + cited  # one edge to the previous receipt, plus each cross-citation
    # A parent is always stored before its child: the append order respects the DAG.
    assert one("SELECT count(*) FROM receipt_parents WHERE parent_seq >= child_seq") == (0,)
    # The log has one leaf per receipt, indexes 0..n-1 in seq order: commits were serialized in seq order (on
    # PostgreSQL a sequence hands out seqs before commit, so only the write lock makes this hold).
    leaves = raw_rows(db, "SELECT leaf_index, receipt_seq FROM log_leaves ORDER BY leaf_index")
    seqs = [seq for (seq,) in raw_rows(db, "SELECT seq FROM receipts ORDER BY seq")]
    assert leaves == list(enumerate(seqs))

    with Store.open(db) as store:
        for w, info in by_writer.items():
            tip = store.find(run=_run(w), step=per_writer - 1)
            assert [s.receipt.id for s in tip] == [info["tip"]]
            report = verify_receipt(store, info["tip"])
            # At least its own chain and the root; cross-citations pull in parts of the other chains.
            assert report.receipts_checked >= per_writer + 1
