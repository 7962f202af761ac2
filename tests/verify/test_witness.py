"""The witness (verify/transparency.py, `ledger witness add-head`): it cosigns a checkpoint only when it extends the
last one it accepted for that log, proven by a consistency proof it verifies itself; it refuses a checkpoint without
a proof, a rollback, a split view and a fork, and its cosignature is a C2SP cosignature/v1 others can check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ledger import note
from ledger import transparency as tp
from ledger.cli import app
from ledger.errors import InputError
from ledger.receipts import make_receipt
from ledger.signing import generate_key
from ledger.store import Store
from ledger.transparency_errors import MalformedEnvelope, MalformedNote, SignatureInvalid
from verify import transparency as vt

T0 = 1_700_000_000


@pytest.fixture
def log(tmp_path: Path) -> tuple[Path, note.Signer]:
    signer = generate_key("operator")
    db = tmp_path / "ledger.db"
    with Store.open(db, create=True, signer=signer) as store:
        tp.register_key(store, signer)
        grow(store, 3, "a")
    return db, signer


def grow(store: Store, n: int, salt: str) -> None:
    store.append_many([make_receipt("note", measurements={"salt": salt, "i": i}) for i in range(n)])


def head(db: Path, signer: note.Signer) -> bytes:
    with Store.open(db) as store:
        return tp.sign_head(store, signer)


def witness() -> note.Signer:
    return note.Signer.generate("witness.example", note.ALG_COSIGNATURE_V1)


def test_the_witness_cosigns_what_extends_what_it_saw(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    w = witness()
    first = vt.witness_add_head(tmp_path / "w", head(db, signer), w, log_key=signer.verifier, timestamp=T0)
    assert first.previous is None
    checked = note.verify_checkpoint(first.cosigned, signer.verifier, witnesses=[w.verifier], quorum=1)
    assert checked.cosignatures[0].timestamp == T0
    with Store.open(db, signer=signer) as store:
        grow(store, 5, "b")
        second = vt.witness_add_head(tmp_path / "w", tp.sign_head(store, signer), w, store=store, timestamp=T0 + 1)
    assert second.previous == first.checkpoint.size and second.proof_hashes > 0
    assert second.checkpoint.size == first.checkpoint.size + 5
    # the state keeps the last cosigned checkpoint, and the log's key pinned the first time
    where = next((tmp_path / "w").iterdir())
    assert (where / "checkpoint").read_bytes() == second.cosigned
    assert note.Verifier.from_key((where / "log.vkey").read_text()) == signer.verifier


def test_a_head_without_a_consistency_proof_is_refused(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    w = witness()
    vt.witness_add_head(tmp_path / "w", head(db, signer), w, log_key=signer.verifier, timestamp=T0)
    with Store.open(db, signer=signer) as store:
        grow(store, 2, "b")
    later = head(db, signer)
    with pytest.raises(vt.WitnessRefused, match="no consistency proof"):
        vt.witness_add_head(tmp_path / "w", later, w, timestamp=T0 + 1)  # no ledger to prove it from
    state = next((tmp_path / "w").iterdir()) / "checkpoint"
    assert note.parse_checkpoint(note.parse_note(state.read_bytes()).text).size == 4  # unchanged


def test_a_fork_and_a_rollback_are_refused(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    w = witness()
    fork = tmp_path / "fork.db"
    shutil.copy(db, fork)  # a second ledger grown from the same history
    with Store.open(db, signer=signer) as store:
        grow(store, 3, "main")
    seen = vt.witness_add_head(tmp_path / "w", head(db, signer), w, log_key=signer.verifier, timestamp=T0)
    with Store.open(fork, signer=signer) as store:
        grow(store, 5, "fork")
        forked = tp.sign_head(store, signer)
        with pytest.raises(vt.WitnessRefused, match="does not extend the last checkpoint"):
            vt.witness_add_head(tmp_path / "w", forked, w, store=store, timestamp=T0 + 1)
    # a rollback: an older head of the main log, after a newer one was accepted
    with Store.open(db, signer=signer) as store:
        grow(store, 1, "more")
        vt.witness_add_head(tmp_path / "w", tp.sign_head(store, signer), w, store=store, timestamp=T0 + 2)
    with pytest.raises(vt.WitnessRefused, match="rollback"):
        vt.witness_add_head(tmp_path / "w", seen.cosigned, w, timestamp=T0 + 3)


def test_a_second_root_for_a_size_seen_is_a_split_view(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    w = witness()
    other = tmp_path / "other.db"
    shutil.copy(db, other)
    with Store.open(db, signer=signer) as store:
        grow(store, 2, "one")
        one = tp.sign_head(store, signer)
    with Store.open(other, signer=signer) as store:
        grow(store, 2, "two")
        two = tp.sign_head(store, signer)
    vt.witness_add_head(tmp_path / "w", one, w, log_key=signer.verifier, timestamp=T0)
    with pytest.raises(vt.WitnessRefused, match="split view"):
        vt.witness_add_head(tmp_path / "w", two, w, timestamp=T0 + 1)


def test_a_head_signed_by_another_key_is_refused(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    w = witness()
    vt.witness_add_head(tmp_path / "w", head(db, signer), w, log_key=signer.verifier, timestamp=T0)
    impostor = note.Signer(signer.name, generate_key("x").private_key)  # same name, another key
    with Store.open(db) as store:
        forged = tp.sign_head(store, impostor, record=False)
    with pytest.raises(Exception, match="no valid signature|does not verify"):
        vt.witness_add_head(tmp_path / "w", forged, w, timestamp=T0 + 1)
    with pytest.raises(vt.WitnessRefused, match="pinned"):
        vt.witness_add_head(tmp_path / "w", forged, w, log_key=impostor.verifier, timestamp=T0 + 1)
    tampered = bytearray(head(db, signer))
    tampered[-10] ^= 1  # a signature byte flipped
    with pytest.raises((SignatureInvalid, Exception)):
        vt.witness_add_head(tmp_path / "w", bytes(tampered), w, timestamp=T0 + 1)


def test_the_cli(tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    db, signer = log
    keys = tmp_path / "keys"
    runner = CliRunner()

    def cli(*args: str) -> tuple[int, str, str]:
        r = runner.invoke(app, list(args))
        return r.exit_code, r.stdout, r.stderr

    assert cli("keys", "new", "w1", "--witness", "--dir", str(keys))[0] == 0
    h1 = tmp_path / "h1.txt"
    h1.write_bytes(head(db, signer))
    state = tmp_path / "state"
    code, stdout, stderr = cli("witness", "add-head", str(h1), "--state", str(state), "--key", "w1", "--dir",
                               str(keys), "--db", str(db))
    assert code == 0, stderr
    assert stdout.startswith(h1.read_text()) and "\u2014 w1 " in stdout  # the checkpoint, cosigned
    with Store.open(db, signer=signer) as store:
        grow(store, 2, "b")
    h2 = tmp_path / "h2.txt"
    h2.write_bytes(head(db, signer))
    code, stdout, stderr = cli("witness", "add-head", str(h2), "--state", str(state), "--key", "w1", "--dir",
                               str(keys))
    assert code == 1 and stdout == "" and len(stderr.splitlines()) == 1 and "no consistency proof" in stderr
    out = tmp_path / "c2.txt"
    code, stdout, stderr = cli("witness", "add-head", str(h2), "--state", str(state), "--key", "w1", "--dir",
                               str(keys), "--db", str(db), "--out", str(out), "--json")
    assert code == 0, stderr
    wkey = cli("keys", "export", "w1", "--dir", str(keys))[1].strip()
    note.verify_checkpoint(out.read_bytes(), signer.verifier, witnesses=[note.Verifier.from_key(wkey)], quorum=1)
    # and `ledger verify --head` can require that witness's cosignature
    code, _, stderr = cli("verify", "--db", str(db), "--head", str(out), "--witness-key", wkey)
    assert code == 0, stderr
    code, _, stderr = cli("verify", "--db", str(db), "--head", str(h2), "--witness-key", wkey)
    assert code == 1 and "cosignature" in stderr
    (tmp_path / "w1.pub").write_text(wkey + "\n")  # the key as a file holding it
    code, _, stderr = cli("verify", "--db", str(db), "--head", str(out), "--witness-key", str(tmp_path / "w1.pub"))
    assert code == 0, stderr
    (tmp_path / "w1.bin").write_bytes(b"\x80\x04\x95\xba")  # not a key file: one line, no traceback
    code, _, stderr = cli("verify", "--db", str(db), "--head", str(out), "--witness-key", str(tmp_path / "w1.bin"))
    assert code == 2 and stderr.splitlines() == [f"ledger: error: malformed key: {tmp_path / 'w1.bin'} is not a key "
                                                 "file (not ASCII)"]
    # an operator key cannot witness
    assert cli("keys", "new", "op", "--dir", str(keys))[0] == 0
    code, _, stderr = cli("witness", "add-head", str(h2), "--state", str(state), "--key", "op", "--dir", str(keys))
    assert code == 1 and "not a witness" in stderr


def test_the_witness_state_is_read_only_from_regular_files_and_named_when_damaged(
        tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    import os

    db, signer = log
    w = witness()
    vt.witness_add_head(tmp_path / "w", head(db, signer), w, log_key=signer.verifier, timestamp=T0)
    where = next((tmp_path / "w").iterdir())
    (where / "checkpoint").write_bytes(b"garbage\n")
    with pytest.raises(InputError, match=f"witness state {where / 'checkpoint'} is damaged"):
        vt.witness_add_head(tmp_path / "w", head(db, signer), w, timestamp=T0 + 1)
    (where / "checkpoint").unlink()
    os.mkfifo(where / "checkpoint")  # refused unopened: a plain read waited forever for a writer
    with pytest.raises(InputError, match="is a FIFO"):
        vt.witness_add_head(tmp_path / "w", head(db, signer), w, timestamp=T0 + 1)


def test_a_head_or_envelope_file_that_is_a_fifo_a_device_or_too_large_is_refused_unread(
        tmp_path: Path, log: tuple[Path, note.Signer]) -> None:
    """`verify --head`, `verify --in-toto` and `witness add-head` read the file they are given through one reader:
    a FIFO no longer blocks them, /dev/zero is no longer read without end, and a file larger than a signed note (or
    an envelope) may be is refused before it is parsed. One line, exit 2 each."""
    import os

    from ledger import dsse

    db, _ = log
    runner = CliRunner()
    keys = tmp_path / "keys"
    assert runner.invoke(app, ["keys", "new", "w", "--witness", "--dir", str(keys)]).exit_code == 0
    os.mkfifo(tmp_path / "head.fifo")
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (note.MAX_NOTE_BYTES + 1))
    commands = (["verify", "--db", str(db), "--head"], ["verify", "--db", str(db), "--in-toto"],
                ["witness", "add-head", "--state", str(tmp_path / "state"), "--key", "w", "--dir", str(keys)])
    for path, said in ((tmp_path / "head.fifo", "is a FIFO, not a regular file"),
                       (Path("/dev/zero"), "is a character device, not a regular file")):
        for command in commands:
            r = runner.invoke(app, [*command, str(path)])
            assert r.exit_code == 2 and r.stderr == f"ledger: error: {path}: {said}; refusing to read it\n", r.output
    for command in (commands[0], commands[2]):
        r = runner.invoke(app, [*command, str(big)])
        assert r.exit_code == 2 and r.stderr == (f"ledger: error: {big}: is larger than {note.MAX_NOTE_BYTES:,} "
                                                 "bytes; refusing to read it\n"), r.output
    # the parsers hold the same bounds, whoever calls them
    with pytest.raises(MalformedNote, match="larger than a signed note may be"):
        note.parse_note(b"x" * (note.MAX_NOTE_BYTES + 1))
    with pytest.raises(MalformedEnvelope, match="larger than"):
        dsse.Envelope.from_json(b" " * (dsse.MAX_ENVELOPE_BYTES + 1))
