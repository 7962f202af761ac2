"""Operator keys (ledger/transparency.py, `ledger keys`): 0600 files in a key directory, never in the database; public
keys registered by `key` receipts with their chain rule; the main job's operator_setup."""

from __future__ import annotations

import json
import sqlite3
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ledger import note
from ledger import transparency as tp
from ledger.chain import check_receipt
from ledger.cli import app
from ledger.errors import ChainBroken, InputError
from ledger.kinds import spec
from ledger.receipts import make_receipt
from ledger.rules import KEY_FORMAT
from ledger.signing import generate_key, load_private_key
from ledger.store import Store
from ledger.transparency_errors import KeyDirectoryExposed, KeyFileExposed, MalformedKey


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args), env=env)
    return r.exit_code, r.stdout, r.stderr


def test_keys_new_list_export(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    code, stdout, stderr = cli("keys", "new", "alice", "--dir", str(keys))
    assert code == 0, stderr
    path = keys / "alice.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(keys.stat().st_mode) == 0o700
    public = stdout.splitlines()[0]
    assert public.startswith("alice+") and note.Verifier.from_key(public).alg == note.ALG_ED25519
    assert cli("keys", "export", "alice", "--dir", str(keys))[1] == public + "\n"
    assert cli("keys", "new", "w", "--witness", "--dir", str(keys))[0] == 0
    code, stdout, _ = cli("keys", "list", "--dir", str(keys), "--json")
    listed = {k["name"]: k for k in json.loads(stdout)["keys"]}
    assert listed["alice"]["public_key"] == public and not listed["alice"]["witness"] and listed["w"]["witness"]
    # never overwritten
    code, _, stderr = cli("keys", "new", "alice", "--dir", str(keys))
    assert code == 2 and "never overwritten" in stderr
    assert (keys / "alice.key").read_text().startswith("PRIVATE+KEY+alice+")


def test_the_key_directory_from_the_environment(tmp_path: Path) -> None:
    code, _, stderr = cli("keys", "new", "bob", env={"LEDGER_KEYS": str(tmp_path / "env-keys")})
    assert code == 0, stderr
    assert (tmp_path / "env-keys" / "bob.key").exists()


@pytest.mark.parametrize("name", ["", "a b", "a/b", "a+b", ".hidden", "x" * 101])
def test_a_key_name_must_be_a_safe_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError, match="key name"):
        tp.create_key(name, tmp_path)


def test_an_exposed_or_unknown_key_is_refused(tmp_path: Path) -> None:
    tp.create_key("alice", tmp_path)
    (tmp_path / "alice.key").chmod(0o640)
    with pytest.raises(KeyFileExposed):
        tp.load_key("alice", tmp_path)
    code, _, stderr = cli("keys", "export", "alice", "--dir", str(tmp_path))
    assert code == 2 and "chmod 600" in stderr
    code, _, stderr = cli("keys", "export", "nobody", "--dir", str(tmp_path))
    assert code == 3 and "no key 'nobody'" in stderr


def test_register_and_list_against_a_ledger(tmp_path: Path) -> None:
    keys, db = tmp_path / "keys", tmp_path / "ledger.db"
    assert cli("init", "--db", str(db))[0] == 0
    assert cli("keys", "new", "alice", "--dir", str(keys))[0] == 0
    code, stdout, stderr = cli("keys", "register", "alice", "--dir", str(keys), "--db", str(db), "--json")
    assert code == 0, stderr
    first = json.loads(stdout)
    assert first["new"] and json.loads(cli("keys", "register", "alice", "--dir", str(keys), "--db", str(db),
                                           "--json")[1])["new"] is False  # one registration, one receipt
    code, stdout, _ = cli("keys", "list", "--dir", str(keys), "--db", str(db))
    assert f"registered by {first['receipt']}" in stdout
    with Store.open(db) as store:
        (reg,) = tp.registered_keys(store).values()
        assert reg.receipt == first["receipt"] and reg.leaf_index == 0
        key_receipt = store.get(first["receipt"]).receipt
    assert key_receipt.measurements == {"format": KEY_FORMAT, "key": tp.load_key("alice", keys).verifier.key()}
    # the private key is nowhere in the database (PRIVATE+KEY+<name>+<hash>+<base64>: base64 may hold a "+" too)
    private = (keys / "alice.key").read_text().strip().split("+", 4)[4]
    assert len(private) == 44, private  # 1 algorithm byte and 32 key bytes, base64
    with sqlite3.connect(db) as conn:
        dump = "\n".join(conn.iterdump())
    assert private not in dump


def test_the_key_kind_rule() -> None:
    good = tp.key_receipt(generate_key("alice").verifier, rank=3)
    check_receipt(good, {})
    spec("key").schema.check(good)
    witness = note.Signer.generate("w", note.ALG_COSIGNATURE_V1).verifier
    for bad in (make_receipt("key", measurements={"format": KEY_FORMAT, "key": "not a key"}),
                make_receipt("key", measurements={"format": KEY_FORMAT, "key": witness.key()}),
                make_receipt("key", measurements={"format": KEY_FORMAT, "key": 7}),
                make_receipt("key", step=1, measurements=dict(good.measurements)),
                make_receipt("key", parents=[good], measurements=dict(good.measurements))):
        parents = {good.id: good} if bad.parents else {}
        with pytest.raises(ChainBroken):
            check_receipt(bad, parents)


def test_operator_setup_creates_and_registers_the_key_once(tmp_path: Path) -> None:
    signer = tp.operator_setup(tmp_path)
    path = tp.operator_key_path(tmp_path)
    assert path == tmp_path / "keys" / "operator.key" and stat.S_IMODE(path.stat().st_mode) == 0o600
    again = tp.operator_setup(tmp_path)
    assert again.key() == signer.key()
    with Store.open(tmp_path / "ledger.db") as store:
        assert store.count() == 1
        assert list(tp.registered_keys(store)) == [signer.verifier.label]
        tp.export_head(store, signer, tmp_path / "log-head.txt")
    note.verify_checkpoint((tmp_path / "log-head.txt").read_bytes(), signer.verifier)


def test_a_fifo_where_a_key_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO of mode 0600 under a key's name (or as LEDGER_SIGNING_KEY): opened non-blocking and refused as not a
    regular file, where a plain open waited forever for a writer."""
    import os

    os.mkfifo(tmp_path / "alice.key", 0o600)
    code, _, stderr = cli("keys", "export", "alice", "--dir", str(tmp_path))
    assert code == 2 and "not a regular file" in stderr, stderr
    with pytest.raises(MalformedKey, match="not a regular file"):
        load_private_key(tmp_path / "alice.key")


def test_log_head_out_refuses_to_replace_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """--out is written through a temporary file renamed over it: a FIFO, a device or a symbolic link there would
    be replaced by a regular file (as root, `--out /dev/full` replaced the device). Refused, left as it was."""
    import os

    keys, db = tmp_path / "keys", tmp_path / "ledger.db"
    assert cli("init", "--db", str(db))[0] == 0
    assert cli("keys", "new", "operator", "--dir", str(keys))[0] == 0
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real.txt").write_text("keep\n")
    (tmp_path / "link").symlink_to(tmp_path / "real.txt")
    for target, kind in (("fifo", "a FIFO"), ("link", "a symbolic link")):
        code, stdout, stderr = cli("log-head", "--db", str(db), "--dir", str(keys), "--out", str(tmp_path / target))
        assert code == 2 and f"is {kind}; refusing to replace it" in stderr and stdout == "", stderr
    assert (tmp_path / "fifo").is_fifo() and (tmp_path / "link").is_symlink()
    assert (tmp_path / "real.txt").read_text() == "keep\n"
    code, _, stderr = cli("log-head", "--db", str(db), "--dir", str(keys), "--out", str(tmp_path / "real.txt"))
    assert code == 0 and (tmp_path / "real.txt").read_text().startswith("training-ledger/"), stderr


def test_key_file_errors_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty key file, a public key where the private one belongs, a witness key as LEDGER_SIGNING_KEY: each
    error names the file (never the key string)."""
    import os

    empty = tmp_path / "empty.key"
    empty.write_text("")
    os.chmod(empty, 0o600)
    with pytest.raises(MalformedKey, match=f"{empty} is empty"):
        load_private_key(empty)
    signer = generate_key("alice")
    public = tmp_path / "public.key"
    public.write_text(signer.verifier.key() + "\n")
    os.chmod(public, 0o600)
    with pytest.raises(MalformedKey, match=f"{public}: a public"):
        load_private_key(public)
    tp.create_key("w", tmp_path, witness=True)
    monkeypatch.setenv("LEDGER_SIGNING_KEY", str(tmp_path / "w.key"))
    code, _, stderr = cli("log", "--db", str(tmp_path / "absent.db"))
    assert code == 2 and "LEDGER_SIGNING_KEY" in stderr, stderr
    assert "w.key is a witness (cosignature/v1) key: receipts" in stderr, stderr


def test_keys_list_shows_every_good_key_beside_a_bad_file(tmp_path: Path) -> None:
    """A malformed or exposed key file used to stop the listing at itself: every key that loads is listed, each bad
    file with what is wrong with it, and the command fails with the first one's error (exit 2)."""
    keys = tmp_path / "keys"
    for name in ("alice", "zed"):
        assert cli("keys", "new", name, "--dir", str(keys))[0] == 0
    (keys / "broken.key").write_text("not a key\n")
    (keys / "broken.key").chmod(0o600)
    (keys / "open.key").write_text((keys / "alice.key").read_text())
    (keys / "open.key").chmod(0o644)
    code, stdout, stderr = cli("keys", "list", "--dir", str(keys))
    assert code == 2 and stderr.count("\n") == 1 and "broken.key" in stderr
    lines = stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["alice", "zed", "broken", "open"]
    assert "unusable:" in lines[2] and "broken.key" in lines[2] and "mode 0644" in lines[3]
    code, stdout, _ = cli("keys", "list", "--dir", str(keys), "--json")
    value = json.loads(stdout)
    assert code == 2 and [k["name"] for k in value["keys"]] == ["alice", "zed"]
    assert [(u["name"], "mode 0644" in u["problem"]) for u in value["unusable"]] == [("broken", False), ("open", True)]
    (keys / "broken.key").unlink()
    (keys / "open.key").unlink()
    code, stdout, _ = cli("keys", "list", "--dir", str(keys), "--json")
    assert code == 0 and json.loads(stdout)["unusable"] == []


def test_a_key_directory_others_may_write_to_is_refused(tmp_path: Path) -> None:
    """A new key is not written where group or others could remove or replace it; the directory is left as it was."""
    keys = tmp_path / "shared"
    keys.mkdir()
    for mode in (0o777, 0o1777, 0o720, 0o702):
        keys.chmod(mode)
        with pytest.raises(KeyDirectoryExposed) as info:
            tp.create_key("alice", keys)
        assert info.value.actual == f"{mode:04o}" and stat.S_IMODE(keys.stat().st_mode) == mode
        assert not (keys / "alice.key").exists()
    code, _, stderr = cli("keys", "new", "alice", "--dir", str(keys))
    assert code == 2 and stderr.count("\n") == 1 and "chmod 700" in stderr and "mode 0702" in stderr
    keys.chmod(0o755)  # readable by others is fine: the key files themselves are 0600
    tp.create_key("alice", keys)
    assert stat.S_IMODE((keys / "alice.key").stat().st_mode) == 0o600


def test_a_file_given_as_the_key_directory_is_named(tmp_path: Path) -> None:
    """Not an empty directory (`keys list` said "no keys"), nor an existing key (`keys new` said "never
    overwritten"), nor a missing key to create (`keys export` advised `keys new`, which then failed)."""
    not_a_dir = tmp_path / "keys"
    not_a_dir.write_bytes(b"a file")
    for args in (("keys", "new", "alice"), ("keys", "list"), ("keys", "export", "alice"), ("log-head",)):
        code, stdout, stderr = cli(*args, "--dir", str(not_a_dir))
        assert (code, stdout) == (2, ""), (args, stderr)
        assert stderr == f"ledger: error: key directory {not_a_dir} is a regular file, not a directory\n", args
    assert not_a_dir.read_bytes() == b"a file"
    assert tp.list_keys(tmp_path / "none") == ([], [])  # a directory not made yet holds no key


def test_a_witness_key_signs_nothing_but_cosignatures(tmp_path: Path) -> None:
    """Given where an operator key goes, a witness's key is refused in one line (exit 2) before anything is signed
    or appended. Registering one used to append nothing and fail as a broken chain rule (exit 1)."""
    keys, db = tmp_path / "keys", tmp_path / "ledger.db"
    for setup in (("keys", "new", "op", "--dir", str(keys)), ("keys", "new", "w", "--witness", "--dir", str(keys)),
                  ("init", "--db", str(db)), ("keys", "register", "op", "--dir", str(keys), "--db", str(db))):
        assert cli(*setup)[0] == 0, setup
    receipts = tmp_path / "r.jsonl"
    receipts.write_bytes(make_receipt("note").body + b"\n")
    with sqlite3.connect(db) as conn:
        before = conn.execute("SELECT count(*) FROM receipts").fetchone()[0]
    cases: dict[tuple[str, ...], tuple[str, str]] = {
        ("keys", "register", "w", "--dir", str(keys), "--db", str(db)): ("key w", "key registrations"),
        ("log-head", "--key", "w", "--dir", str(keys), "--db", str(db)): ("key w", "log heads"),
        ("keys", "revoke", "op", "--key", "w", "--dir", str(keys), "--db", str(db)): ("key w", "revocations"),
        ("export", "--in-toto", "0000", "--key", "w", "--dir", str(keys), "--db", str(db)): ("key w", "attestations"),
    }
    for args, (who, what) in cases.items():
        code, stdout, stderr = cli(*args)
        assert (code, stdout) == (2, ""), (args, stderr)
        assert stderr == (f"ledger: error: {who} is a witness (cosignature/v1) key: {what} are signed with an "
                          "Ed25519 operator key\n"), args
    code, _, stderr = cli("append", str(receipts), "--db", str(db), env={"LEDGER_SIGNING_KEY": str(keys / "w.key")})
    assert code == 2 and f"LEDGER_SIGNING_KEY={keys / 'w.key'} is a witness (cosignature/v1) key: receipts" in stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM receipts").fetchone()[0] == before  # nothing appended
