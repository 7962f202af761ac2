"""RFC 9162 Merkle tree (ledger/merkle.py): the transparency-dev vectors, the RFC's recursive definitions, and
properties of the incremental node table."""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import merkle
from ledger.errors import InputError, VerificationError
from ledger.transparency_errors import ConsistencyProofInvalid, InclusionProofInvalid, InvalidTreeRange


def shared_vectors() -> Path | None:
    """shared/vectors beside the checkout, else $LEDGER_SHARED_DIR/vectors."""
    for base in (Path(__file__).resolve().parents[3] / "shared", os.environ.get("LEDGER_SHARED_DIR")):
        if base and (Path(base) / "vectors").is_dir():
            return Path(base) / "vectors"
    return None


def require_vectors(sub: str) -> Path:
    root = shared_vectors()
    if root is None or not (root / sub).is_dir():
        message = f"shared/vectors/{sub} not found (set LEDGER_SHARED_DIR)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return root / sub


def _vector_files() -> list[Path]:
    root = shared_vectors()
    return sorted((root / "rfc6962").rglob("*.json")) if root else []


VECTORS = _vector_files()
B = base64.b64decode

# RFC 6962 §2.1.3 reference tree: 8 leaves.
REFERENCE_LEAVES = [bytes.fromhex(h) for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657",
                                               "606162636465666768696a6b6c6d6e6f")]


def check_vector(v: dict[str, Any]) -> None:
    proof = [B(p) for p in v["proof"] or []]
    if "leafIdx" in v:
        merkle.verify_inclusion(B(v["leafHash"]), v["leafIdx"], v["treeSize"], proof, B(v["root"]))
    else:
        merkle.verify_consistency(v["size1"], v["size2"], proof, B(v["root1"]), B(v["root2"]))


def test_vectors_are_present() -> None:
    root = require_vectors("rfc6962")
    files = sorted(root.rglob("*.json"))
    assert len(files) == len(VECTORS) > 150
    assert sum(not json.loads(f.read_text())["wantErr"] for f in files) == 12


@pytest.mark.parametrize("path", VECTORS, ids=[str(p.relative_to(p.parents[2])) for p in VECTORS])
def test_rfc6962_vector(path: Path) -> None:
    v = json.loads(path.read_text())
    if v["wantErr"]:
        with pytest.raises((InclusionProofInvalid, ConsistencyProofInvalid)) as info:
            check_vector(v)
        assert isinstance(info.value, VerificationError)
        assert "\n" not in str(info.value)
    else:
        check_vector(v)


def test_reference_tree_root_and_happy_paths_regenerate() -> None:
    """Our proof generator reproduces the vectors' happy-path proofs from the reference leaves."""
    root = require_vectors("rfc6962")
    leaves = [merkle.leaf_hash(d) for d in REFERENCE_LEAVES]
    _, table = merkle.build(leaves)
    assert base64.b64encode(merkle.root_at(table, 8)).decode() == "XcnaeacGWamtVZy3Ad7ZoqudgjqtL0lgz+Nw7/RgQyg="
    for path in sorted(root.rglob("happy-path.json")):
        v = json.loads(path.read_text())
        want = [B(p) for p in v["proof"] or []]
        if "leafIdx" in v:
            assert merkle.inclusion_proof(table, v["leafIdx"], v["treeSize"]) == want
            assert merkle.root_at(table, v["treeSize"]) == B(v["root"])
        elif v["size1"] != v["size2"]:
            assert merkle.consistency_proof(table, v["size1"], v["size2"]) == want


# ------------------------------------------------------------------------ the RFC's recursive definitions


def ref_path(m: int, leaves: Sequence[bytes]) -> list[bytes]:
    """RFC 9162 §2.1.3.1 PATH(m, D[n]), literally."""
    n = len(leaves)
    if n == 1:
        return []
    k = 1 << ((n - 1).bit_length() - 1)
    if m < k:
        return ref_path(m, leaves[:k]) + [merkle.root_from_leaves(leaves[k:])]
    return ref_path(m - k, leaves[k:]) + [merkle.root_from_leaves(leaves[:k])]


def ref_subproof(m: int, leaves: Sequence[bytes], complete: bool) -> list[bytes]:
    """RFC 9162 §2.1.4.1 SUBPROOF(m, D[n], b), literally."""
    n = len(leaves)
    if m == n:
        return [] if complete else [merkle.root_from_leaves(leaves)]
    k = 1 << ((n - 1).bit_length() - 1)
    if m <= k:
        return ref_subproof(m, leaves[:k], complete) + [merkle.root_from_leaves(leaves[k:])]
    return ref_subproof(m - k, leaves[k:], False) + [merkle.root_from_leaves(leaves[:k])]


def leaves_for(n: int, salt: bytes = b"") -> list[bytes]:
    return [merkle.leaf_hash(salt + i.to_bytes(4, "big")) for i in range(n)]


LEAVES_300 = leaves_for(300)
FRONTIERS: list[merkle.Frontier] = []
TABLE = merkle.MemoryNodes()
_f = merkle.Frontier()
FRONTIERS.append(_f)
for _leaf in LEAVES_300:
    _f, _new = merkle.append(_f, _leaf)
    TABLE.add(_new)
    FRONTIERS.append(_f)


def ceil_log2(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def test_incremental_roots_equal_reference_for_every_size_up_to_300() -> None:
    for n in range(301):
        want = merkle.root_from_leaves(LEAVES_300[:n])
        assert merkle.root_of_frontier(FRONTIERS[n]) == want, n
        assert merkle.root_at(TABLE, n) == want, n  # historical roots from the final table
        assert merkle.frontier_at(TABLE, n) == FRONTIERS[n], n


def test_empty_tree_root_is_sha256_of_nothing() -> None:
    assert merkle.root_of_frontier(merkle.Frontier()).hex() == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")


def test_append_yields_exactly_the_completed_nodes() -> None:
    """Node (l, i) is the root of leaves [i*2^l, (i+1)*2^l); n appends store 2n - popcount(n) nodes, no more."""
    assert len(TABLE) == 2 * 300 - (300).bit_count()
    for (level, index), h in TABLE.table.items():
        assert h == merkle.root_from_leaves(LEAVES_300[index << level:(index + 1) << level])
    frontier, new = merkle.append(FRONTIERS[7], LEAVES_300[7])
    assert [(n.level, n.index) for n in new] == [(0, 7), (1, 3), (2, 1), (3, 0)]
    assert frontier.hashes == (merkle.root_from_leaves(LEAVES_300[:8]),)


def test_proofs_match_the_rfc_definitions_and_verify_for_all_pairs_up_to_64() -> None:
    longest_consistency = 0
    for n in range(1, 65):
        root = merkle.root_from_leaves(LEAVES_300[:n])
        for m in range(n):
            proof = merkle.inclusion_proof(TABLE, m, n)
            assert proof == ref_path(m, LEAVES_300[:n])
            assert len(proof) <= ceil_log2(n)
            merkle.verify_inclusion(LEAVES_300[m], m, n, proof, root)
        for m in range(1, n + 1):
            proof = merkle.consistency_proof(TABLE, m, n)
            assert proof == ref_subproof(m, LEAVES_300[:n], True)
            # PROOF carries the old tree's last subtree when m is not a power of two: one more than the depth.
            assert len(proof) <= ceil_log2(n) + 1
            longest_consistency = max(longest_consistency, len(proof) - ceil_log2(n))
            merkle.verify_consistency(m, n, proof, merkle.root_from_leaves(LEAVES_300[:m]), root)
    assert longest_consistency == 1
    assert len(merkle.consistency_proof(TABLE, 3, 4)) == 3  # the bound is reached


def test_rfc6962_worked_examples() -> None:
    """RFC 6962 §2.1.3's 7-leaf tree: audit paths and consistency proofs, node by node, as the RFC lists them.
    PROOF(3, D[7]) has four nodes although ceil(log2 7) = 3: the RFC's bound for consistency is ceil(log2 n) + 1."""
    a, b, c, d, e, f, d6 = leaves_for(7, b"rfc")
    g, h, i = merkle.node_hash(a, b), merkle.node_hash(c, d), merkle.node_hash(e, f)
    j = d6
    k, l = merkle.node_hash(g, h), merkle.node_hash(i, j)  # noqa: E741
    _, table = merkle.build([a, b, c, d, e, f, d6])
    assert merkle.root_at(table, 7) == merkle.node_hash(k, l)
    assert merkle.inclusion_proof(table, 0, 7) == [b, h, l]
    assert merkle.inclusion_proof(table, 3, 7) == [c, g, l]
    assert merkle.inclusion_proof(table, 4, 7) == [f, j, k]
    assert merkle.inclusion_proof(table, 6, 7) == [i, k]
    assert merkle.consistency_proof(table, 3, 7) == [c, d, g, l]
    assert merkle.consistency_proof(table, 4, 7) == [l]
    assert merkle.consistency_proof(table, 6, 7) == [i, j, k]


class CountingReader:
    def __init__(self, inner: merkle.MemoryNodes) -> None:
        self.inner = inner
        self.reads = 0

    def node(self, level: int, index: int) -> bytes:
        self.reads += 1
        return self.inner.node(level, index)


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 255, 300])
def test_look_ups_are_logarithmic(n: int) -> None:
    reader = CountingReader(TABLE)  # no batch method: exercises the one-by-one path
    bound = 2 * ceil_log2(n) + 1
    for m in range(n):
        reader.reads = 0
        merkle.inclusion_proof(reader, m, n)
        assert reader.reads <= bound
    for m in range(1, n + 1):
        reader.reads = 0
        merkle.consistency_proof(reader, m, n)
        assert reader.reads <= bound + 1
    reader.reads = 0
    merkle.root_at(reader, n)
    assert reader.reads == n.bit_count()


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_a_flipped_bit_fails(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 300), label="size")
    m = data.draw(st.integers(0, n - 1), label="index")
    root = merkle.root_at(TABLE, n)
    proof = merkle.inclusion_proof(TABLE, m, n)
    target = data.draw(st.sampled_from(["leaf", "root", "proof"]))
    bit = data.draw(st.integers(0, 255))
    flip = lambda b: b[:bit // 8] + bytes([b[bit // 8] ^ (1 << bit % 8)]) + b[bit // 8 + 1:]  # noqa: E731
    leaf = LEAVES_300[m]
    if target == "leaf":
        leaf = flip(leaf)
    elif target == "root":
        root = flip(root)
    else:
        i = data.draw(st.integers(0, len(proof) - 1))
        proof[i] = flip(proof[i])
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(leaf, m, n, proof, root)

    m1 = data.draw(st.integers(1, n - 1), label="size1")
    cproof = merkle.consistency_proof(TABLE, m1, n)
    r1, r2 = merkle.root_at(TABLE, m1), merkle.root_at(TABLE, n)
    which = data.draw(st.sampled_from(["root1", "root2", "proof"]))
    if which == "root1":
        r1 = flip(r1)
    elif which == "root2":
        r2 = flip(r2)
    else:
        i = data.draw(st.integers(0, len(cproof) - 1))
        cproof[i] = flip(cproof[i])
    with pytest.raises(ConsistencyProofInvalid):
        merkle.verify_consistency(m1, n, cproof, r1, r2)


@settings(max_examples=100, deadline=None, database=None)
@given(n=st.integers(2, 300), data=st.data())
def test_proofs_for_other_positions_and_sizes_fail(n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(0, n - 1))
    proof = merkle.inclusion_proof(TABLE, m, n)
    root = merkle.root_at(TABLE, n)
    other = data.draw(st.integers(0, n - 1).filter(lambda x: x != m))
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(LEAVES_300[m], other, n, proof, root)
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(LEAVES_300[m], m, n, [*proof, proof[0]], root)
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(LEAVES_300[m], m, n, proof[:-1], root)
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(LEAVES_300[m], m, n, proof, merkle.root_at(TABLE, n - 1))


@settings(max_examples=50, deadline=None, database=None)
@given(leaves=st.lists(st.binary(max_size=40), max_size=70))
def test_arbitrary_leaf_data(leaves: list[bytes]) -> None:
    hashes = [merkle.leaf_hash(d) for d in leaves]
    frontier, table = merkle.build(hashes)
    assert merkle.root_of_frontier(frontier) == merkle.root_from_leaves(hashes)
    for m in range(len(hashes)):
        merkle.verify_inclusion(hashes[m], m, len(hashes), merkle.inclusion_proof(table, m, len(hashes)),
                                merkle.root_of_frontier(frontier))


def test_the_hash_function_is_a_parameter() -> None:
    """A BLAKE3 log runs the same algorithms; its roots differ from SHA-256's and its proofs only verify as BLAKE3."""
    b3 = merkle.TreeHasher("blake3", lambda d: blake3.blake3(d).digest(), 32)
    hashes = [merkle.leaf_hash(bytes([i]), b3) for i in range(23)]
    frontier, table = merkle.build(hashes, b3)
    root = merkle.root_of_frontier(frontier, b3)
    assert root == merkle.root_from_leaves(hashes, b3) != merkle.root_from_leaves(hashes)
    proof = merkle.inclusion_proof(table, 5, 23, b3)
    merkle.verify_inclusion(hashes[5], 5, 23, proof, root, b3)
    with pytest.raises(InclusionProofInvalid):
        merkle.verify_inclusion(hashes[5], 5, 23, proof, root)
    merkle.verify_consistency(9, 23, merkle.consistency_proof(table, 9, 23, b3), merkle.root_at(table, 9, b3),
                              root, b3)


def test_errors_carry_expected_and_actual() -> None:
    root = merkle.root_at(TABLE, 10)
    with pytest.raises(InclusionProofInvalid) as info:
        merkle.verify_inclusion(LEAVES_300[3], 3, 10, merkle.inclusion_proof(TABLE, 3, 10), bytes(32))
    assert info.value.expected == bytes(32).hex() and info.value.actual == root.hex()
    assert info.value.diagnostics()["error"] == "InclusionProofInvalid"
    with pytest.raises(InclusionProofInvalid) as info:
        merkle.verify_inclusion(LEAVES_300[3], 3, 10, [], root)
    assert (info.value.expected, info.value.actual) == (4, 0)
    with pytest.raises(ConsistencyProofInvalid, match="empty tree"):
        merkle.verify_consistency(0, 10, [], merkle.root_at(TABLE, 0), root)
    with pytest.raises(ConsistencyProofInvalid, match="first root") as cinfo:
        merkle.verify_consistency(5, 10, merkle.consistency_proof(TABLE, 5, 10), bytes(32), root)
    assert (cinfo.value.expected, cinfo.value.actual) == (bytes(32).hex(), merkle.root_at(TABLE, 5).hex())
    # a power-of-two first tree is the proof's seed itself, so a wrong root1 shows up in the second root
    with pytest.raises(ConsistencyProofInvalid, match="second root"):
        merkle.verify_consistency(4, 10, merkle.consistency_proof(TABLE, 4, 10), bytes(32), root)


def test_requests_outside_the_tree_are_input_errors() -> None:
    for call in (lambda: merkle.inclusion_proof(TABLE, 5, 5), lambda: merkle.consistency_proof(TABLE, 6, 5),
                 lambda: merkle.consistency_proof(TABLE, 0, 5), lambda: merkle.root_at(TABLE, -1),
                 lambda: merkle.append(merkle.Frontier(), b"short"),
                 lambda: merkle.Frontier(3, (bytes(32),))):
        with pytest.raises(InvalidTreeRange) as info:
            call()
        assert isinstance(info.value, InputError)


def test_batch_reader_is_used_when_offered() -> None:
    class Batch(merkle.MemoryNodes):
        calls = 0

        def nodes(self, addresses: Sequence[merkle.Address]) -> list[bytes]:
            Batch.calls += 1
            return super().nodes(addresses)

        def node(self, level: int, index: int) -> bytes:
            raise AssertionError("the batch method should be used")

    batch = Batch()
    batch.table = TABLE.table
    assert merkle.consistency_proof(batch, 37, 300) == merkle.consistency_proof(TABLE, 37, 300)
    assert Batch.calls == 1
    assert math.isfinite(len(merkle.inclusion_proof(batch, 0, 300)))
