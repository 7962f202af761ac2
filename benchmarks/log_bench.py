"""The transparency log's cost and its proofs (docs/transparency.md), on this machine, in about two minutes.

    python benchmarks/log_bench.py [--quick] [--sample N] [--keep]

(a) Appends/s through ``Store.append`` (one receipt per transaction, as the runners append) and ``append_many``
    (batches of 1000), for three stores on the same receipts: without the log and signatures (the log step replaced
    by a no-op: what the store did before schema 0004), with the log, and with the log and Ed25519 signatures (one
    per transaction of up to 1,024 receipts, ledger/signing.py's batch signature; a receipt appended alone is signed
    alone). The three stores take turns chunk by chunk and median rates are compared. Target: signed and logged
    appends at least 0.7x the rate without them.
(b) Proof sizes and times at 10^3, 10^5 and 10^6 leaves in memory: benchmarks/log_bench_proofs.py, run as it is.
(c) The same from a ledger of 10^6 receipts on disk: inclusion and consistency proofs read from ``log_nodes``
    (node reads counted), generated and verified. Targets: inclusion proofs at most ceil(log2 n) hashes, consistency
    proofs at most ceil(log2 n) + 1, at most 2 ceil(log2 n) node reads per proof.
(d) Verifying that 10^6-receipt ledger against a head signed at 999,000 leaves: ``verify_head`` of every receipt
    (each id re-hashed from its body, each leaf recomputed and compared, the tree folded again, a consistency proof
    to the current size), and of 100 receipts by inclusion proofs. Target: the whole ledger in at most 60 s.
    Signature checks run at a separate measured rate (e): one Ed25519 verification per batch signature, and every
    receipt's leaf recomputed from its id and signature.

The 10^6-receipt ledger is written with plain sqlite3 (receipt rows, leaves and nodes computed with ledger.merkle
and ledger.tlog, unsigned): appending it through the store would take minutes and measures nothing new. Everything
lives in a temporary directory, deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ledger import digests, merkle, note, tlog
from ledger import transparency as tp
from ledger.receipts import Receipt
from ledger.signing import generate_key
from ledger.store import Store
from verify import transparency as vt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger_bench  # noqa: E402  (the realistic receipts of benchmarks/ledger_bench.py)
import log_bench_proofs  # noqa: E402

TARGET_APPEND_RATIO = 0.7
TARGET_VERIFY_S = 60.0
BIG = 10**6
HEAD_AT = 999_000
ROUNDS = 10


def ceil_log2(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------------------- (a) appends


def _no_log(conn: object, entries: Sequence[object]) -> int:
    return 0


def append_rates(work: Path, single: int, batched: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median rates (receipts/s) per mode and configuration: the three stores are open side by side and take turns
    chunk by chunk (``rounds`` chunks of single appends, one batch of 1000 at a time), so that a stall of the disk or
    another process's load falls on all three alike."""
    signer = generate_key("bench-operator")
    real = tlog.append_leaves
    configs: dict[str, tuple[bool, note.Signer | None]] = {"without": (False, None), "log": (True, None),
                                                           "log+signing": (True, signer)}
    stores, work_of = {}, {}
    for name, (_, key) in configs.items():
        root = ledger_bench.root_receipt()
        stores[name] = Store.open(work / f"append-{name}.db", create=True, signer=key)
        stores[name].append(root)
        work_of[name] = ledger_bench.chain(root, single + batched, run=f"bench-{name}")
    samples: dict[str, dict[str, list[float]]] = {m: {c: [] for c in configs} for m in ("single", "batched")}

    def timed_append(name: str, chunk: Sequence[Receipt], many: bool) -> float:
        tlog.append_leaves = real if configs[name][0] else _no_log
        try:
            t0 = time.perf_counter()
            if many:
                stores[name].append_many(chunk)
            else:
                for r in chunk:
                    stores[name].append(r)
            return len(chunk) / (time.perf_counter() - t0)
        finally:
            tlog.append_leaves = real

    per = single // rounds
    for i in range(rounds):
        for name in configs:
            samples["single"][name].append(timed_append(name, work_of[name][i * per:(i + 1) * per], False))
    for i in range(single, single + batched, ledger_bench.BATCH):
        for name in configs:
            samples["batched"][name].append(timed_append(name, work_of[name][i:i + ledger_bench.BATCH], True))
    for name, store in stores.items():
        if configs[name][0]:  # the log the appends built has every receipt
            assert tp.current_checkpoint(store).size == store.count()
        store.close()
    return {m: {c: statistics.median(v) for c, v in by.items()} for m, by in samples.items()}


# -------------------------------------------------------------------------------------- (c) the big ledger


_TEMPLATE = ('{"alg":"blake3","artifacts":{},"kind":"note","measurements":{"i":%d,"phase":"bench"},"parents":[],'
             '"prepared":null,"rank":null,"run":null,"selection":null,"step":null,"v":1}')


def build_big(path: Path, n: int) -> tuple[list[str], float]:
    """A ledger of ``n`` parentless note receipts and their log, written with plain sqlite3; returns the ids.

    The same rows the store would write (tlog.leaf_hash, tlog.node_pos, merkle's fold), with a 1.5 GB page cache
    and no journal: the receipts' unique id index takes random inserts, which a small cache turns into disk seeks.
    """
    Store.open(path, create=True).close()
    t0 = time.perf_counter()
    con = sqlite3.connect(path, isolation_level=None)
    for pragma in ("PRAGMA journal_mode=DELETE", "PRAGMA journal_mode=OFF", "PRAGMA synchronous=OFF",
                   "PRAGMA cache_size=-1500000"):
        con.execute(pragma)
    con.execute("BEGIN")
    stack: list[bytes] = []
    ids: list[str] = []
    chunk = 100_000
    sha = hashlib.sha256
    for start in range(0, n, chunk):
        rows, leaves, nodes = [], [], []
        pos = tlog.node_pos(0, start)
        for i in range(start, min(n, start + chunk)):
            body = (_TEMPLATE % i).encode()
            rid = digests.receipt_id(body)
            ids.append(rid)
            rows.append((i + 1, rid, "note", body))
            leaves.append((i, i + 1))
            h = tlog.leaf_hash(rid)
            nodes.append((pos, 0, i, h))
            level, j = 0, i
            while j & 1:
                h = sha(b"\x01" + stack.pop() + h).digest()
                level, j, pos = level + 1, j >> 1, pos + 1
                nodes.append((pos, level, j, h))
            stack.append(h)
            pos += 1
        con.executemany("INSERT INTO receipts (seq, id, kind, body, recorded_ns) VALUES (?, ?, ?, ?, 0)", rows)
        con.executemany("INSERT INTO log_leaves (leaf_index, receipt_seq) VALUES (?, ?)", leaves)
        con.executemany("INSERT INTO log_nodes (pos, level, idx, hash) VALUES (?, ?, ?, ?)", nodes)
    con.execute("COMMIT")
    con.execute("PRAGMA journal_mode=WAL")
    con.close()
    Receipt.from_bytes((_TEMPLATE % 0).encode())  # the template is a canonical receipt
    with Store.open(path) as store, store.reading() as conn:  # the rows are the log the store would build
        m = min(n, 4096 + 17)
        assert merkle.root_at(tlog.DbNodes(conn), m) == merkle.root_from_leaves([tlog.leaf_hash(r) for r in ids[:m]])
    return ids, time.perf_counter() - t0


def db_proofs(store: Store, ids: list[str], sample: int, rng: random.Random) -> bool:
    ok = True
    print(f"{'leaves':>9} {'ceil':>4} {'incl max':>8} {'cons max':>8} {'reads max':>9} {'incl gen us':>11} "
          f"{'incl ver us':>11} {'cons gen us':>11} {'cons ver us':>11}")
    with store.reading() as conn:
        nodes = tlog.DbNodes(conn)
        for n in (10**3, 10**5, BIG):
            root = merkle.root_at(nodes, n)
            bound = ceil_log2(n)
            reads = 0
            leaves = [0, n - 1] + [rng.randrange(n) for _ in range(sample)]
            t0 = time.perf_counter()
            proofs = []
            for i in leaves:
                nodes.reads = 0
                proofs.append(merkle.inclusion_proof(nodes, i, n))
                reads = max(reads, nodes.reads)
            t1 = time.perf_counter()
            for i, proof in zip(leaves, proofs, strict=True):
                merkle.verify_inclusion(tlog.leaf_hash(ids[i]), i, n, proof, root)
            t2 = time.perf_counter()
            sizes = [1, 3, n - 1] + [rng.randrange(1, n) for _ in range(sample)]
            roots = {m: merkle.root_at(nodes, m) for m in sizes}
            t3 = time.perf_counter()
            cproofs = []
            for m in sizes:
                nodes.reads = 0
                cproofs.append(merkle.consistency_proof(nodes, m, n))
                reads = max(reads, nodes.reads)
            t4 = time.perf_counter()
            for m, proof in zip(sizes, cproofs, strict=True):
                merkle.verify_consistency(m, n, proof, roots[m], root)
            t5 = time.perf_counter()
            incl_max, cons_max = max(map(len, proofs)), max(map(len, cproofs))
            print(f"{n:>9} {bound:>4} {incl_max:>8} {cons_max:>8} {reads:>9} "
                  f"{(t1 - t0) / len(leaves) * 1e6:>11.1f} {(t2 - t1) / len(leaves) * 1e6:>11.1f} "
                  f"{(t4 - t3) / len(sizes) * 1e6:>11.1f} {(t5 - t4) / len(sizes) * 1e6:>11.1f}")
            checks = ((incl_max <= bound, f"inclusion proofs at most ceil(log2 n) = {bound} hashes (max {incl_max})"),
                      (cons_max <= bound + 1, f"consistency proofs at most ceil(log2 n) + 1 = {bound + 1} hashes "
                                              f"(max {cons_max})"),
                      (reads <= 2 * bound, f"node reads per proof at most 2 ceil(log2 n) = {2 * bound} (max {reads})"))
            for good, text in checks:
                ok &= good
                print(f"  {verdict(good)} {text}")
    return ok


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def _cleanup(work: Path, keep: bool) -> None:
    if not keep:
        import shutil

        shutil.rmtree(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller append runs and 10^5 leaves on disk")
    parser.add_argument("--sample", type=int, default=200, help="proofs of each kind per size (default 200)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--appends", action="store_true", help="only (a), the append rates, and signing's cost")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    ok = True
    work = Path(tempfile.mkdtemp(prefix="log-bench-"))
    print(f"work directory {work}")

    single, batched = (200, 5000) if args.quick else (800, 20_000)
    print(f"\n(a) appends: {single} one per transaction in {ROUNDS} chunks, {batched} in batches of "
          f"{ledger_bench.BATCH}; the three stores take turns chunk by chunk; median rates")
    rates = append_rates(work, single, batched, ROUNDS)
    print(f"{'mode':<10} {'without /s':>11} {'log /s':>9} {'log+sign /s':>12} {'log/without':>12} "
          f"{'log+sign/without':>17}  target")
    for mode, r in rates.items():
        log_ratio, signed_ratio = r["log"] / r["without"], r["log+signing"] / r["without"]
        good = signed_ratio >= TARGET_APPEND_RATIO
        ok &= good
        print(f"{mode:<10} {r['without']:>11.0f} {r['log']:>9.0f} {r['log+signing']:>12.0f} {log_ratio:>11.3f}x "
              f"{signed_ratio:>16.3f}x  >= {TARGET_APPEND_RATIO}x {verdict(good)}")

    ids = [r.id for r in ledger_bench.chain(ledger_bench.root_receipt(), 5000, run="sign-only")]
    _, sign_s = timed(lambda: tlog.sign_ids(generate_key("bench-operator"), ids))  # one call: signed here
    per_sign, per_batched = sign_s / len(ids) * 1e6, 1e6 / rates["batched"]["without"]
    print(f"  Ed25519 batch signing alone: {per_sign:.1f} us per receipt, {per_sign / per_batched:.2f}x the whole "
          f"of an unsigned batched append ({per_batched:.1f} us)")
    if args.appends:
        _cleanup(work, args.keep)
        print(f"\n{verdict(ok)} overall")
        return 0 if ok else 1

    print("\n(b) proofs in memory (benchmarks/log_bench_proofs.py)")
    ok &= log_bench_proofs.main(["--sample", str(args.sample)]) == 0

    n = 10**5 if args.quick else BIG
    path = work / "big.db"
    ids, build_s = build_big(path, n)
    print(f"\n(c) proofs from a ledger of {n} receipts on disk (written in {build_s:.1f} s, "
          f"{path.stat().st_size / 1e6:.0f} MB)")
    with Store.open(path) as store:
        if n == BIG:
            ok &= db_proofs(store, ids, args.sample, rng)
        origin = tp.log_origin(store)
        signer = generate_key("bench-operator")
        with store.reading() as conn:
            head_at = min(HEAD_AT, n - 1000)
            head = note.sign_checkpoint(note.Checkpoint(origin, head_at, merkle.root_at(tlog.DbNodes(conn), head_at)),
                                        signer)
        print(f"\n(d) verifying the {n}-receipt ledger against a head of {head_at} leaves")
        report, full_s = timed(lambda: vt.verify_head(store, head, trusted=[signer.verifier]))
        assert isinstance(report, vt.HeadReport) and report.included == n
        some = [ids[rng.randrange(n)] for _ in range(100)]
        _, some_s = timed(lambda: vt.verify_head(store, head, trusted=[signer.verifier], receipts=some))
        good = full_s <= TARGET_VERIFY_S
        ok &= good
        print(f"  every receipt: {full_s:.1f} s ({n / full_s:,.0f} receipts/s; consistency proof of "
              f"{report.proof_hashes} hashes)  target <= {TARGET_VERIFY_S:.0f} s {verdict(good)}")
        print(f"  100 receipts by inclusion proofs: {some_s * 1e3:.0f} ms ({some_s / 100 * 1e3:.2f} ms each)")

    small = work / "signed.db"
    m = 5000
    with Store.open(small, create=True, signer=signer) as store:
        tp.register_key(store, signer)
        root = ledger_bench.root_receipt()
        store.append_many([root, *ledger_bench.chain(root, m - 1)])
        _, sig_s = timed(lambda: vt.check_signatures(store, require=True))
    print(f"\n(e) signature checks: {m} signed receipts in {sig_s:.2f} s ({m / sig_s:,.0f} receipts/s); at that rate "
          f"10^6 would take {BIG / (m / sig_s):.0f} s more")

    _cleanup(work, args.keep)
    print(f"\n{verdict(ok)} overall")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
