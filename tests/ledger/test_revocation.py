"""Key revocation (ledger/revocation.py, its rule in ledger/rules.py, its checks in verify/transparency.py, `ledger
keys revoke`), on real SQLite ledger files: a key's signatures on receipts logged after its revocation fail, naming
the key and the revocation; those before stay valid; a revocation must be signed by a registered key not revoked
before it (the revoked key itself may sign it); a key no receipt registers cannot be revoked, at append or verify."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ledger import note
from ledger import transparency as tp
from ledger.chain import check_receipt
from ledger.cli import app
from ledger.errors import ChainBroken, MissingParents, VerificationError
from ledger.kinds import spec
from ledger.receipts import Receipt, make_receipt
from ledger.revocation import (
    AmbiguousKey,
    KeyNotRegistered,
    RevocationRefused,
    revocation_receipt,
    revocations,
    revoke_key,
)
from ledger.rules import KEY_REVOCATION_FORMAT
from ledger.signing import generate_key, sign_receipt
from ledger.store import Store
from verify import transparency as vt
from verify.receipts import verify_receipt


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args), env=env)
    return r.exit_code, r.stdout, r.stderr


@dataclass
class Ledger:
    """A ledger file with two registered keys, operator and alice (their files in ``keys``)."""

    db: Path
    keys: Path
    operator: note.Signer
    alice: note.Signer

    def store(self) -> Store:
        return Store.open(self.db)

    def sign(self, signer: note.Signer, *tags: str) -> list[Receipt]:
        with Store.open(self.db, signer=signer) as store:
            return [store.append(make_receipt("note", measurements={"tag": t})).receipt for t in tags]

    def registration(self, signer: note.Signer) -> Receipt:
        with self.store() as store:
            return store.get(tp.registered_keys(store)[signer.verifier.label].receipt).receipt


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    keys, db = tmp_path / "keys", tmp_path / "ledger.db"
    operator, _ = tp.create_key("operator", keys)
    alice, _ = tp.create_key("alice", keys)
    with Store.open(db, create=True) as store:
        tp.register_key(store, operator)
        tp.register_key(store, alice)
    return Ledger(db, keys, operator, alice)


def assert_one_line(args: list[str], code: int, *patterns: str) -> None:
    got, stdout, stderr = cli(*args)
    assert got == code, (got, stdout, stderr)
    assert len(stderr.splitlines()) == 1 and stdout == "", stderr
    for p in patterns:
        assert p in stderr, (p, stderr)


# ----------------------------------------------------------------------------------------------- the semantics


def test_a_signature_after_the_revocation_fails_and_those_before_stay_valid(ledger: Ledger) -> None:
    (before,) = ledger.sign(ledger.alice, "before")
    with ledger.store() as store:
        stored, earlier = revoke_key(store, ledger.operator, "alice")
    assert stored.new and earlier is None
    revocation = stored.receipt
    (after,) = ledger.sign(ledger.alice, "after")
    label = ledger.alice.verifier.label
    with ledger.store() as store:
        assert revocations(store)[label].receipt == revocation.id
        report = vt.check_signatures(store, [before.id])  # signed before: still valid
        assert report.signed == {label: 1} and report.revoked[label].receipt == revocation.id
        with pytest.raises(vt.KeyRevoked) as info:
            vt.check_signatures(store, [after.id])
        with pytest.raises(vt.KeyRevoked):
            vt.check_signatures(store)  # the whole ledger too
    err = info.value
    assert (err.key, err.revocation, err.receipt) == (label, revocation.id, after.id)
    # the CLI: one line naming the key and the revocation receipt, exit 1; the receipt before still verifies
    assert_one_line(["verify", "--db", str(ledger.db), after.id], 1, label, revocation.id, "revoked at leaf 3")
    code, stdout, stderr = cli("verify", "--db", str(ledger.db), before.id)
    assert code == 0, stderr
    assert f"signed by {label}" in stdout and f"revoked at leaf 3 by {revocation.id}" in stdout
    code, stdout, _ = cli("verify", "--db", str(ledger.db), before.id, "--json")
    assert json.loads(stdout)["signatures"]["keys"][label]["revoked"] == {"receipt": revocation.id, "leaf_index": 3}


def test_other_keys_are_unaffected(ledger: Ledger) -> None:
    with ledger.store() as store:
        revoke_key(store, ledger.operator, ledger.alice.verifier.label)
    (r,) = ledger.sign(ledger.operator, "operator after")
    with ledger.store() as store:
        assert vt.check_signatures(store, require=True).checked == store.count()
    assert cli("verify", "--db", str(ledger.db), r.id, "--require-signatures")[0] == 0


def test_a_key_may_revoke_itself(ledger: Ledger) -> None:
    with ledger.store() as store:
        stored, _ = revoke_key(store, ledger.alice, "alice")
        assert [s.key for s in revocations(store)[ledger.alice.verifier.label].signatures] == \
            [ledger.alice.verifier.label]
        vt.check_signatures(store, require=True)  # its own revocation is signed before it takes effect
    code, _, stderr = cli("verify", "--db", str(ledger.db), stored.receipt.id)
    assert code == 0, stderr
    (after,) = ledger.sign(ledger.alice, "after")
    assert_one_line(["verify", "--db", str(ledger.db), after.id], 1, "revoked at leaf 2", stored.receipt.id)


def test_revoking_twice_appends_nothing_and_registering_again_does_not_undo_it(ledger: Ledger) -> None:
    with ledger.store() as store:
        first, _ = revoke_key(store, ledger.operator, "alice")
        count = store.count()
        again, earlier = revoke_key(store, ledger.operator, "alice")
        assert not again.new and earlier is not None and again.receipt.id == first.receipt.id
        tp.register_key(store, ledger.alice)  # the same registration: nothing appended
        tp.register_key(store, ledger.alice, rank=1)  # another registration receipt of the same key
        assert store.count() == count + 1
    (after,) = ledger.sign(ledger.alice, "after")
    with ledger.store() as store, pytest.raises(vt.KeyRevoked):
        vt.check_signatures(store, [after.id])


def test_a_head_signed_by_a_revoked_key_after_its_revocation_fails(ledger: Ledger, tmp_path: Path) -> None:
    ledger.sign(ledger.operator, "x")
    with ledger.store() as store:
        tp.export_head(store, ledger.alice, tmp_path / "before.txt")  # before the revocation: still good
        revocation, _ = revoke_key(store, ledger.operator, "alice")
        tp.export_head(store, ledger.alice, tmp_path / "after.txt")  # includes the revocation
        vt.verify_head(store, (tmp_path / "before.txt").read_bytes())
        with pytest.raises(vt.KeyRevoked, match="which the head includes"):
            vt.verify_head(store, (tmp_path / "after.txt").read_bytes())
    assert cli("verify", "--db", str(ledger.db), "--head", str(tmp_path / "before.txt"))[0] == 0
    assert_one_line(["verify", "--db", str(ledger.db), "--head", str(tmp_path / "after.txt")], 1,
                    "log head of size 4", ledger.alice.verifier.label, revocation.receipt.id)


# --------------------------------------------------------------------------------------------- who may revoke


def test_a_revocation_must_be_signed(ledger: Ledger) -> None:
    with ledger.store() as store:  # appended without a signer, behind revoke_key's back
        unsigned = store.append(revocation_receipt(ledger.registration(ledger.alice))).receipt
        with pytest.raises(vt.RevocationUnsigned) as info:
            vt.check_signatures(store)
    assert info.value.receipt == unsigned.id
    (other,) = ledger.sign(ledger.operator, "unrelated")  # whatever receipt is verified: the ledger's keys are
    assert_one_line(["verify", "--db", str(ledger.db), other.id], 1, f"key revocation {unsigned.id}", "not signed")


def test_ledger_append_refuses_a_revocation_verification_would_reject(ledger: Ledger, tmp_path: Path) -> None:
    """Anyone who may append could otherwise log an unsigned revocation (or one by a stranger's key), and every
    later verification of the ledger would fail on it: `ledger append` checks as `ledger keys revoke` does."""
    from ledger.signing import save_private_key

    revocation = revocation_receipt(ledger.registration(ledger.alice))
    path = tmp_path / "revocation.jsonl"
    path.write_bytes(revocation.body + b"\n")
    with ledger.store() as store:
        before = store.count()
    assert_one_line(["append", str(path), "--db", str(ledger.db)], 1, "must be signed")
    stranger_key = tmp_path / "stranger.key"
    save_private_key(generate_key("stranger"), stranger_key)
    code, _, stderr = cli("append", str(path), "--db", str(ledger.db), env={"LEDGER_SIGNING_KEY": str(stranger_key)})
    assert code == 1 and "not registered" in stderr, stderr
    with ledger.store() as store:
        assert store.count() == before and revocations(store) == {}
    code, _, stderr = cli("append", str(path), "--db", str(ledger.db),
                          env={"LEDGER_SIGNING_KEY": str(ledger.keys / "operator.key")})
    assert code == 0, stderr
    with ledger.store() as store:
        assert revocations(store)[ledger.alice.verifier.label].receipt == revocation.id
        vt.check_signatures(store)  # the ledger still verifies


def test_a_signature_added_to_an_unsigned_revocation_afterwards_is_caught(ledger: Ledger) -> None:
    """The leaf of a revocation committed to it being unsigned: a signature row added later does not count."""
    with ledger.store() as store:
        unsigned = store.append(revocation_receipt(ledger.registration(ledger.alice)))
    with sqlite3.connect(ledger.db) as conn:
        sig = sign_receipt(ledger.operator, unsigned.receipt.id)
        conn.execute("INSERT INTO receipt_signatures (receipt_seq, key, signature) VALUES (?, ?, ?)",
                     (unsigned.seq, sig.key, sig.signature))
    (other,) = ledger.sign(ledger.operator, "unrelated")
    with ledger.store() as store, pytest.raises(vt.ReceiptRewritten):
        vt.check_signatures(store, [other.id])


def test_a_revocation_by_an_unregistered_key_is_refused_at_append_and_at_verify(ledger: Ledger) -> None:
    stranger = generate_key("stranger")
    with ledger.store() as store:
        with pytest.raises(RevocationRefused, match="not registered"):
            revoke_key(store, stranger, "alice")
        assert revocations(store) == {}
        store.append(revocation_receipt(ledger.registration(ledger.alice)), signer=stranger)
        with pytest.raises(vt.UnregisteredKey, match="stranger"):
            vt.check_signatures(store, [])


def test_a_revoked_key_cannot_revoke(ledger: Ledger) -> None:
    args = ["keys", "revoke", "operator", "--key", "alice", "--dir", str(ledger.keys), "--db", str(ledger.db)]
    with ledger.store() as store:
        revoke_key(store, ledger.operator, "alice")
        with pytest.raises(RevocationRefused, match="was revoked at leaf 2"):
            revoke_key(store, ledger.alice, "operator")
    assert_one_line(args, 1, "cannot revoke operator+", "was revoked at leaf 2")
    with ledger.store() as store:
        # written anyway (the library bypassed): verification refuses it
        store.append(revocation_receipt(ledger.registration(ledger.operator)), signer=ledger.alice)
        with pytest.raises(vt.KeyRevoked, match="before the receipt it signs"):
            vt.check_signatures(store, [])
    # and `keys revoke` does not take that revocation for a valid one ("already revoked")
    assert_one_line(args, 1, "signed by alice+", "before the receipt it signs")


def test_a_revocation_by_a_key_registered_after_it_fails(ledger: Ledger) -> None:
    late = generate_key("late")
    with ledger.store() as store:
        store.append(revocation_receipt(ledger.registration(ledger.alice)), signer=late)
        tp.register_key(store, late)
        with pytest.raises(vt.KeyRegisteredLater):
            vt.check_signatures(store, [])


def test_a_revocation_whose_signature_was_replaced_fails(ledger: Ledger) -> None:
    with ledger.store() as store:
        stored, _ = revoke_key(store, ledger.operator, "alice")
    with sqlite3.connect(ledger.db) as conn:
        conn.execute("UPDATE receipt_signatures SET signature = ? WHERE receipt_seq = ?", (b"\x00" * 64, stored.seq))
    with ledger.store() as store, pytest.raises(VerificationError, match="does not verify"):
        vt.check_signatures(store, [])


# -------------------------------------------------------------------------------------- revoking unknown keys


def test_revoking_an_unknown_key_is_refused_at_append(ledger: Ledger) -> None:
    stranger = generate_key("stranger")
    with ledger.store() as store:
        with pytest.raises(KeyNotRegistered, match="nothing to revoke"):
            revoke_key(store, ledger.operator, "stranger")
        count = store.count()
        # by hand: citing a registration that is not in the ledger, another key's, or no receipt at all
        with pytest.raises(MissingParents):
            store.append(revocation_receipt(tp.key_receipt(stranger.verifier)), signer=ledger.operator)
        forged = make_receipt("key", parents=[ledger.registration(ledger.alice)],
                              measurements={"format": KEY_REVOCATION_FORMAT, "key": stranger.verifier.key()})
        with pytest.raises(ChainBroken, match="names the key its cited key receipt registers"):
            store.append(forged, signer=ledger.operator)
        orphan = make_receipt("key", measurements={"format": KEY_REVOCATION_FORMAT, "key": stranger.verifier.key()})
        with pytest.raises(ChainBroken, match="cites exactly one key receipt"):
            store.append(orphan, signer=ledger.operator)
        assert store.count() == count
    assert_one_line(["keys", "revoke", "stranger", "--dir", str(ledger.keys), "--db", str(ledger.db)], 3,
                    "no key 'stranger' is registered")


def test_revoking_an_unknown_key_is_refused_at_verify(ledger: Ledger) -> None:
    """A revocation of another key than the registration it cites, stored with the chain rules skipped."""
    stranger = generate_key("stranger")
    forged = make_receipt("key", parents=[ledger.registration(ledger.alice)],
                          measurements={"format": KEY_REVOCATION_FORMAT, "key": stranger.verifier.key()})
    with ledger.store() as store:
        store.append(forged, check=False, signer=ledger.operator)
        with pytest.raises(ChainBroken):
            vt.check_signatures(store, [])
        with pytest.raises(ChainBroken):
            verify_receipt(store, forged.id)
    assert_one_line(["verify", "--db", str(ledger.db), forged.id], 1, "chain rule broken")


def test_the_revocation_rule_and_schema(ledger: Ledger) -> None:
    registration = ledger.registration(ledger.alice)
    good = revocation_receipt(registration)
    check_receipt(good, {registration.id: registration})
    spec("key").schema.check(good)
    assert list(good.parents) == [registration.id] and good.run is None and good.rank is None
    note_receipt = make_receipt("note", measurements={"x": 1})
    revocation_of_revocation = make_receipt("key", parents=[good], measurements=dict(good.measurements))
    for bad, parents in (
        (make_receipt("key", parents=[note_receipt], measurements=dict(good.measurements)), [note_receipt]),
        (revocation_of_revocation, [good]),
        (make_receipt("key", parents=[registration], step=1, measurements=dict(good.measurements)), [registration]),
        (make_receipt("key", parents=[registration], measurements={"format": KEY_REVOCATION_FORMAT, "key": "x"}),
         [registration]),
    ):
        with pytest.raises(ChainBroken):
            check_receipt(bad, {p.id: p for p in parents})


# ----------------------------------------------------------------------------------------------------- the CLI


def test_keys_revoke_by_name_label_or_key_id_and_keys_list(ledger: Ledger) -> None:
    base = ["--dir", str(ledger.keys), "--db", str(ledger.db)]
    alice = ledger.alice.verifier
    code, stdout, stderr = cli("keys", "revoke", f"{alice.key_id:08x}", *base, "--json")
    assert code == 0, stderr
    value = json.loads(stdout)
    assert value["new"] and value["label"] == alice.label and value["signed_by"] == [ledger.operator.verifier.label]
    code, stdout, _ = cli("keys", "revoke", alice.label, *base)
    assert code == 0 and stdout.startswith(f"already revoked {alice.label}: {value['receipt']}")
    code, stdout, _ = cli("keys", "revoke", alice.key(), *base, "--json")
    assert json.loads(stdout)["new"] is False
    code, stdout, _ = cli("keys", "list", *base, "--json")
    listed = {k["name"]: k for k in json.loads(stdout)["keys"]}
    assert listed["alice"]["revoked"] == value["receipt"] and listed["operator"]["revoked"] is None
    code, stdout, _ = cli("keys", "list", *base)
    assert f"revoked by {value['receipt']}" in stdout


def test_a_key_name_two_registered_keys_share_is_ambiguous(ledger: Ledger, tmp_path: Path) -> None:
    other, _ = tp.create_key("alice", tmp_path / "elsewhere")  # another key named alice
    with ledger.store() as store:
        tp.register_key(store, other)
        with pytest.raises(AmbiguousKey):
            revoke_key(store, ledger.operator, "alice")
        stored, _ = revoke_key(store, ledger.operator, other.verifier.label)  # the label says which
        assert stored.receipt.measurements["key"] == other.verifier.key()
    assert_one_line(["keys", "revoke", "alice", "--dir", str(ledger.keys), "--db", str(ledger.db)], 3,
                    "matches 2 registered keys")


def test_a_witness_key_cannot_sign_a_revocation(ledger: Ledger) -> None:
    tp.create_key("w", ledger.keys, witness=True)
    assert_one_line(["keys", "revoke", "alice", "--key", "w", "--dir", str(ledger.keys), "--db", str(ledger.db)], 2,
                    "witness")


def test_a_witness_refuses_a_head_by_the_log_key_after_its_revocation(ledger: Ledger, tmp_path: Path) -> None:
    """A witness given the ledger reads its revocations: a checkpoint whose tree includes a checked revocation of
    the log key that signed it is refused, one from before the revocation is cosigned."""
    witness, _ = tp.create_key("witness", ledger.keys, witness=True)
    state = tmp_path / "witness"
    ledger.sign(ledger.operator, "x")
    with ledger.store() as store:
        before = tp.sign_head(store, ledger.alice)
        assert vt.witness_add_head(state, before, witness, log_key=ledger.alice.verifier, store=store).checkpoint
        revocation, _ = revoke_key(store, ledger.operator, "alice")
        after = tp.sign_head(store, ledger.alice)
        with pytest.raises(vt.WitnessRefused, match=f"was revoked at leaf .* by {revocation.receipt.id}"):
            vt.witness_add_head(state, after, witness, store=store)
    # and through the CLI, one line, with nothing accepted: the state still holds the head from before
    head_file = tmp_path / "after.txt"
    head_file.write_bytes(after)
    code, stdout, stderr = cli("witness", "add-head", str(head_file), "--db", str(ledger.db), "--state", str(state),
                               "--key", "witness", "--dir", str(ledger.keys))
    assert code == 1 and stdout == "" and len(stderr.splitlines()) == 1 and "revoked" in stderr, stderr
    (kept,) = state.glob("*/checkpoint")
    assert note.parse_checkpoint(note.parse_note(kept.read_bytes()).text) == note.parse_checkpoint(
        note.parse_note(before).text)


# ------------------------------------------------------------------------------------------- an edited index


def test_a_revocation_hidden_by_its_kind_column_fails_against_a_head(ledger: Ledger, tmp_path: Path) -> None:
    """Readers find key receipts by the kind column; a revocation relabelled 'note' there would cancel itself. The
    head that includes it sees every row's index compared with its body."""
    with ledger.store() as store:
        stored, _ = revoke_key(store, ledger.operator, "alice")
    (after,) = ledger.sign(ledger.alice, "after")
    with ledger.store() as store:
        tp.export_head(store, ledger.operator, tmp_path / "head.txt")
    revocation = stored.receipt.id
    with sqlite3.connect(ledger.db) as conn:
        conn.execute("UPDATE receipts SET kind = 'note' WHERE id = ?", (revocation,))
    assert_one_line(["verify", "--db", str(ledger.db), "--head", str(tmp_path / "head.txt")], 1, revocation,
                    "kind")
    with sqlite3.connect(ledger.db) as conn:  # put back: the same head verifies again, every row counted
        conn.execute("UPDATE receipts SET kind = 'key' WHERE id = ?", (revocation,))
    with ledger.store() as store:
        report = vt.verify_head(store, (tmp_path / "head.txt").read_bytes())
        assert report.rows_checked == store.count() == 4
    assert after.id  # signed after the revocation: `verify` of it fails as before (above)


def test_a_row_labelled_key_that_is_not_one_fails_in_one_line(ledger: Ledger) -> None:
    (note_,) = ledger.sign(ledger.operator, "a note")
    with sqlite3.connect(ledger.db) as conn:
        conn.execute("UPDATE receipts SET kind = 'key' WHERE id = ?", (note_.id,))
    with ledger.store() as store, pytest.raises(VerificationError, match="kind"):
        tp.registered_keys(store)
    assert_one_line(["verify", "--db", str(ledger.db), note_.id], 1, note_.id, "kind")
