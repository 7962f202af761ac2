"""Batch signatures (ledger/signing.py): receipts appended together share one Ed25519 signature over their ids in
log order. Every receipt of a batch verifies on its own (`ledger verify ID` rebuilds the batch from the ledger), the
whole ledger verifies each batch signature once, and whatever changes the set a signature was made over (a member's
signature row removed, a receipt deleted, the signature copied onto another receipt, a member rewritten) fails, with
a rewritten member named as such. An attestation of a batch member carries the batch and verifies offline. The
store's side runs on PostgreSQL too."""

from __future__ import annotations

import base64
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger import signing, tlog
from ledger import transparency as tp
from ledger.artifacts import ArtifactStore, default_root
from ledger.cli import app
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from ledger.transparency_errors import SignatureInvalid
from verify import transparency as vt

N = signing.MAX_BATCH + 40  # two batch signatures: 1,024 receipts and 40


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


class Batched:
    """A ledger whose operator key is registered alone, then N receipts appended in one call, then one alone."""

    def __init__(self, tmp_path: Path) -> None:
        self.db = tmp_path / "ledger.db"
        self.keys = tmp_path / "keys"
        assert cli("keys", "new", "operator", "--dir", str(self.keys))[0] == 0
        self.signer = tp.load_key("operator", self.keys)
        with self.store() as store:
            tp.register_key(store, self.signer)
            stored = store.append_many([make_receipt("note", measurements={"i": i}) for i in range(N)])
            self.ids = [s.receipt.id for s in sorted(stored, key=lambda s: s.seq)]
            self.alone = store.append(make_receipt("note", measurements={"alone": True})).receipt.id

    def store(self) -> Store:
        return Store.open(self.db, create=True, signer=self.signer)

    def sql(self, statement: str, *params: Any) -> None:
        conn = sqlite3.connect(self.db)
        try:
            with conn:
                conn.execute(statement, params)
        finally:
            conn.close()

    def signature_of(self, rid: str) -> bytes:
        conn = sqlite3.connect(self.db)
        try:
            (sig,) = conn.execute("SELECT s.signature FROM receipt_signatures s JOIN receipts r ON r.seq = "
                                  "s.receipt_seq WHERE r.id = ?", (rid,)).fetchone()
        finally:
            conn.close()
        return bytes(sig)


@pytest.fixture
def batched(tmp_path: Path) -> Batched:
    return Batched(tmp_path)


def test_every_receipt_of_a_batch_verifies_and_each_signature_is_checked_once(
        batched: Batched, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = batched.ids[:signing.MAX_BATCH], batched.ids[signing.MAX_BATCH:]
    assert len({batched.signature_of(r) for r in first}) == 1 and len({batched.signature_of(r) for r in second}) == 1
    assert batched.signature_of(first[0]) != batched.signature_of(second[0])
    assert batched.signature_of(batched.alone) == signing.sign_receipt(batched.signer, batched.alone).signature
    calls: list[tuple[str, ...]] = []
    real = vt.verify_receipt_signature

    def counted(sig: signing.ReceiptSignature, keys: Any) -> Any:
        calls.append(sig.signed_ids)
        return real(sig, keys)

    monkeypatch.setattr(vt, "verify_receipt_signature", counted)
    with batched.store() as store:
        report = vt.check_signatures(store, require=True)
        assert report.checked == N + 2 and report.signed == {batched.signer.verifier.label: N + 2}
        # the key receipt, the two batches and the receipt appended alone: four signatures for N + 2 receipts
        assert sorted(map(len, calls)) == [1, 1, len(second), len(first)]
        for rid in (first[0], first[500], first[-1], second[0], second[-1], batched.alone):
            calls.clear()
            assert vt.check_signatures(store, [rid], require=True).checked == 1
            assert len(calls) == 1 and rid in calls[0]
    for rid in (first[7], second[-1]):
        code, stdout, stderr = cli("verify", "--db", str(batched.db), rid, "--require-signatures")
        assert code == 0, stderr
        assert f"signed by {batched.signer.verifier.label}" in stdout


def test_a_member_whose_signature_row_is_removed_fails_its_batch(batched: Batched) -> None:
    victim, witness = batched.ids[10], batched.ids[11]
    batched.sql("DELETE FROM receipt_signatures WHERE receipt_seq = (SELECT seq FROM receipts WHERE id = ?)", victim)
    with batched.store() as store, pytest.raises(SignatureInvalid, match="does not verify"):
        vt.check_signatures(store, [witness])
    code, stdout, stderr = cli("verify", "--db", str(batched.db), witness)
    assert code == 1 and stdout == "" and len(stderr.splitlines()) == 1 and "does not verify" in stderr


def test_a_batch_signature_copied_onto_another_receipt_fails(batched: Batched) -> None:
    with batched.store() as store:  # signed alone; then given the second batch's signature instead
        extra = store.append(make_receipt("note", measurements={"copy": True}))
    batched.sql("UPDATE receipt_signatures SET signature = ? WHERE receipt_seq = ?",
                batched.signature_of(batched.ids[signing.MAX_BATCH]), extra.seq)
    with batched.store() as store:
        with pytest.raises(SignatureInvalid):  # the copy: its leaf committed to its own signature, not the batch's
            vt.check_signatures(store, [extra.receipt.id])
        # and the batch it was copied from now names one receipt too many: the one whose leaf no longer matches
        with pytest.raises(vt.ReceiptRewritten, match=extra.receipt.id):
            vt.check_signatures(store, [batched.ids[-1]])


def test_a_deleted_member_fails_the_rest_of_its_batch(batched: Batched) -> None:
    gone = batched.ids[-3]
    batched.sql("DELETE FROM receipt_signatures WHERE receipt_seq = (SELECT seq FROM receipts WHERE id = ?)", gone)
    batched.sql("DELETE FROM log_leaves WHERE receipt_seq = (SELECT seq FROM receipts WHERE id = ?)", gone)
    batched.sql("DELETE FROM receipts WHERE id = ?", gone)
    with batched.store() as store, pytest.raises(SignatureInvalid, match="does not verify"):
        vt.check_signatures(store, [batched.ids[-1]])


def test_a_rewritten_member_is_named_when_a_batch_mate_is_checked(batched: Batched) -> None:
    target = batched.ids[5]
    with batched.store() as store:
        body = json.loads(store.get(target).receipt.body)
    body["measurements"]["i"] = 5000
    forged = Receipt.from_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    batched.sql("UPDATE receipts SET id = ?, body = ? WHERE id = ?", forged.id, forged.body, target)
    with batched.store() as store, pytest.raises(vt.ReceiptRewritten, match=forged.id):
        vt.check_signatures(store, [batched.ids[0]])


def test_an_attestation_of_a_batch_member_carries_its_batch(batched: Batched, tmp_path: Path) -> None:
    rid = batched.ids[-2]
    out = tmp_path / "attestation.json"
    code, _, stderr = cli("export", "--in-toto", rid, "--out", str(out), "--db", str(batched.db), "--dir",
                          str(batched.keys))
    assert code == 0, stderr
    stmt = json.loads(base64.b64decode(json.loads(out.read_text())["payload"]))
    (sig,) = stmt["predicate"]["signatures"]
    assert sig["batch"] == batched.ids[signing.MAX_BATCH:]
    # offline, with the operator's public key only: the batch in the predicate is what the signature signs
    code, stdout, stderr = cli("verify", "--in-toto", str(out), "--log-key", batched.signer.verifier.key())
    assert code == 0, stderr
    with batched.store() as store:
        report = vt.verify_attestation(out.read_bytes(), [batched.signer.verifier],
                                       artifacts=ArtifactStore(default_root(store.url)), store=store)
    assert report.receipt == rid


def test_batch_signatures_on_both_backends(ledger_url: str) -> None:
    """The same on PostgreSQL as on SQLite: one signature per batch, found again through the index and checked once
    for every receipt, whole ledger or one receipt at a time."""
    signer = signing.generate_key("operator")
    with Store.open(ledger_url, signer=signer) as store:
        tp.register_key(store, signer)
        stored = store.append_many([make_receipt("note", measurements={"i": i}) for i in range(30)])
        ids = [s.receipt.id for s in sorted(stored, key=lambda s: s.seq)]
        report = vt.check_signatures(store, require=True)
        assert report.signed == {signer.verifier.label: 31}
        assert vt.check_signatures(store, [ids[13]], require=True).checked == 1
        with store.reading() as conn:
            (sig,) = tp.leaf_of(conn, ids[13])[1].signatures
            assert tlog.signed_together(conn, sig.key, sig.signature) == tuple(ids)
        # a head, then more receipts: the log's reads (proofs, leaves, the issued heads) through the same driver SQL
        head = tp.sign_head(store, signer)
        later = store.append(make_receipt("note", measurements={"after": "the head"}))
        proved = vt.verify_head(store, head, trusted=[signer.verifier])
        assert (proved.checkpoint.size, proved.ledger_size, proved.included, proved.appended_since) == (31, 32, 32, 1)
        assert vt.verify_head(store, head, trusted=[signer.verifier], receipts=[later.receipt.id]).included == 1
        assert tp.issued_checkpoints(store)[-1].size == 31
