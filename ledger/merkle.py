"""RFC 9162 (RFC 6962) Merkle tree: hashing, incremental maintenance for a node table, proofs and their verification.

Pure: no I/O. A store persists nodes; this module says which nodes exist, which to read, and what they prove.

Hashing (RFC 9162 §2.1.1): leaf = H(0x00 || data), node = H(0x01 || left || right), empty tree = H(""). The tree of
n leaves splits at k, the largest power of two smaller than n, so its shape is a function of n alone and a tree is
always a prefix of every later tree.

Addressing. Node (level, index) is the root of the perfect subtree over leaves [index * 2^level, (index+1) * 2^level);
level 0 holds the leaf hashes themselves. Such a node is complete once its last leaf is appended and never changes
afterwards, so a table of complete nodes is append-only, like the log. Every root, inclusion proof and consistency
proof of any size n <= current size is a right-fold of O(log n) of these nodes (at most about 2 log2 n look-ups):
the ``*_plan`` functions name them, and the proof functions fetch them through a :class:`NodeReader`.

Incremental append. A :class:`Frontier` is the compact range [0, size): the perfect subtrees whose sizes are the set
bits of size, largest first. :func:`append` adds one leaf hash and returns the new frontier and every node that
became complete (the leaf itself at level 0, then one node per trailing 1-bit of the old size), which is exactly
what a store inserts in the append transaction. The frontier can also be re-read from the table at any size
(:func:`frontier_at`), so a store need not persist it.

Verification follows RFC 9162 §2.1.3.2 (inclusion) and §2.1.4.2 (consistency) step by step and raises
:class:`~ledger.transparency_errors.InclusionProofInvalid` / ``ConsistencyProofInvalid``. A consistency proof from
size 0 is refused: the RFC defines proofs only for 0 < first (every tree extends the empty one, so there is nothing
to prove; the shared vectors expect this refusal).

Proof sizes: an inclusion proof has exactly depth-of-leaf <= ceil(log2 n) hashes. A consistency proof has at most
ceil(log2 n) + 1 hashes, and the +1 occurs (m=3, n=4: [h(2), h(3), h(0..1)]), because when m is not a power of two the
proof must also carry the old tree's last complete subtree.

The hash function is a parameter (:class:`TreeHasher`); SHA-256 is the default and what the ledger uses. A log that
hashes with BLAKE3 runs the same algorithms.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ledger.transparency_errors import ConsistencyProofInvalid, InclusionProofInvalid, InvalidTreeRange

Address = tuple[int, int]
"""(level, index) of a complete node."""

Span = tuple[Address, ...]
"""Perfect subtrees covering one RFC subtree, left to right (largest first); its hash is their right-fold."""


@dataclass(frozen=True)
class TreeHasher:
    """The tree's hash function: ``digest`` maps bytes to ``size`` bytes."""

    name: str
    digest: Callable[[bytes], bytes]
    size: int

    def leaf(self, data: bytes) -> bytes:
        return self.digest(b"\x00" + data)

    def node(self, left: bytes, right: bytes) -> bytes:
        return self.digest(b"\x01" + left + right)

    def empty_root(self) -> bytes:
        return self.digest(b"")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


SHA256 = TreeHasher("sha256", _sha256, 32)


def leaf_hash(data: bytes, hasher: TreeHasher = SHA256) -> bytes:
    """H(0x00 || data): the hash of a leaf whose entry is ``data``."""
    return hasher.leaf(data)


def node_hash(left: bytes, right: bytes, hasher: TreeHasher = SHA256) -> bytes:
    """H(0x01 || left || right): the hash of an interior node."""
    return hasher.node(left, right)


def _split(n: int) -> int:
    """The largest power of two smaller than n (n >= 2): where the RFC splits a tree of n leaves."""
    return 1 << ((n - 1).bit_length() - 1)


def root_from_leaves(leaf_hashes: Sequence[bytes], hasher: TreeHasher = SHA256) -> bytes:
    """MTH(D[n]) by the RFC's recursive definition, from the leaf hashes (the reference the tests compare with)."""
    n = len(leaf_hashes)
    if n == 0:
        return hasher.empty_root()
    if n == 1:
        return leaf_hashes[0]
    k = _split(n)
    return hasher.node(root_from_leaves(leaf_hashes[:k], hasher), root_from_leaves(leaf_hashes[k:], hasher))


# ------------------------------------------------------------------------------------------ incremental append


@dataclass(frozen=True, slots=True)
class Node:
    """A complete node: what a store's node table holds, keyed by (level, index)."""

    level: int
    index: int
    hash: bytes


@dataclass(frozen=True)
class Frontier:
    """The compact range [0, size): hashes of the perfect subtrees for the set bits of ``size``, largest first."""

    size: int = 0
    hashes: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.size < 0 or len(self.hashes) != self.size.bit_count():
            raise InvalidTreeRange("a frontier holds one hash per set bit of its size",
                                   expected=self.size.bit_count(), actual=len(self.hashes))


def append(frontier: Frontier, leaf: bytes, hasher: TreeHasher = SHA256) -> tuple[Frontier, list[Node]]:
    """Append one leaf hash: the new frontier and the nodes that became complete, lowest level first.

    The leaf becomes node (0, size); each trailing 1-bit of the old size merges it with the frontier's smallest
    subtree into one node a level up.
    """
    if len(leaf) != hasher.size:
        raise InvalidTreeRange(f"a leaf hash is {hasher.size} bytes", expected=hasher.size, actual=len(leaf))
    index = frontier.size
    hashes = list(frontier.hashes)
    nodes = [Node(0, index, leaf)]
    h, level, i = leaf, 0, index
    while i & 1:
        h = hasher.node(hashes.pop(), h)
        level += 1
        i >>= 1
        nodes.append(Node(level, i, h))
    hashes.append(h)
    return Frontier(index + 1, tuple(hashes)), nodes


def root_of_frontier(frontier: Frontier, hasher: TreeHasher = SHA256) -> bytes:
    """The tree's root from its compact range: fold the subtrees right to left."""
    return _fold(frontier.hashes, hasher) if frontier.size else hasher.empty_root()


def _fold(hashes: Sequence[bytes], hasher: TreeHasher) -> bytes:
    h = hashes[-1]
    for left in reversed(hashes[:-1]):
        h = hasher.node(left, h)
    return h


# ----------------------------------------------------------------------------------------- plans and readers


def _span(begin: int, end: int) -> Span:
    """The complete nodes covering the RFC subtree [begin, end), whose begin is aligned to its size's next power of
    two: one node per set bit of end - begin, largest first."""
    out = []
    pos, size = begin, end - begin
    for level in range(size.bit_length() - 1, -1, -1):
        if size >> level & 1:
            out.append((level, pos >> level))
            pos += 1 << level
    return tuple(out)


def root_plan(size: int) -> Span:
    """The nodes whose right-fold is the root of the tree of ``size`` leaves (empty for size 0)."""
    if size < 0:
        raise InvalidTreeRange("a tree size is >= 0", expected=">= 0", actual=size)
    return _span(0, size)


def inclusion_plan(index: int, size: int) -> list[Span]:
    """RFC 9162 §2.1.3.1 PATH(index, D[size]): one span per proof hash, from the leaf's sibling upwards."""
    if not 0 <= index < size:
        raise InvalidTreeRange("an inclusion proof needs 0 <= index < size", expected=f"< {size}", actual=index)
    path: list[Span] = []
    begin, end = 0, size
    while end - begin > 1:
        mid = begin + _split(end - begin)
        if index < mid:
            path.append(_span(mid, end))
            end = mid
        else:
            path.append(_span(begin, mid))
            begin = mid
    path.reverse()
    return path


def consistency_plan(size1: int, size2: int) -> list[Span]:
    """RFC 9162 §2.1.4.1 PROOF(size1, D[size2]) (SUBPROOF with b = true): one span per proof hash, innermost first."""
    if not 0 < size1 <= size2:
        raise InvalidTreeRange("a consistency proof needs 0 < size1 <= size2", expected=f"0 < size1 <= {size2}",
                               actual=size1)
    proof: list[Span] = []
    begin, end, complete = 0, size2, True
    while True:
        m, n = size1 - begin, end - begin
        if m == n:
            if not complete:  # the old tree's last subtree is not the root of anything the verifier holds
                proof.append(_span(begin, end))
            break
        k = _split(n)
        if m <= k:
            proof.append(_span(begin + k, end))
            end = begin + k
        else:
            proof.append(_span(begin, begin + k))
            begin += k
            complete = False
    proof.reverse()
    return proof


class NodeReader(Protocol):
    """Where complete nodes are read from (a database table, a dict). Missing nodes raise (KeyError or the store's
    own error); this module never asks for a node beyond the size it was given."""

    def node(self, level: int, index: int) -> bytes: ...


@runtime_checkable
class BatchNodeReader(Protocol):
    """A reader that can fetch many nodes at once (one SELECT ... WHERE (level, idx) IN ...); used when offered."""

    def node(self, level: int, index: int) -> bytes: ...

    def nodes(self, addresses: Sequence[Address]) -> list[bytes]: ...


class MemoryNodes:
    """An in-memory node table: the reader for tests and benchmarks."""

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self.table: dict[Address, bytes] = {}
        self.add(nodes)

    def add(self, nodes: Iterable[Node]) -> None:
        for n in nodes:
            self.table[(n.level, n.index)] = n.hash

    def node(self, level: int, index: int) -> bytes:
        return self.table[(level, index)]

    def nodes(self, addresses: Sequence[Address]) -> list[bytes]:
        return [self.table[a] for a in addresses]

    def __len__(self) -> int:
        return len(self.table)


def build(leaf_hashes: Iterable[bytes], hasher: TreeHasher = SHA256) -> tuple[Frontier, MemoryNodes]:
    """Append every leaf hash to an empty tree: the final frontier and the node table (a convenience for tests)."""
    frontier, table = Frontier(), MemoryNodes()
    for leaf in leaf_hashes:
        frontier, new = append(frontier, leaf, hasher)
        table.add(new)
    return frontier, table


def _read(reader: NodeReader, spans: Sequence[Span], hasher: TreeHasher) -> list[bytes]:
    addresses = [a for span in spans for a in span]
    if isinstance(reader, BatchNodeReader):
        values = reader.nodes(addresses)
    else:
        values = [reader.node(level, index) for level, index in addresses]
    out, pos = [], 0
    for span in spans:
        out.append(_fold(values[pos:pos + len(span)], hasher))
        pos += len(span)
    return out


def root_at(reader: NodeReader, size: int, hasher: TreeHasher = SHA256) -> bytes:
    """The root of the tree of ``size`` leaves (any size up to the table's), from popcount(size) look-ups."""
    plan = root_plan(size)
    return _read(reader, [plan], hasher)[0] if plan else hasher.empty_root()


def frontier_at(reader: NodeReader, size: int) -> Frontier:
    """The compact range of the tree of ``size`` leaves, re-read from the node table (to resume appending)."""
    plan = root_plan(size)
    if not plan:
        return Frontier()
    if isinstance(reader, BatchNodeReader):
        return Frontier(size, tuple(reader.nodes(plan)))
    return Frontier(size, tuple(reader.node(level, index) for level, index in plan))


def inclusion_proof(reader: NodeReader, index: int, size: int, hasher: TreeHasher = SHA256) -> list[bytes]:
    """The RFC 9162 inclusion proof of leaf ``index`` in the tree of ``size`` leaves."""
    return _read(reader, inclusion_plan(index, size), hasher)


def consistency_proof(reader: NodeReader, size1: int, size2: int, hasher: TreeHasher = SHA256) -> list[bytes]:
    """The RFC 9162 consistency proof from the tree of ``size1`` leaves to the tree of ``size2`` leaves."""
    return _read(reader, consistency_plan(size1, size2), hasher)


# ------------------------------------------------------------------------------------------------ verification


def _check_hashes(proof: Sequence[bytes], hasher: TreeHasher, fail: Callable[..., Exception]) -> None:
    for i, p in enumerate(proof):
        if not isinstance(p, bytes) or len(p) != hasher.size:
            raise fail(f"proof hash {i} is not a {hasher.size}-byte {hasher.name} digest", expected=hasher.size,
                       actual=len(p) if isinstance(p, bytes) else type(p).__name__)


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes,
                     hasher: TreeHasher = SHA256) -> None:
    """Check that ``leaf`` (a leaf hash) is leaf ``index`` of the tree of ``size`` with ``root`` (RFC 9162 §2.1.3.2).

    Returns None; raises InclusionProofInvalid naming what failed.
    """
    def fail(detail: str, *, expected: object = None, actual: object = None) -> InclusionProofInvalid:
        return InclusionProofInvalid(detail, index=index, size=size, expected=expected, actual=actual)

    if not 0 <= index < size:
        raise fail("the index is not below the tree size", expected=f"< {size}", actual=index)
    if len(leaf) != hasher.size:
        raise fail(f"the leaf hash is not a {hasher.size}-byte {hasher.name} digest", expected=hasher.size,
                   actual=len(leaf))
    _check_hashes(proof, hasher, fail)
    want = len(inclusion_plan(index, size))
    if len(proof) != want:
        raise fail("wrong number of proof hashes", expected=want, actual=len(proof))
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise fail("the proof is longer than the path to the root", expected=want, actual=len(proof))
        if fn & 1 or fn == sn:
            r = hasher.node(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = hasher.node(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise fail("the proof is shorter than the path to the root", expected=want, actual=len(proof))
    if r != root:
        raise fail("the recomputed root differs", expected=root, actual=r)


def verify_consistency(size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes,
                       hasher: TreeHasher = SHA256) -> None:
    """Check that the tree of ``size1`` with ``root1`` is a prefix of the tree of ``size2`` with ``root2``
    (RFC 9162 §2.1.4.2; equal sizes need an empty proof and equal roots).

    Returns None; raises ConsistencyProofInvalid naming what failed.
    """
    def fail(detail: str, *, expected: object = None, actual: object = None) -> ConsistencyProofInvalid:
        return ConsistencyProofInvalid(detail, size1=size1, size2=size2, expected=expected, actual=actual)

    if size1 <= 0:
        raise fail("a consistency proof from the empty tree proves nothing (RFC 9162 needs 0 < size1)",
                   expected="size1 > 0", actual=size1)
    if size2 < size1:
        raise fail("the second tree is smaller than the first", expected=f">= {size1}", actual=size2)
    if size1 == size2:
        if proof:
            raise fail("equal sizes need an empty proof", expected=0, actual=len(proof))
        if root1 != root2:
            raise fail("equal sizes but different roots", expected=root1, actual=root2)
        return
    _check_hashes(proof, hasher, fail)
    want = len(consistency_plan(size1, size2))
    if len(proof) != want:
        raise fail("wrong number of proof hashes", expected=want, actual=len(proof))
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # step 2: a power-of-two first tree is itself a node of the second
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise fail("the proof is longer than the path to the root", expected=want, actual=len(proof))
        if fn & 1 or fn == sn:
            fr = hasher.node(c, fr)
            sr = hasher.node(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = hasher.node(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise fail("the proof is shorter than the path to the root", expected=want, actual=len(proof))
    if fr != root1:
        raise fail("the recomputed first root differs", expected=root1, actual=fr)
    if sr != root2:
        raise fail("the recomputed second root differs", expected=root2, actual=sr)
