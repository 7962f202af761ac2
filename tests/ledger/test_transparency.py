"""The transparency log in the store (ledger/tlog.py, ledger/transparency.py): leaf bytes, the log kept inside the
append transaction, signatures beside receipts, proofs with O(log n) node reads, heads, and migration 0004 building
the log for receipts stored before it.

Tests taking ``ledger_url`` run on SQLite and on PostgreSQL (tests/pg.py)."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger import merkle, note, tlog
from ledger import transparency as tp
from ledger.database import resolve_url
from ledger.receipts import Receipt, make_receipt
from ledger.signing import batch_message, generate_key, receipt_message, save_private_key, sign_receipt
from ledger.store import ENV_SIGNING_KEY, Store
from tests.conftest import ReceiptChain

MakeChain = Callable[..., ReceiptChain]


def note_receipt(i: int, parents: list[Receipt] | None = None) -> Receipt:
    prepared = parents[0].prepared if parents else None
    return make_receipt("note", parents=parents or [], prepared=prepared, measurements={"i": i})


@pytest.fixture
def store(ledger_url: str) -> Iterator[Store]:
    with Store.open(ledger_url) as s:
        yield s


def stored_leaves(store: Store) -> list[tuple[int, int, str]]:
    with store.engine.connect() as conn:
        return [(int(r[0]), int(r[1]), str(r[2])) for r in conn.execute(text(
            "SELECT l.leaf_index, l.receipt_seq, r.id FROM log_leaves l JOIN receipts r ON r.seq = l.receipt_seq "
            "ORDER BY l.leaf_index"))]


def expected_root(store: Store) -> bytes:
    """The root by the RFC's recursive definition, from every receipt's leaf recomputed in seq order."""
    with store.reading() as reads:
        rows = reads.all("SELECT seq, id FROM receipts ORDER BY seq")
        sigs = tlog.signatures_by_seq(reads, [s for s, _ in rows])
    return merkle.root_from_leaves([tlog.leaf_hash(rid, sigs.get(seq, ())) for seq, rid in rows])


# ------------------------------------------------------------------------------------------------ leaf bytes


def test_leaf_bytes_are_exactly_as_specified() -> None:
    rid = "blake3:" + "ab" * 32
    assert tlog.leaf_bytes(rid) == b"training-ledger/log-leaf/v1\x00" + bytes.fromhex("ab" * 32) + b"\x00"
    sig_b, sig_a = b"\x02" * 64, b"\x01" * 64
    leaf = tlog.leaf_bytes(rid, [("zed+00000002", sig_b), ("alice+00000001", sig_a)])
    # sorted by label bytes; each label and signature length-prefixed (u16 big-endian)
    assert leaf == (b"training-ledger/log-leaf/v1\x00" + bytes.fromhex("ab" * 32) + b"\x02"
                    + b"\x00\x0ealice+00000001" + b"\x00\x40" + sig_a
                    + b"\x00\x0czed+00000002" + b"\x00\x40" + sig_b)
    assert tlog.leaf_hash(rid) == hashlib.sha256(b"\x00" + tlog.leaf_bytes(rid)).digest()
    # the leaf domain is disjoint from the receipt-signature message's
    assert not receipt_message(rid).startswith(tlog.LEAF_DOMAIN) and tlog.LEAF_DOMAIN.endswith(b"\x00")


def test_the_worked_leaf_example_of_the_docs() -> None:
    """docs/transparency.md shows this leaf hash; the page and the code must agree."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    rid = "blake3:" + "00" * 32
    doc = (Path(__file__).resolve().parents[2] / "docs" / "transparency.md").read_text()
    assert f"leaf bytes    {tlog.leaf_bytes(rid).hex()}\n" in doc
    assert f"leaf hash     {tlog.leaf_hash(rid).hex()}" in doc
    signer = note.Signer("operator", Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
    sig = sign_receipt(signer, rid)
    assert sig.key == "operator+4b84c384" and f"signature     {sig.signature.hex()}" in doc
    signed = [(sig.key, sig.signature)]
    assert f"leaf bytes    {tlog.leaf_bytes(rid, signed).hex()}" in doc
    assert f"leaf hash     {tlog.leaf_hash(rid, signed).hex()}" in doc


# ------------------------------------------------------------------------------------------- the log in appends


def test_every_append_grows_the_log_in_seq_order(store: Store, make_chain: MakeChain) -> None:
    chain = make_chain()
    store.append_many(chain.receipts())
    for i in range(5):
        store.append(note_receipt(i, [chain.eval]))
    leaves = stored_leaves(store)
    assert [leaf for leaf, _, _ in leaves] == list(range(store.count()))  # contiguous from 0
    seqs = [seq for _, seq, _ in leaves]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert tp.current_checkpoint(store).root == expected_root(store)
    # appending what is stored already changes nothing
    before = tp.current_checkpoint(store)
    store.append_many(chain.receipts())
    assert tp.current_checkpoint(store) == before


def test_the_log_of_a_failed_batch_is_rolled_back_with_it(store: Store, make_chain: MakeChain) -> None:
    chain = make_chain()
    store.append_many(chain.receipts()[:3])
    before = tp.current_checkpoint(store)
    bad = make_receipt("note", parents=["blake3:" + "0" * 64])
    with pytest.raises(Exception):  # noqa: B017 - MissingParents; what matters is that nothing was logged
        store.append_many([*chain.receipts()[3:], bad])
    assert tp.current_checkpoint(store) == before


def test_leaf_indexes_do_not_follow_seq_gaps(ledger_db: Path) -> None:
    """Seqs may skip values (a PostgreSQL sequence after a failed transaction); leaf indexes never do."""
    with Store.open(ledger_db) as store:
        store.append(note_receipt(0))
        with store.engine.begin() as conn:  # a receipt row at seq 10, as if seqs 2..9 had been lost
            r = note_receipt(1)
            conn.exec_driver_sql("INSERT INTO receipts (seq, id, kind, body, recorded_ns) VALUES (10, ?, 'note', ?, 0)",
                                 (r.id, r.body))
            tlog.append_leaves(conn, [tlog.LogEntry(10, r.id)])
            with pytest.raises(ValueError):  # the log's order is the append order: a smaller seq is refused
                tlog.append_leaves(conn, [tlog.LogEntry(5, r.id)])
        store.append(note_receipt(2))
        assert [(leaf, seq) for leaf, seq, _ in stored_leaves(store)] == [(0, 1), (1, 10), (2, 11)]
        assert tp.current_checkpoint(store).root == expected_root(store)


def test_signed_appends_store_the_signature_beside_the_receipt(store: Store, make_chain: MakeChain) -> None:
    signer = generate_key("operator")
    chain = make_chain()
    stored = store.append_many(chain.receipts(), signer=signer)
    body_before = [s.receipt.body for s in stored]
    with store.reading() as conn:
        sigs = tlog.signatures_by_seq(conn, [s.seq for s in stored])
    ids = [s.receipt.id for s in sorted(stored, key=lambda s: s.seq)]
    for s in stored:
        (sig,) = sigs[s.seq]
        assert sig.key == signer.verifier.label
        # one signature for the batch, over ledger/signing.py's batch message of the ids in log order
        note.Verifier(signer.name, signer.verifier.public_key).verify(batch_message(ids), sig.signature)
    alone = store.append(note_receipt(99), signer=signer)
    with store.reading() as conn:
        (sig,) = tlog.signatures_by_seq(conn, [alone.seq])[alone.seq]
    # a receipt appended alone: the 69-byte message
    note.Verifier(signer.name, signer.verifier.public_key).verify(receipt_message(alone.receipt.id), sig.signature)
    assert [store.get(s.receipt.id).receipt.body for s in stored] == body_before  # the id stays the body's digest
    assert tp.current_checkpoint(store).root == expected_root(store)
    # an already stored receipt keeps the signatures it was logged with
    other = generate_key("other")
    store.append(chain.prepare, signer=other)
    with store.reading() as conn:
        assert [s.key for s in tlog.signatures_by_seq(conn, [stored[0].seq])[stored[0].seq]] == [signer.verifier.label]


def test_a_default_signer_from_open_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ledger.db"
    signer = generate_key("operator")
    with Store.open(path, create=True, signer=signer) as store:
        first = store.append(note_receipt(1))
    key_file = save_private_key(signer, tmp_path / "operator.key")
    monkeypatch.setenv(ENV_SIGNING_KEY, str(key_file))
    with Store.open(path) as store:
        assert store.signer is not None and store.signer.key() == signer.key()
        second = store.append(note_receipt(2))
        with store.reading() as conn:
            sigs = tlog.signatures_by_seq(conn, [first.seq, second.seq])
    assert set(sigs) == {first.seq, second.seq}
    key_file.chmod(0o644)  # an exposed key file is refused, as for every key file
    with pytest.raises(Exception, match="must not be accessible"):
        Store.open(path)


# ---------------------------------------------------------------------------------------------------- proofs


def test_proofs_read_o_log_n_nodes_and_verify(store: Store) -> None:
    prev: list[Receipt] = []
    batch = [note_receipt(i) for i in range(300)]
    store.append_many(batch)
    for i in range(37):
        prev = [store.append(note_receipt(1000 + i, prev[:1])).receipt]
    cp = tp.current_checkpoint(store)
    n = cp.size
    with store.reading() as conn:
        for r in (batch[0], batch[150], prev[0]):
            included = tp.inclusion(conn, r.id, n)
            assert len(included.proof) <= (n - 1).bit_length()
            included.verify(cp.root)
        nodes = tlog.DbNodes(conn)
        for m in (1, 3, 100, 256, n - 1, n):
            nodes.reads = 0
            root_m = merkle.root_at(nodes, m)
            proof = merkle.consistency_proof(nodes, m, n)
            assert nodes.reads <= 2 * n.bit_length() + m.bit_count()  # O(log n) node reads
            merkle.verify_consistency(m, n, proof, root_m, cp.root)


def test_a_missing_node_is_a_corrupt_log(ledger_db: Path) -> None:
    with Store.open(ledger_db) as store:
        store.append_many([note_receipt(i) for i in range(6)])
    with sqlite3.connect(ledger_db) as conn:
        conn.execute("DELETE FROM log_nodes WHERE level = 1 AND idx = 2")
    with Store.open(ledger_db) as store:
        with pytest.raises(tlog.LogCorrupt, match="level 1, index 2"):
            tp.current_checkpoint(store)
        with pytest.raises(tlog.LogCorrupt):  # the next append needs that node of the frontier
            store.append(note_receipt(99))


# ----------------------------------------------------------------------------------------------------- heads


def test_a_head_is_a_c2sp_checkpoint_signed_as_a_note(tmp_path: Path, store: Store) -> None:
    signer = generate_key("operator")
    store.append_many([note_receipt(i) for i in range(5)], signer=signer)
    cp = tp.export_head(store, signer, tmp_path / "head.txt")
    data = (tmp_path / "head.txt").read_bytes()
    lines = data.decode().split("\n")
    assert lines[0] == tp.log_origin(store) and lines[0].startswith("training-ledger/") and len(lines[0]) == 48
    assert lines[1] == "5" and lines[3] == "" and lines[4].startswith("\u2014 operator ")
    verified = note.verify_checkpoint(data, signer.verifier, origin=lines[0])
    assert verified.checkpoint == cp and cp.root == expected_root(store)
    assert tp.issued_checkpoints(store) == [cp]  # the ledger's own record of what it claimed


def test_copies_share_the_origin_and_independent_ledgers_do_not(tmp_path: Path) -> None:
    import shutil

    a, b = tmp_path / "a.db", tmp_path / "b.db"
    for path in (a, b):
        with Store.open(path, create=True) as s:
            s.append(note_receipt(1))
    shutil.copy(a, tmp_path / "copy.db")
    origins = []
    for path in (a, b, tmp_path / "copy.db"):
        with Store.open(path) as s:
            origins.append(tp.log_origin(s))
    assert origins[0] != origins[1] and origins[0] == origins[2]


# ------------------------------------------------------------------------------------------------- migration


def test_upgrading_to_0004_logs_the_receipts_already_stored(tmp_path: Path, make_chain: MakeChain) -> None:
    """A ledger written before the log gets one at upgrade: its receipts in seq order, unsigned."""
    from ledger import migrate

    path = tmp_path / "old.db"
    url = resolve_url(path)
    migrate.upgrade(url, "0003_receipt_locations")
    chain = make_chain()
    receipts = chain.receipts()
    with sqlite3.connect(path) as conn:  # what software at 0003 wrote: rows, edges, artifacts, no log
        for seq, r in enumerate(receipts, start=1):
            conn.execute("INSERT INTO receipts (seq, id, kind, run, rank, step, prepared, selection, body, "
                         "recorded_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                         (seq * 2, r.id, r.kind, r.run, r.rank, r.step, r.prepared, r.selection, r.body))
        seq_of = {r.id: seq * 2 for seq, r in enumerate(receipts, start=1)}
        for r in receipts:
            conn.executemany("INSERT INTO receipt_parents VALUES (?, ?)",
                             [(seq_of[r.id], seq_of[p]) for p in r.parents])
            conn.executemany("INSERT INTO receipt_artifacts VALUES (?, ?, ?)",
                             [(seq_of[r.id], n, d) for n, d in r.artifacts.items()])
    migrate.upgrade(url)
    with Store.open(path) as store:
        assert [rid for _, _, rid in stored_leaves(store)] == [r.id for r in receipts]
        cp = tp.current_checkpoint(store)
        assert cp.size == len(receipts)
        assert cp.root == merkle.root_from_leaves([tlog.leaf_hash(r.id) for r in receipts])
        assert tp.log_origin(store).startswith("training-ledger/")
        store.append(note_receipt(7, [chain.eval]))  # and it keeps growing where the upgrade left it
        assert tp.current_checkpoint(store).root == expected_root(store)
    migrate.downgrade(url, "0003_receipt_locations")
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert not tables & {"log_leaves", "log_nodes", "log_info", "log_checkpoints", "receipt_signatures"}
    migrate.upgrade(url)
    assert migrate.schema_diff(url) == []


def test_the_stores_batch_signing_is_sign_batch(make_chain: MakeChain) -> None:
    """tlog.sign_ids gives every id of a batch its batch signature (signing.sign_batch), and one id alone
    sign_receipt's bytes."""
    from ledger.signing import sign_batch
    from ledger.transparency_errors import MalformedKey

    signer = generate_key("operator")
    ids = [r.id for r in make_chain().receipts()]
    signed = tlog.sign_ids(signer, ids)
    [(chunk, sig)] = sign_batch(signer, ids)
    assert chunk == tuple(ids) and all(signed[rid] == (tlog.LeafSignature(signer.verifier.label, sig),) for rid in ids)
    want = sign_receipt(signer, ids[0])
    assert tlog.sign_ids(signer, ids[:1]) == {ids[0]: (tlog.LeafSignature(want.key, want.signature),)}
    with pytest.raises(MalformedKey):
        tlog.sign_ids(note.Signer.generate("w", note.ALG_COSIGNATURE_V1), ids)
    with pytest.raises(Exception, match="blake3"):
        tlog.leaf_bytes("blake3:" + "AB" * 32)  # not canonical: uppercase hex


def test_the_appended_leaf_hashes_are_leaf_hash(ledger_db: Path) -> None:
    """The append path writes the unsigned and singly signed leaf's bytes out by hand: the same hashes as
    leaf_hash, for none, one and several signatures (sorted by label)."""
    a, b = generate_key("alice"), generate_key("bob")
    receipts = [note_receipt(i) for i in range(6)]
    sigs: list[tuple[tlog.LeafSignature, ...]] = [
        (), (tlog.LeafSignature(a.verifier.label, sign_receipt(a, receipts[1].id).signature),),
        (tlog.LeafSignature(b.verifier.label, b"\x07" * 3),),  # any length: the leaf commits to what is stored
        tuple(tlog.LeafSignature(k.verifier.label, sign_receipt(k, receipts[3].id).signature) for k in (b, a)),
        (), (tlog.LeafSignature("\u00e9l\u00e8ve+00000001", b"\x01" * 64),),  # a non-ASCII label
    ]
    with Store.open(ledger_db) as store:
        stored = store.append_many(receipts, check=False)
        entries = [tlog.LogEntry(s.seq, s.receipt.id, sig) for s, sig in zip(stored, sigs, strict=True)]
        with store.reading() as reads:
            _, _, _, nodes = tlog._leaf_rows(reads, None, entries)
    leaves = [h for _, level, _, h in nodes if level == 0]
    assert leaves == [tlog.leaf_hash(e.receipt, e.signatures) for e in entries]


def test_driver_errors_in_the_log_are_the_stores_typed_errors(ledger_db: Path) -> None:
    """The log's statements run on the driver's cursor; its errors still reach the caller as DatabaseError, and a
    leaf index taken behind the store's back rolls the whole append back."""
    from ledger.errors import DatabaseError

    with Store.open(ledger_db) as store:
        store.append(note_receipt(0))
    with sqlite3.connect(ledger_db) as conn:  # the next leaf's node position taken by a row the library did not write
        conn.execute("INSERT INTO log_nodes (pos, level, idx, hash) VALUES (1, 0, 1, x'00')")
    with Store.open(ledger_db) as store:
        with pytest.raises(DatabaseError, match="UNIQUE|constraint"):
            store.append(note_receipt(1))
        assert store.count() == 1
    with sqlite3.connect(ledger_db) as conn:
        conn.execute("ALTER TABLE log_nodes RENAME COLUMN pos TO p")
    with Store.open(ledger_db) as store, pytest.raises(DatabaseError, match="no such column"):
        store.append(note_receipt(2))
