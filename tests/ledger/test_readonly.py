"""Read-only storage (issue 10, points 4 and 10): an auditor's read-only copy of a ledger verifies, appending to it
is one line and exit 4, relative locations resolve against the ledger's directory, and artifact files are
readable by other users.

Permissions are checked by a process that cannot bypass them. Tests run as root (in CI too), and root ignores
permission bits; the interpreter lives where another user may not be able to run it (under /root here), so the
CLI runs as root with no capabilities at all (``setpriv``): file modes then bind it as they bind an owner.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ledger import digests
from ledger.artifacts import ArtifactStore, atomic_write
from ledger.cli import app
from ledger.errors import EXIT_DATABASE, DatabaseError
from ledger.receipts import Receipt, make_receipt
from ledger.state import write_manifest
from ledger.store import Store
from tests.conftest import TinyExperiment, build_chain, schema_fill
from tests.helpers_state import make_checkpoint

runner = CliRunner()
TIMEOUT_S = 120.0


def unprivileged() -> list[str]:
    """The command prefix that runs a process bound by file permissions: none when not root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop root's capabilities"
    return [setpriv, "--inh-caps=-all", "--bounding-set=-all", "--"]


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    return subprocess.run([*unprivileged(), sys.executable, "-m", "ledger.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def ok(*args: str | Path) -> subprocess.CompletedProcess[str]:
    proc = cli(*args)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ledger: error: "), proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_the_unprivileged_process_really_is_bound_by_permissions(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.write_text("x")
    locked.chmod(0o444)
    probe = subprocess.run([*unprivileged(), sys.executable, "-c", f"open({str(locked)!r}, 'a')"],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert probe.returncode != 0 and "Permission denied" in probe.stderr


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[tuple[Path, list[Receipt]]]:
    """A ledger with one chain, in its own directory; the directory is made writable again afterwards."""
    home = tmp_path / "ledger"
    home.mkdir()
    chain = build_chain().receipts()
    with Store.open(home / "ledger.db", create=True) as store:
        store.append_many(chain)
    yield home / "ledger.db", chain
    home.chmod(0o755)


def _more(tmp_path: Path) -> Path:
    path = tmp_path / "more.jsonl"
    path.write_bytes(b"".join(r.body + b"\n" for r in build_chain(salt="more").receipts()))
    return path


def _ids(db: Path | str) -> list[str]:
    return [s["id"] for s in json.loads(ok("log", "--db", db, "--json").stdout)]


def test_appending_to_a_read_only_file_is_one_line_and_exit_4(ledger: tuple[Path, list[Receipt]],
                                                              tmp_path: Path) -> None:
    db, chain = ledger
    db.chmod(0o444)
    line = one_line(cli("append", _more(tmp_path), "--db", db), EXIT_DATABASE)
    assert line == f"ledger: error: cannot write to {db}: opened read-only (the file is not writable by this user)"
    assert _ids(db) == [r.id for r in chain]


def test_reads_work_in_a_read_only_directory(ledger: tuple[Path, list[Receipt]], tmp_path: Path) -> None:
    db, chain = ledger
    db.parent.chmod(0o555)
    before = sorted(os.listdir(db.parent))
    assert _ids(db) == [r.id for r in chain]
    assert json.loads(ok("show", chain[-1].id, "--db", db, "--json").stdout)["id"] == chain[-1].id
    report = json.loads(ok("verify", chain[-1].id, "--db", db, "--json").stdout)
    assert report["ok"] and report["receipts_checked"] == len(chain) - 1  # all but the contract
    line = one_line(cli("append", _more(tmp_path), "--db", db), EXIT_DATABASE)
    assert "opened read-only (its directory is not writable by this user)" in line
    assert sorted(os.listdir(db.parent)) == before  # no -wal or -shm left behind


def test_the_sqlite_mode_ro_url_form_is_accepted(ledger: tuple[Path, list[Receipt]], tmp_path: Path) -> None:
    db, chain = ledger
    spaced = db.parent / "a ledger.db"
    db.rename(spaced)
    url = f"sqlite:///file:{spaced}?mode=ro&uri=true"  # as the SQLAlchemy and SQLite docs write it
    assert _ids(url) == [r.id for r in chain]
    ok("verify", chain[-1].id, "--db", url)
    line = one_line(cli("append", _more(tmp_path), "--db", url), EXIT_DATABASE)
    assert line == f"ledger: error: cannot write to {spaced}: opened read-only (the URL asks for mode=ro)"
    spaced.parent.chmod(0o555)  # and in a read-only directory
    assert _ids(url) == [r.id for r in chain]
    with pytest.raises(DatabaseError, match="opened read-only"), Store.open(url) as store:
        store.add_location(digests.raw_digest(b"x"), "/x")


def test_a_read_only_copy_taken_while_writing_reads_its_write_ahead_log(tmp_path: Path) -> None:
    """Copied while a writer had receipts in the -wal file: read through it (with the -shm file), or refused
    with one line when the -shm file is missing too; never read as if the -wal file were not there."""
    live = tmp_path / "live"
    live.mkdir()
    chain = build_chain().receipts()
    with Store.open(live / "ledger.db", create=True) as store:
        store.append_many(chain[:2])
    keep = sqlite3.connect(live / "ledger.db")  # a reader keeps the -wal file from being folded back at close
    keep.execute("SELECT count(*) FROM receipts").fetchall()
    with Store.open(live / "ledger.db") as store:
        store.append_many(chain[2:])
    for name, files in (("with-shm", ("", "-wal", "-shm")), ("without-shm", ("", "-wal"))):
        copy = tmp_path / name
        copy.mkdir()
        for suffix in files:
            shutil.copyfile(live / f"ledger.db{suffix}", copy / f"ledger.db{suffix}")
        assert (copy / "ledger.db-wal").stat().st_size > 0
        copy.chmod(0o555)
    keep.close()
    try:
        assert _ids(tmp_path / "with-shm" / "ledger.db") == [r.id for r in chain]
        line = one_line(cli("log", "--db", tmp_path / "without-shm" / "ledger.db"), EXIT_DATABASE)
        assert "ledger.db-wal holds changes not yet written back and ledger.db-shm is missing" in line
    finally:
        for name in ("with-shm", "without-shm"):
            (tmp_path / name).chmod(0o755)


def _as_root_or_fail(what: str) -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"{what} needs root, and CI runs as root")
        pytest.skip(f"{what} needs root (CI runs it)")


def test_a_read_only_mount_reads_as_root_and_refuses_appends(ledger: tuple[Path, list[Receipt]],
                                                              tmp_path: Path) -> None:
    _as_root_or_fail("a read-only bind mount")
    db, chain = ledger
    mnt = tmp_path / "ro-mount"
    mnt.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(db.parent), str(mnt)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=True, timeout=30)
        result = runner.invoke(app, ["log", "--db", str(mnt / "ledger.db"), "--json"])  # full root, in-process
        assert result.exit_code == 0 and len(json.loads(result.stdout)) == len(chain), result.output
        result = runner.invoke(app, ["append", str(_more(tmp_path)), "--db", str(mnt / "ledger.db")])
        assert result.exit_code == EXIT_DATABASE
        assert "opened read-only (the file system is mounted read-only)" in result.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


def test_a_ledger_that_cannot_be_created_says_why(tmp_path: Path) -> None:
    """SQLite says only "unable to open database file"; `ledger init` names the directory and what is wrong with
    it (exit 4), for a plain path and an SQLAlchemy URL alike, and leaves nothing behind."""
    _as_root_or_fail("a read-only bind mount")
    (tmp_path / "a-file").write_bytes(b"x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    mnt = tmp_path / "ro-mount"
    mnt.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "locked"), str(mnt)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=True, timeout=30)
        cases = [(tmp_path / "missing" / "l.db", f"the directory {tmp_path / 'missing'} does not exist"),
                 (tmp_path / "a-file" / "l.db", f"the directory {tmp_path / 'a-file'} is not a directory"),
                 (locked / "l.db", f"the directory {locked} is not writable by this user"),
                 (mnt / "l.db", "the file system is mounted read-only")]
        for path, why in cases:
            for db in (str(path), f"sqlite:///{path}"):
                line = one_line(cli("init", "--db", db), EXIT_DATABASE)
                assert line == f"ledger: error: cannot create a ledger at {path}: {why}", line
        assert not (tmp_path / "missing").exists() and os.listdir(locked) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)
    ok("init", "--db", tmp_path / "l.db")  # and where it can, it does


# ---------------------------------------------------------------------------------------------- locations


def test_relative_locations_resolve_against_the_ledgers_directory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "ledger"
    (home / "files").mkdir(parents=True)
    config = home / "files" / "config.toml"
    config.write_bytes(b"seed = 1\n")
    arts = {"config": digests.file_digest(config)}
    prepare = make_receipt("prepare", prepared=digests.prepared_digest(arts), artifacts=arts,
                           measurements=schema_fill("prepare"))
    with Store.open(home / "ledger.db", create=True) as store:
        store.append(prepare)
        store.add_location(arts["config"], "files/config.toml")
        assert store.locations(arts["config"]) == [str(config)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # an artifact root away from the ledger, so that only the ledger's directory can explain the find
    result = runner.invoke(app, ["verify", prepare.id, "--db", str(home / "ledger.db"), "--artifacts",
                                 str(tmp_path / "other-artifacts"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["artifacts_verified"] == 1 and doc["artifacts_missing"] == []


# ------------------------------------------------------------------------------------ artifact file modes


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_artifact_files_are_readable_by_other_users(tmp_path: Path, umask_022: None) -> None:
    arts = ArtifactStore(tmp_path / "artifacts")
    src = tmp_path / "src.bin"
    src.write_bytes(b"weights")
    src.chmod(0o600)
    atomic_write(tmp_path / "plain.json", b"{}")
    root = make_checkpoint(tmp_path / "ckpt", manifest=False)
    write_manifest(root, {"run": "r", "rank": 0, "step": 1})
    written = [arts.path_for(arts.put_bytes(b"bytes")), arts.path_for(arts.put_file(src)), tmp_path / "plain.json",
               root / "manifest.json"]
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    os.umask(0o077)  # an operator who asks for private files still gets them
    assert stat.S_IMODE(arts.path_for(arts.put_bytes(b"private")).stat().st_mode) == 0o600


# ------------------------------------------------------------------------------ the auditor's read-only copy


@pytest.mark.slow
def test_an_auditor_verifies_a_read_only_copy_of_an_experiment(tiny_experiment: TinyExperiment,
                                                               tmp_path: Path) -> None:
    copy = tiny_experiment.copy(tmp_path / "copy").workdir
    dirs = [copy, *(p for p in copy.rglob("*") if p.is_dir())]
    for p in copy.rglob("*"):
        if p.is_file():
            p.chmod(p.stat().st_mode & ~0o222)
    for d in dirs:
        d.chmod(0o555)
    before = sorted(os.listdir(copy))
    try:
        db = copy / "ledger.db"
        audit = json.loads(ok("audit", "--no-record", "--db", db, "--json").stdout)
        assert audit["audit"] is None and audit["report"]["contracts"] == tiny_experiment.summary["contracts"]
        # the recorded audit: every receipt it cites, every artifact, the report rebuilt
        assert json.loads(ok("verify", tiny_experiment.summary["audit"], "--db", db, "--json").stdout)["ok"]
        assert "opened read-only" in one_line(cli("audit", "--db", db), EXIT_DATABASE)  # recording must write
        assert sorted(os.listdir(copy)) == before  # nothing written, not even SQLite's -wal and -shm files
    finally:
        for d in dirs:
            d.chmod(0o755)
