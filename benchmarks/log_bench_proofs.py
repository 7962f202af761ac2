"""Merkle log proofs (ledger/merkle.py): build time, proof sizes and verification time at 10^3, 10^5, 10^6 leaves.

Each tree is built leaf by leaf with the incremental API (merkle.append) into an in-memory node table, the way the
store maintains its table inside the append transaction. For a sample of leaves and of earlier sizes it prints the
largest inclusion and consistency proof against ceil(log2 n), the mean time to generate and verify one, and PASS/FAIL
for the bounds: inclusion proofs have at most ceil(log2 n) hashes; consistency proofs at most ceil(log2 n) + 1 (when
the old size is not a power of two the proof also carries the old tree's last complete subtree, so ceil(log2 n) alone
is not an upper bound: m=3, n=4 needs 3 hashes).

    python benchmarks/log_bench_proofs.py            # about 15 s on a 2-core CPU
    python benchmarks/log_bench_proofs.py --sample 2000
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time

from ledger import merkle


def ceil_log2(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def build(n: int) -> tuple[list[bytes], merkle.Frontier, merkle.MemoryNodes, float, float]:
    t0 = time.perf_counter()
    leaves = [merkle.leaf_hash(hashlib.sha256(i.to_bytes(8, "big")).digest()) for i in range(n)]
    t1 = time.perf_counter()
    frontier, table = merkle.Frontier(), merkle.MemoryNodes()
    for leaf in leaves:
        frontier, new = merkle.append(frontier, leaf)
        table.add(new)
    t2 = time.perf_counter()
    return leaves, frontier, table, t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=500, help="proofs of each kind per size (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    ok = True
    print(f"{'leaves':>9} {'build s':>8} {'nodes':>9} {'ceil':>4} {'incl max':>8} {'cons max':>8} "
          f"{'incl gen us':>11} {'incl ver us':>11} {'cons gen us':>11} {'cons ver us':>11}")
    for n in (10**3, 10**5, 10**6):
        leaves, frontier, table, hash_s, build_s = build(n)
        root = merkle.root_of_frontier(frontier)
        assert merkle.root_at(table, n) == root
        bound = ceil_log2(n)

        indices = [0, n - 1, n // 2] + [rng.randrange(n) for _ in range(args.sample)]
        proofs, t0 = [], time.perf_counter()
        for m in indices:
            proofs.append(merkle.inclusion_proof(table, m, n))
        t1 = time.perf_counter()
        for m, proof in zip(indices, proofs, strict=True):
            merkle.verify_inclusion(leaves[m], m, n, proof, root)
        t2 = time.perf_counter()
        incl_max = max(len(p) for p in proofs)
        incl_gen, incl_ver = (t1 - t0) / len(indices) * 1e6, (t2 - t1) / len(indices) * 1e6

        sizes = [1, 3, n - 1, n // 3] + [rng.randrange(1, n) for _ in range(args.sample)]
        roots = {m: merkle.root_at(table, m) for m in sizes}
        cproofs, t0 = [], time.perf_counter()
        for m in sizes:
            cproofs.append(merkle.consistency_proof(table, m, n))
        t1 = time.perf_counter()
        for m, proof in zip(sizes, cproofs, strict=True):
            merkle.verify_consistency(m, n, proof, roots[m], root)
        t2 = time.perf_counter()
        cons_max = max(len(p) for p in cproofs)
        cons_gen, cons_ver = (t1 - t0) / len(sizes) * 1e6, (t2 - t1) / len(sizes) * 1e6

        print(f"{n:>9} {build_s:>8.2f} {len(table):>9} {bound:>4} {incl_max:>8} {cons_max:>8} "
              f"{incl_gen:>11.1f} {incl_ver:>11.1f} {cons_gen:>11.1f} {cons_ver:>11.1f}")
        if n == 10**6:
            print(f"  10^6 tree: {build_s:.2f} s to append {n} leaf hashes ({build_s / n * 1e6:.2f} us each, "
                  f"{len(table)} nodes), plus {hash_s:.2f} s to hash the leaves")
        incl_ok, cons_ok = incl_max <= bound, cons_max <= bound + 1
        ok &= incl_ok and cons_ok
        print(f"  {'PASS' if incl_ok else 'FAIL'} inclusion proofs at most ceil(log2 n) = {bound} hashes "
              f"(max {incl_max} over {len(indices)})")
        print(f"  {'PASS' if cons_ok else 'FAIL'} consistency proofs at most ceil(log2 n) + 1 = {bound + 1} hashes "
              f"(max {cons_max} over {len(sizes)}; {sum(len(p) > bound for p in cproofs)} exceed ceil(log2 n))")
        del leaves, table, proofs, cproofs
    print("PASS" if ok else "FAIL", "proofs within their bounds")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
