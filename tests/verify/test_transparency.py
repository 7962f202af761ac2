"""Tamper-evidence against whoever holds the database (verify/transparency.py): each bad signature, and each attack
on a ledger checked against a head exported before it (truncation, an older copy restored, a rewritten receipt,
reordering, a fork), reported as what it is, in one line with exit 1.

The attacks on a real experiment are made on the session's tiny experiment (tests/conftest.py), its receipts signed
and logged: the experiment itself does not sign yet, so :func:`signed_experiment` re-appends its receipts, in their
order, into a ledger whose operator key is registered first. The attacker works as the issue describes: with write
access to the file (the sqlite3 module, foreign keys off, as the sqlite3 shell has them) and the operator's key.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger import digests, note, tlog
from ledger import transparency as tp
from ledger.cli import app
from ledger.errors import VerificationError
from ledger.reads import DriverReads
from ledger.receipts import Receipt, make_receipt
from ledger.signing import generate_key, sign_receipt
from ledger.store import Store
from ledger.transparency_errors import SignatureInvalid
from tests.conftest import ReceiptChain, TinyExperiment
from verify import transparency as vt
from verify.receipts import verify_receipt

MakeChain = Callable[..., ReceiptChain]


# ------------------------------------------------------------------------------------------------- the ledgers


@dataclass(frozen=True)
class Signed:
    db: Path
    signer: note.Signer
    head: Path  # exported before any attack

    def store(self) -> Store:
        return Store.open(self.db)


def copy_db(src: Path, dest: Path) -> Path:
    """A consistent copy of an SQLite ledger (the backup API: the -wal file's pages included)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # closing(): sqlite3's own context manager commits but does not close, and a connection left to the garbage
    # collector keeps dest's -wal file, which SQLite would replay over a copy restored onto dest later
    with closing(sqlite3.connect(src)) as a, closing(sqlite3.connect(dest)) as b:
        a.backup(b)
    return dest


@pytest.fixture(scope="module")
def signed_experiment(tiny_experiment: TinyExperiment, tmp_path_factory: pytest.TempPathFactory) -> Signed:
    """The tiny experiment's receipts, in append order, each signed by an operator key registered first, and a head
    of that ledger."""
    work = tmp_path_factory.mktemp("signed-tiny")
    db = work / "ledger.db"
    key = tiny_experiment.workdir / "keys" / "operator.key"
    with Store.open(tiny_experiment.db) as src:
        signed_already = key.exists() and bool(src.engine.connect().exec_driver_sql(
            "SELECT count(*) FROM receipt_signatures").scalar())
        receipts = [row.to_receipt() for row in src.iter_rows()]
    if signed_already:  # the main job signs: use its ledger as it is
        from ledger.signing import load_private_key

        copy_db(tiny_experiment.db, db)
        signer = load_private_key(key)
    else:
        signer = generate_key("operator")
        with Store.open(db, create=True, signer=signer) as store:
            tp.register_key(store, signer)
            store.append_many(receipts)
    with Store.open(db) as store:
        tp.export_head(store, signer, work / "head.txt")
    return Signed(db, signer, work / "head.txt")


@pytest.fixture
def exp(signed_experiment: Signed, tmp_path: Path) -> Signed:
    """A private copy of the signed experiment (its head too)."""
    db = copy_db(signed_experiment.db, tmp_path / "ledger.db")
    head = shutil.copy(signed_experiment.head, tmp_path / "head.txt")
    return Signed(db, signed_experiment.signer, Path(head))


@pytest.fixture
def small(tmp_path: Path, make_chain: MakeChain) -> Signed:
    """A hand-built signed ledger: a key, then one chain of receipts; and its head."""
    signer = generate_key("operator")
    db = tmp_path / "small.db"
    with Store.open(db, create=True, signer=signer) as store:
        tp.register_key(store, signer)
        store.append_many(make_chain().receipts())
        tp.export_head(store, signer, tmp_path / "small-head.txt")
    return Signed(db, signer, tmp_path / "small-head.txt")


def grow(db: Path, signer: note.Signer, n: int, salt: str) -> list[Receipt]:
    with Store.open(db, signer=signer) as store:
        return [s.receipt for s in store.append_many(
            [make_receipt("note", measurements={"salt": salt, "i": i}) for i in range(n)])]


def verify_against(s: Signed, receipts: list[str] | None = None) -> vt.HeadReport:
    with s.store() as store:
        return vt.verify_head(store, s.head.read_bytes(), receipts=receipts)


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_line(args: list[str], pattern: str) -> None:
    code, stdout, stderr = cli(*args)
    assert code == 1, (code, stdout, stderr)
    assert len(stderr.splitlines()) == 1 and pattern in stderr, stderr
    assert stdout == ""


# ----------------------------------------------------------------------------------------------- the attacker


def rows(conn: sqlite3.Connection) -> list[tuple[int, str, bytes]]:
    return conn.execute("SELECT seq, id, body FROM receipts ORDER BY seq").fetchall()


def _renamed(value: Any, new_id: dict[str, str]) -> Any:
    if isinstance(value, str):
        return new_id.get(value, value)
    if isinstance(value, list):
        return [_renamed(v, new_id) for v in value]
    if isinstance(value, dict):
        return {k: _renamed(v, new_id) for k, v in value.items()}
    return value


def rewrite(db: Path, target: str, mutate: Callable[[dict[str, Any]], None], signer: note.Signer, *,
            rebuild_log: bool = False) -> dict[str, str]:
    """Rewrite receipt ``target`` and re-hash every receipt that cites it, directly or not (ids in parents and in
    measurements replaced), re-signed with the operator key; optionally rebuild the log from the rewritten rows,
    as our own code would build it. Returns old id -> new id."""
    new_id: dict[str, str] = {}
    with sqlite3.connect(db) as conn:
        for seq, rid, body in rows(conn):
            doc = digests.parse_canonical(bytes(body))
            if rid != target and not set(doc["parents"]) & new_id.keys():
                continue
            if rid == target:
                mutate(doc)
            doc = _renamed(doc, new_id)
            doc["parents"] = sorted(doc["parents"])
            new_body = digests.canonical_bytes(doc)
            new_id[rid] = digests.receipt_id(new_body)
            conn.execute("UPDATE receipts SET id = ?, body = ? WHERE seq = ?", (new_id[rid], new_body, seq))
            sig = sign_receipt(signer, new_id[rid])
            conn.execute("UPDATE receipt_signatures SET signature = ? WHERE receipt_seq = ? AND key = ?",
                         (sig.signature, seq, sig.key))
    if rebuild_log:
        rebuild(db)
    return new_id


def rebuild(db: Path) -> None:
    """The log rebuilt from the receipt rows as they now are, in seq order (what an attacker runs after a rewrite)."""
    with Store.open(db) as store, store.engine.begin() as conn:
        entries = [tlog.LogEntry(seq, rid) for seq, rid in conn.exec_driver_sql(
            "SELECT seq, id FROM receipts ORDER BY seq")]
        sigs = tlog.signatures_by_seq(DriverReads(conn), [e.seq for e in entries])
        for table in ("log_leaves", "log_nodes", "receipt_signatures"):
            conn.exec_driver_sql(f"DELETE FROM {table}")
        tlog.append_leaves(conn, [e._replace(signatures=sigs.get(e.seq, ())) for e in entries])


def find(db: Path, kind: str, pick: Callable[[list[Receipt]], Receipt] = lambda rs: rs[0]) -> Receipt:
    with Store.open(db) as store:
        return pick([s.receipt for s in store.find(kind=kind)])


def descendants(db: Path, rid: str) -> list[Receipt]:
    with Store.open(db) as store:
        return [s.receipt for s in store.descendants(rid)][1:]


# ------------------------------------------------------------------------------------------------- signatures


def test_every_receipt_of_the_experiment_is_signed_by_the_registered_operator(exp: Signed) -> None:
    with exp.store() as store:
        report = vt.check_signatures(store, require=True)
        assert report.checked == store.count()
    assert report.signed == {exp.signer.verifier.label: report.checked} and not report.unsigned
    code, stdout, stderr = cli("verify", "--db", str(exp.db), "--head", str(exp.head), "--require-signatures")
    assert code == 0, stderr
    assert f"signed by {exp.signer.verifier.label}" in stdout and "extends the head" in stdout


def test_a_signature_by_an_unregistered_key_fails(small: Signed) -> None:
    stranger = generate_key("stranger")
    (r,) = grow(small.db, stranger, 1, "stranger")
    with small.store() as store, pytest.raises(vt.UnregisteredKey, match="stranger"):
        vt.check_signatures(store)
    assert_one_line(["verify", "--db", str(small.db), r.id], "a key no key receipt registers")


def test_a_signature_by_a_key_registered_after_the_receipt_fails(small: Signed) -> None:
    late = generate_key("late")
    (r,) = grow(small.db, late, 1, "late")
    with small.store() as store:
        tp.register_key(store, late)
        with pytest.raises(vt.KeyRegisteredLater) as info:
            vt.check_signatures(store, [r.id])
    assert "after the receipt it signs" in str(info.value)
    assert_one_line(["verify", "--db", str(small.db), r.id], "after the receipt it signs")


def test_a_signature_over_other_bytes_fails(small: Signed) -> None:
    """The signature row of a receipt replaced by the operator's signature over another receipt's id."""
    (r, other) = grow(small.db, small.signer, 2, "bytes")
    with sqlite3.connect(small.db) as conn:
        conn.execute("UPDATE receipt_signatures SET signature = ? WHERE receipt_seq = "
                     "(SELECT seq FROM receipts WHERE id = ?)", (sign_receipt(small.signer, other.id).signature, r.id))
    with small.store() as store, pytest.raises(SignatureInvalid, match="does not verify"):
        vt.check_signatures(store, [r.id])
    assert_one_line(["verify", "--db", str(small.db), r.id], "does not verify")


def test_unsigned_receipts_are_reported_and_refused_on_request(small: Signed) -> None:
    with Store.open(small.db) as store:
        r = store.append(make_receipt("note", measurements={"unsigned": True})).receipt
        report = vt.check_signatures(store)
    assert report.unsigned == [r.id]
    code, stdout, _ = cli("verify", "--db", str(small.db), r.id)
    assert code == 0 and "1 receipt(s) unsigned" in stdout
    assert_one_line(["verify", "--db", str(small.db), r.id, "--require-signatures"], "not signed")


def test_a_key_receipt_edited_to_name_another_key_is_caught(small: Signed) -> None:
    with sqlite3.connect(small.db) as conn:
        seq, body = conn.execute("SELECT seq, body FROM receipts WHERE kind = 'key'").fetchone()
        forged = bytes(body).replace(small.signer.verifier.key().encode(), generate_key("operator").verifier.key()
                                     .encode())
        conn.execute("UPDATE receipts SET body = ? WHERE seq = ?", (forged, seq))
    with small.store() as store, pytest.raises(VerificationError, match="does not recompute"):
        vt.check_signatures(store)


def test_bodies_the_sqlite3_shell_rewrote_as_text_are_verified_not_crashed_on(small: Signed) -> None:
    """sqlite3's replace() on a BLOB stores TEXT. Every reader of stored bodies (the log refolded against a head, the
    parents' order, the key receipts) reads it as its UTF-8: the same bytes verify, other bytes fail in one line
    naming the receipt (it used to be a TypeError traceback from bytes(str))."""
    head = ["verify", "--db", str(small.db), "--head", str(small.head)]
    with closing(sqlite3.connect(small.db)) as conn, conn:
        key_id, = conn.execute("SELECT id FROM receipts WHERE kind = 'key'").fetchone()
        last_id, = conn.execute("SELECT id FROM receipts ORDER BY seq DESC LIMIT 1").fetchone()
        conn.execute("UPDATE receipts SET body = replace(body, '\"v\":1', '\"v\":1')")  # every body TEXT, same bytes
        assert conn.execute("SELECT count(*) FROM receipts WHERE typeof(body) != 'text'").fetchone() == (0,)
    code, stdout, stderr = cli(*head)
    assert code == 0, (stdout, stderr)
    with small.store() as store:
        assert [k.receipt.id for k in tp.logged_key_receipts(store)] == [key_id]
    for rid in (last_id, key_id):
        with closing(sqlite3.connect(small.db)) as conn, conn:
            conn.execute("UPDATE receipts SET body = replace(body, '\"v\":1', '\"v\":2') WHERE id = ?", (rid,))
        assert_one_line(head, f"receipt {rid}: receipt id does not recompute from the stored body")
        with closing(sqlite3.connect(small.db)) as conn, conn:
            conn.execute("UPDATE receipts SET body = replace(body, '\"v\":2', '\"v\":1') WHERE id = ?", (rid,))
    with closing(sqlite3.connect(small.db)) as conn, conn:
        conn.execute("UPDATE receipts SET body = replace(body, '\"v\":1', '\"v\":2') WHERE id = ?", (key_id,))
    with small.store() as store, pytest.raises(VerificationError, match="does not recompute"):
        tp.logged_key_receipts(store)


_LAST = "(SELECT max(seq) FROM receipts)"


@pytest.mark.parametrize(("edit", "named"), [
    (f"UPDATE receipt_signatures SET signature = 'text' WHERE receipt_seq = {_LAST}", "receipt rewritten"),
    (f"UPDATE receipt_signatures SET signature = 7 WHERE receipt_seq = {_LAST}", "receipt rewritten"),
    (f"UPDATE receipt_signatures SET key = 5 WHERE receipt_seq = {_LAST}", "receipt rewritten"),
    ("UPDATE log_nodes SET hash = 'text' WHERE level = 0 AND idx = 1", "receipt rewritten"),
    ("UPDATE log_leaves SET receipt_seq = 'x' WHERE leaf_index = 1", "not a leaf index and a receipt seq"),
])
def test_log_columns_holding_another_type_are_caught_in_one_line(small: Signed, edit: str, named: str) -> None:
    """SQLite stores whatever an UPDATE gives a column: text or an integer where the schema says BLOB, text where it
    says INTEGER. The log's readers take the values as stored and the checks fail on them, naming what is wrong
    (each was a TypeError traceback)."""
    with closing(sqlite3.connect(small.db)) as conn, conn:
        assert conn.execute(edit).rowcount == 1
    assert_one_line(["verify", "--db", str(small.db), "--head", str(small.head)], named)


# ------------------------------------------------------------------------------------------- head: the rewrites


def test_a_train_end_rewritten_with_its_descendants_rehashed_is_detected(exp: Signed) -> None:
    """The issue's first rewrite: a train-end's figure changed, its descendants re-hashed and re-signed."""
    with exp.store() as store:
        ends = [s.receipt for s in store.find(kind="train-end")]
    target = max(ends, key=lambda r: len(descendants(exp.db, r.id)))
    below = descendants(exp.db, target.id)
    assert below, "the train-end has descendants to re-hash"
    final = below[-1]

    def halve(doc: dict[str, Any]) -> None:
        doc["measurements"]["loop_seconds"] = doc["measurements"]["loop_seconds"] / 2

    new = rewrite(exp.db, target.id, halve, exp.signer)
    assert len(new) == 1 + len(below)
    with exp.store() as store:  # without a head, the forgery holds together: ids, chain, signatures
        verify_receipt(store, new[final.id])
        with pytest.raises(vt.ReceiptRewritten):  # but the log kept the old leaves
            vt.check_signatures(store, [new[target.id]])
    with pytest.raises(vt.ReceiptRewritten) as info:
        verify_against(exp)
    assert new[target.id] in str(info.value)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "receipt rewritten")
    # With a receipt id: its ancestry verifies as before, and its inclusion in the head does not.
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head), new[target.id]], "receipt rewritten")
    with exp.store() as store, pytest.raises(vt.ReceiptRewritten):
        vt.verify_head(store, exp.head.read_bytes(), receipts=[s.receipt.id for s in store.ancestors(new[final.id])])

    rebuild(exp.db)  # the attacker rebuilds the log too: the tree no longer extends the head
    with exp.store() as store:
        vt.check_signatures(store, [new[target.id]])  # every signature and leaf is consistent again
    with pytest.raises(vt.LogRebuilt):
        verify_against(exp)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "receipts rewritten and the log "
                                                                              "rebuilt")


def test_the_contracts_thresholds_rewritten_and_everything_rehashed_is_detected(exp: Signed) -> None:
    """The issue's second rewrite: the pre-registered contract's thresholds changed after training."""
    contract = find(exp.db, "contract")

    def lower(doc: dict[str, Any]) -> None:
        quality = doc["measurements"]["quality"]
        for k, v in quality.items():
            if isinstance(v, float):
                quality[k] = v - 1.0
        doc["measurements"]["quality"] = {**quality, "rewritten": True}

    new = rewrite(exp.db, contract.id, lower, exp.signer)
    assert len(new) > 1
    with pytest.raises(vt.ReceiptRewritten) as info:
        verify_against(exp)
    assert new[contract.id] in str(info.value)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "receipt rewritten")
    rebuild(exp.db)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "receipts rewritten and the log "
                                                                              "rebuilt")


# ------------------------------------------------------------------------------------- head: the other attacks


def _delete_from(conn: sqlite3.Connection, seq: int, *, log: bool) -> None:
    tables = ["receipt_signatures", "receipt_parents", "receipt_artifacts", "receipt_locations"]
    for table in tables:
        column = "child_seq" if table == "receipt_parents" else "receipt_seq"
        conn.execute(f"DELETE FROM {table} WHERE {column} >= ?", (seq,))
    if log:
        conn.execute("DELETE FROM log_leaves WHERE receipt_seq >= ?", (seq,))
    conn.execute("DELETE FROM receipts WHERE seq >= ?", (seq,))


def test_truncation_is_detected(exp: Signed, tmp_path: Path) -> None:
    with sqlite3.connect(exp.db) as conn:
        top = conn.execute("SELECT max(seq) FROM receipts").fetchone()[0]
    # 1. the last receipts deleted, the log's rows left as they were
    naive = copy_db(exp.db, tmp_path / "naive.db")
    with sqlite3.connect(naive) as conn:
        _delete_from(conn, top - 4, log=False)
    assert_one_line(["verify", "--db", str(naive), "--head", str(exp.head)], "ledger truncated")
    # 2. the leaves deleted too: the leaf hashes in log_nodes remain
    with sqlite3.connect(exp.db) as conn:
        _delete_from(conn, top - 4, log=True)
    with pytest.raises(vt.LedgerTruncated, match="log_nodes still holds"):
        verify_against(exp)
    # 3. every node of the lost leaves deleted as well: the ledger's own record of the head it issued remains
    with Store.open(exp.db) as store:
        size = tp.current_checkpoint(store).size
    with sqlite3.connect(exp.db) as conn:
        for level in range(0, 64):
            conn.execute("DELETE FROM log_nodes WHERE level = ? AND (idx + 1) * (1 << ?) > ?", (level, level, size))
    with pytest.raises(vt.LedgerTruncated, match="issued a checkpoint of size"):
        verify_against(exp)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "ledger truncated")


def test_an_older_copy_restored_is_detected(exp: Signed, tmp_path: Path) -> None:
    older = copy_db(exp.db, tmp_path / "backup.db")  # the backup, taken before the head below
    grow(exp.db, exp.signer, 3, "after-backup")
    with Store.open(exp.db) as store:
        tp.export_head(store, exp.signer, exp.head)
    shutil.copy(older, exp.db)  # restored over the ledger
    with pytest.raises(vt.OlderLedger):
        verify_against(exp)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "older ledger")


def test_reordering_is_detected(exp: Signed) -> None:
    """Two receipts swap places (rows and their index rows swapped by seq), the log left as it was."""
    with Store.open(exp.db) as store:
        starts = [s for s in store.find(kind="train-start")][:2]
    a, b = starts[0].seq, starts[1].seq
    with sqlite3.connect(exp.db) as conn:
        for table, column in (("receipts", "seq"), ("receipt_signatures", "receipt_seq"),
                              ("receipt_artifacts", "receipt_seq"), ("receipt_parents", "child_seq"),
                              ("receipt_locations", "receipt_seq")):
            conn.execute(f"UPDATE {table} SET {column} = -1 WHERE {column} = ?", (a,))
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (a, b))
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = -1", (b,))
        conn.execute("UPDATE receipt_parents SET parent_seq = CASE parent_seq WHEN ? THEN ? WHEN ? THEN ? "
                     "ELSE parent_seq END", (a, b, b, a))
    with pytest.raises(vt.LogReordered) as info:
        verify_against(exp)
    assert starts[1].receipt.id in str(info.value) or starts[0].receipt.id in str(info.value)
    assert_one_line(["verify", "--db", str(exp.db), "--head", str(exp.head)], "ledger reordered")
    with pytest.raises(vt.LogReordered):  # and through a receipt's inclusion check
        verify_against(exp, [starts[1].receipt.id])


def test_a_child_logged_before_its_parent_is_reordered(small: Signed, make_chain: MakeChain) -> None:
    """Even with the log rebuilt to match, a receipt placed before a parent it cites cannot be in append order."""
    chain = make_chain()
    with sqlite3.connect(small.db) as conn:
        seq = {rid: s for s, rid in conn.execute("SELECT seq, id FROM receipts")}
        a, b = seq[chain.train_start.id], seq[chain.checkpoints[0].id]
        for table, column in (("receipts", "seq"), ("receipt_signatures", "receipt_seq"),
                              ("receipt_artifacts", "receipt_seq"), ("receipt_parents", "child_seq")):
            conn.execute(f"UPDATE {table} SET {column} = -1 WHERE {column} = ?", (a,))
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (a, b))
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = -1", (b,))
        conn.execute("UPDATE receipt_parents SET parent_seq = CASE parent_seq WHEN ? THEN ? WHEN ? THEN ? "
                     "ELSE parent_seq END", (a, b, b, a))
    rebuild(small.db)
    signer = small.signer
    with Store.open(small.db) as store:
        tp.export_head(store, signer, small.head)  # a head of the reordered log itself
        with pytest.raises(vt.LogReordered, match="before its parent"):
            vt.verify_head(store, small.head.read_bytes(), receipts=[chain.checkpoints[0].id, chain.train_start.id])


def test_a_fork_is_detected(exp: Signed, tmp_path: Path) -> None:
    """Two ledgers grown from one head: each extends it, neither extends the other's later head."""
    other = copy_db(exp.db, tmp_path / "fork.db")
    verify_against(exp)
    verify_against(Signed(other, exp.signer, exp.head))
    grow(exp.db, exp.signer, 2, "branch-a")
    grow(other, exp.signer, 3, "branch-b")
    head_a = tmp_path / "head-a.txt"
    with Store.open(exp.db) as store:
        tp.export_head(store, exp.signer, head_a)
    with pytest.raises(vt.LogForked):
        verify_against(Signed(other, exp.signer, head_a))
    assert_one_line(["verify", "--db", str(other), "--head", str(head_a)], "ledger forked")


def test_a_receipt_stored_behind_the_librarys_back_is_not_in_the_log(small: Signed) -> None:
    ghost = make_receipt("note", measurements={"ghost": True})
    with sqlite3.connect(small.db) as conn:
        conn.execute("INSERT INTO receipts (id, kind, body, recorded_ns) VALUES (?, 'note', ?, 0)",
                     (ghost.id, ghost.body))
    with pytest.raises(tp.NotInLog):
        verify_against(small)
    assert_one_line(["verify", "--db", str(small.db), ghost.id], "is not in the transparency log")


def test_a_head_of_another_log_or_by_an_untrusted_key_is_refused(small: Signed, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with Store.open(other, create=True, signer=small.signer) as store:
        tp.register_key(store, small.signer)
        store.append(make_receipt("note"))
    assert_one_line(["verify", "--db", str(other), "--head", str(small.head)], "origin")
    stranger = generate_key("stranger")
    assert_one_line(["verify", "--db", str(small.db), "--head", str(small.head), "--log-key",
                     stranger.verifier.key()], "no valid signature by a trusted key")
    code, _, stderr = cli("verify", "--db", str(small.db), "--head", str(small.head), "--log-key",
                          small.signer.verifier.key())
    assert code == 0, stderr


def test_verify_head_json_and_the_receipts_it_includes(small: Signed, make_chain: MakeChain) -> None:
    import json

    late = grow(small.db, small.signer, 2, "since")
    code, stdout, stderr = cli("verify", "--db", str(small.db), "--head", str(small.head), late[-1].id, "--json")
    assert code == 0, stderr
    value = json.loads(stdout)
    assert value["ok"] and value["receipts_checked"] == 1
    assert value["log"]["included"] == 1 and value["log"]["appended_since"] == 1
    chain = make_chain()
    report = verify_against(small, [chain.eval.id, late[0].id])
    assert (report.included, report.appended_since) == (2, 1)


@pytest.mark.parametrize("edit", ["UPDATE receipts SET prepared = NULL WHERE seq = (SELECT max(seq) FROM receipts)",
                                  "UPDATE receipts SET run = 'elsewhere' WHERE seq = 1",
                                  "DELETE FROM receipt_artifacts WHERE (receipt_seq, name) = (SELECT receipt_seq, "
                                  "name FROM receipt_artifacts LIMIT 1)",
                                  "INSERT INTO receipt_parents SELECT (SELECT max(seq) FROM receipts), 1"])
def test_an_index_row_edited_behind_the_log_fails_against_the_head(small: Signed, edit: str) -> None:
    """The log vouches for the bodies; the index rows (columns, parent edges, artifact rows) that readers find
    receipts by are compared with them, every row, when a head is verified without ids."""
    assert verify_against(small).rows_checked is not None
    with sqlite3.connect(small.db) as conn:
        conn.execute(edit)
    assert_one_line(["verify", "--db", str(small.db), "--head", str(small.head)], "differs from its body")


def test_a_row_whose_body_is_null_is_named_not_called_gone(small: Signed) -> None:
    """A body set to NULL (the column's NOT NULL dropped behind the library's back first): the row is there, so
    the head's check names it and says what is missing, rather than calling the receipt gone."""
    with sqlite3.connect(small.db) as conn:
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = replace(sql, 'body BLOB NOT NULL', 'body BLOB') "
                     "WHERE name = 'receipts'")
    with sqlite3.connect(small.db) as conn:
        rid = conn.execute("SELECT id FROM receipts WHERE seq = 3").fetchone()[0]
        conn.execute("UPDATE receipts SET body = NULL WHERE seq = 3")
    assert_one_line(["verify", "--db", str(small.db), "--head", str(small.head)], f"{rid}: stored body")
    code, _, stderr = cli("verify", "--db", str(small.db), "--head", str(small.head))
    assert "has no body" in stderr and "gone" not in stderr
