"""A writer killed with SIGKILL at random moments never damages the ledger or loses a receipt whose append returned.

Each trial starts a writer process that appends receipts in a loop (single appends and batches) and prints every id
after its append returns; the test kills it after a seeded random delay, then opens the database and checks it:
it opens, ``PRAGMA integrity_check`` is ok, every printed id is there and the last one verifies. Trials run in
series on a few files, so a later trial reopens a file whose writer was killed and keeps appending to it.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ledger import digests
from ledger.digests import prepared_digest
from ledger.receipts import make_receipt
from ledger.store import Store
from verify.receipts import verify_receipt

TRIALS = 24
TRIALS_PER_FILE = 3  # trials 2 and 3 of each file reopen a database whose writer was killed
SEED = 20260611
ARTIFACTS = {"data": digests.raw_digest(b"crash data"), "config": digests.raw_digest(b"crash config")}
PREPARED = prepared_digest(ARTIFACTS)

# The writer: append forever (until killed), printing each id once its append (its commit) has returned.
WRITER = r"""
import random, sys, time
from ledger import digests
from ledger.digests import prepared_digest
from ledger.receipts import make_receipt
from ledger.store import Store

db, run, seed, cite = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
artifacts = {"data": digests.raw_digest(b"crash data"), "config": digests.raw_digest(b"crash config")}
prepared = prepared_digest(artifacts)
store = Store.open(db)
root = store.append(make_receipt("prepare", prepared=prepared, artifacts=artifacts)).receipt
rng = random.Random(seed)
prev = [root, *cite]
step = 0
print("ready", flush=True)
deadline = time.monotonic() + 30  # never outlive a broken test
while time.monotonic() < deadline:
    batch = []
    for _ in range(1 if rng.random() < 0.5 else rng.randint(2, 40)):
        r = make_receipt("note", run=run, step=step, prepared=prepared, parents=prev,
                         artifacts={"out": digests.raw_digest(b"%s/%d" % (run.encode(), step))},
                         measurements={"loss": 1.0 / (step + 1), "pad": "x" * rng.randint(0, 300)})
        batch.append(r)
        prev = [r]
        step += 1
    if len(batch) == 1:
        store.append(batch[0])
    else:
        store.append_many(batch)
    sys.stdout.write("".join(r.id + "\n" for r in batch))
    sys.stdout.flush()
"""


def _run_writer(db: Path, run: str, seed: int, delay: float, cite: list[str]) -> list[str]:
    """Start a writer, SIGKILL it ``delay`` seconds after it starts appending; return every id it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), run, str(seed), *cite],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # drain stdout continuously so the writer never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            if line == "ready\n":
                ready.set()
            else:
                lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        if not ready.wait(timeout=60):
            proc.kill()
            raise AssertionError(f"writer never started: {proc.stderr.read()}")
        time.sleep(delay)
        assert proc.poll() is None, f"writer exited on its own: {proc.stderr.read()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    # A line cut short by the kill has no newline: its append returned but the print did not finish.
    return [line[:-1] for line in lines if line.endswith("\n")]


@pytest.mark.slow
def test_sigkilled_writer_loses_nothing_that_returned(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    total_printed = 0
    cite: list[str] = []
    t0 = time.perf_counter()
    for trial in range(TRIALS):
        db = tmp_path / f"ledger-{trial // TRIALS_PER_FILE}.db"
        if trial % TRIALS_PER_FILE == 0:
            Store.open(db, create=True).close()
            cite = []
        delay = rng.uniform(0.05, 0.5)
        printed = _run_writer(db, f"trial-{trial}", rng.randrange(2**32), delay, cite)
        total_printed += len(printed)

        con = sqlite3.connect(db)
        try:
            assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)], f"trial {trial}"
            stored = {row[0] for row in con.execute("SELECT id FROM receipts")}
        finally:
            con.close()
        missing = [rid for rid in printed if rid not in stored]
        assert not missing, f"trial {trial} (killed after {delay:.3f} s): {len(missing)} returned appends lost"

        with Store.open(db) as store:
            if printed:
                verify_receipt(store, printed[-1])
            # Whatever the writer committed without printing is a whole, valid receipt too.
            newest = store.find(run=f"trial-{trial}")
            if newest:
                verify_receipt(store, newest[-1].receipt.id)
            # The killed writer left the file writable: append one receipt that the next trial's writer cites.
            parent = newest[-1].receipt if newest else store.find(kind="prepare")[0].receipt
            after = make_receipt("note", run=f"after-{trial}", step=0, prepared=PREPARED, parents=[parent],
                                 measurements={"trial": trial})
            store.append(after)
            assert store.contains(after.id)
            cite = [after.id]
    elapsed = time.perf_counter() - t0
    print(f"\n{TRIALS} SIGKILL trials, {total_printed} returned appends checked, {elapsed:.1f} s")
    assert total_printed > TRIALS  # the kills landed while appends were happening, not before the first one
