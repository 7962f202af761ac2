"""Hostile inputs (issue 10, points 4-9): whatever is given as a database, an artifact location, a checkpoint or a
receipt, the CLI answers with one line on stderr and its documented exit code, never a traceback or a hang, and
nothing already recorded is lost."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from ledger import digests
from ledger.cli import app
from ledger.cli.run import _ranks_text
from ledger.errors import EXIT_DATABASE, EXIT_FAILED, EXIT_USAGE, DatabaseError, LedgerError, NonCanonical
from ledger.receipts import Receipt, make_receipt
from ledger.state import read_state
from ledger.store import Store
from tests.conftest import ReceiptChain, TinyExperiment, build_chain, fake_digest, schema_fill
from tests.helpers_state import make_checkpoint

runner = CliRunner()
HANG_TIMEOUT_S = 60.0  # a subprocess that blocks is killed here; one that works answers in a second or two


def run(*args: str | Path, input: bytes | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], input=input)


def fails(code: int, *args: str | Path) -> str:
    """Run in-process, expect ``code`` and exactly one error line on stderr (nothing on stdout); return it."""
    result = run(*args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ledger: error: "), result.stderr
    assert result.stdout == ""
    assert not isinstance(result.exception, LedgerError)
    return lines[0]


def cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ledger.cli`` in its own process: a hang would block it, so it runs under a timeout and must
    finish well within it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ledger.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S, env=env, cwd=cwd)
    assert time.monotonic() - started < HANG_TIMEOUT_S / 2
    return proc


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ledger: error: "), proc.stderr
    return lines[0]


def receipts_file(path: Path, receipts: list[Receipt]) -> Path:
    path.write_bytes(b"".join(r.body + b"\n" for r in receipts))
    return path


def ledger_with(db: Path, chain: ReceiptChain) -> Path:
    with Store.open(db, create=True) as store:
        store.append_many(chain.receipts())
    return db


# ------------------------------------------------------------------------------- 4. not a ledger, full disk


def _not_a_ledger(tmp_path: Path, kind: str) -> Path:
    bad = tmp_path / f"{kind}.db"
    if kind == "random":
        bad.write_bytes(os.urandom(8192))
    elif kind == "text":
        bad.write_text("this is a text file, not a ledger\n" * 50)
    else:  # a real ledger, cut in half (the receipts' pages past the cut are gone)
        chains = [build_chain(salt=str(i)) for i in range(20)]
        full = ledger_with(tmp_path / "full.db", chains[0])
        with Store.open(full) as store:
            for c in chains[1:]:
                store.append_many(c.receipts())
        data = full.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    return bad


@pytest.mark.parametrize("kind", ["random", "text", "truncated"])
def test_a_file_that_is_not_a_ledger_is_one_line_and_exit_4(tmp_path: Path, kind: str) -> None:
    bad = _not_a_ledger(tmp_path, kind)
    chain = build_chain(salt="new")
    source = receipts_file(tmp_path / "r.jsonl", chain.receipts())
    for args in (["log"], ["verify", chain.eval.id], ["append", source], ["show", chain.eval.id]):
        line = fails(EXIT_DATABASE, *args, "--db", bad)
        assert str(bad) in line
        assert "not an SQLite ledger" in line or "damaged" in line, line
    # the library raises the typed error too, at open or at the first read that meets the damage
    with pytest.raises(DatabaseError, match=str(bad)):  # noqa: PT012 - the open or the read may be the one
        with Store.open(bad) as store:
            store.find()
            store.ancestors(store.find()[-1].receipt.id)


def test_a_directory_as_the_ledger_is_exit_4(tmp_path: Path) -> None:
    assert "it is a directory, not an SQLite ledger file" in fails(EXIT_DATABASE, "log", "--db", tmp_path)


def _as_root_or_fail(what: str) -> None:
    """Tests that mount need root; CI runs as root, so there they never skip."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"{what} needs root, and CI runs as root")
        pytest.skip(f"{what} needs root (CI runs it)")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    _as_root_or_fail("mounting a tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


def _fill(directory: Path, leave: int) -> Path:
    """Fill the file system of ``directory``, then free ``leave`` bytes (room for SQLite's -shm and -wal files,
    not for a big append)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    for size in (1 << 12, 1 << 9):  # the last few blocks
        try:
            while True:
                os.write(fd, bytes(size))
        except OSError:
            pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)
    return filler


def test_append_on_a_full_disk_is_exit_4_and_loses_nothing(small_tmpfs: Path, tmp_path: Path) -> None:
    db = ledger_with(small_tmpfs / "ledger.db", build_chain())
    before = build_chain()
    many = [r for i in range(60) for r in build_chain(salt=f"fill{i}").receipts()]  # ~500 kB of rows
    filler = _fill(small_tmpfs, leave=128 << 10)
    line = one_line(cli("append", receipts_file(tmp_path / "many.jsonl", many), "--db", db), EXIT_DATABASE)
    assert f"cannot write to {db}: the disk is full" in line
    # every receipt appended before is there and verifies, on the still-full disk
    result = run("log", "--db", db, "--json")
    assert result.exit_code == 0, result.output
    assert [s["id"] for s in json.loads(result.stdout)] == [r.id for r in before.receipts()]
    result = run("verify", before.eval.id, "--db", db, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["receipts_checked"] == 7, result.output
    filler.unlink()  # with room again, the same append goes through
    result = run("append", tmp_path / "many.jsonl", "--db", db, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["appended"] == len(many), result.output


def test_a_file_written_on_a_full_disk_is_named_and_the_old_one_kept(small_tmpfs: Path) -> None:
    """ENOSPC from write() names no file: the error names the file being written (not nothing, nor its temporary
    name), no temporary file is left, and the file it would have replaced is as it was."""
    from ledger.artifacts import atomic_write
    from ledger.errors import os_error_line

    target = small_tmpfs / "report.json"
    target.write_bytes(b"the old report")
    filler = _fill(small_tmpfs, leave=0)
    with pytest.raises(OSError) as info:
        atomic_write(target, bytes(1 << 20))
    assert info.value.errno == errno.ENOSPC
    assert os_error_line(info.value) == f"cannot write (No space left on device): {target}"
    assert sorted(os.listdir(small_tmpfs)) == ["filler", "report.json"] and target.read_bytes() == b"the old report"
    filler.unlink()
    atomic_write(target, b"the new report")
    assert target.read_bytes() == b"the new report"


# ------------------------------------------------------------------------- 5. FIFOs and devices as artifacts


def _prepare_citing(db: Path, digest: str, location: str) -> Receipt:
    arts = {"config": digest, "data": fake_digest("data")}
    prepare = make_receipt("prepare", prepared=digests.prepared_digest(arts), artifacts=arts,
                           measurements=schema_fill("prepare"))
    with Store.open(db, create=True) as store:
        store.append(prepare)
        store.add_location(digest, location)
    return prepare


@pytest.mark.parametrize("what", ["dev-zero", "fifo"])
def test_verify_refuses_an_artifact_at_dev_zero_or_a_fifo_without_hanging(tmp_path: Path, what: str) -> None:
    if what == "dev-zero":
        location, kind = Path("/dev/zero"), "a character device"
    else:
        location, kind = tmp_path / "config.fifo", "a FIFO"
        os.mkfifo(location)
    prepare = _prepare_citing(tmp_path / "ledger.db", fake_digest("config"), str(location))
    line = one_line(cli("verify", prepare.id, "--db", tmp_path / "ledger.db"), EXIT_FAILED)
    assert f"{location}: is {kind}, not a regular file" in line
    assert f"artifact 'config' at {location}" in line
    with pytest.raises(LedgerError, match=kind):
        digests.file_digest(location)


def _checkpoint_receipt_db(tmp_path: Path, root: Path, state: str) -> tuple[Path, Receipt]:
    arts = {"data": fake_digest("data"), "config": fake_digest("config")}
    prepare = make_receipt("prepare", prepared=digests.prepared_digest(arts), artifacts=arts,
                           measurements=schema_fill("prepare"))
    start = make_receipt("train-start", run="r", rank=0, step=0, prepared=prepare.prepared, parents=[prepare],
                         measurements=schema_fill("train-start"))
    ck = make_receipt("checkpoint", run="r", rank=0, step=4, prepared=prepare.prepared, parents=[start],
                      artifacts={"state": state}, measurements=schema_fill("checkpoint"))
    db = tmp_path / "ledger.db"
    with Store.open(db, create=True) as store:
        store.append_many([prepare, start, ck])
        store.add_location(state, str(root))
    return db, ck


def test_a_fifo_named_model_safetensors_never_blocks_digest_compare_or_verify(tmp_path: Path) -> None:
    good = make_checkpoint(tmp_path / "good")
    root = make_checkpoint(tmp_path / "ckpt")
    state = read_state(root).digest
    (root / "model.safetensors").unlink()
    os.mkfifo(root / "model.safetensors")
    db, ck = _checkpoint_receipt_db(tmp_path, root, state)
    named = f"{root / 'model.safetensors'}: is a FIFO, not a regular file"
    assert named in one_line(cli("digest", root), EXIT_USAGE)
    assert named in one_line(cli("compare", good, root), EXIT_USAGE)
    assert named in one_line(cli("verify", ck.id, "--db", db), EXIT_FAILED)
    # a FIFO given as the file itself
    os.mkfifo(tmp_path / "lone.safetensors")
    assert "lone.safetensors: is a FIFO" in one_line(cli("digest", tmp_path / "lone.safetensors"), EXIT_USAGE)
    assert "/dev/zero: is a character device" in one_line(cli("digest", "/dev/zero"), EXIT_USAGE)


# --------------------------------------------------------------------------- 6. symlinks in a checkpoint


def test_a_symlink_in_a_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    good = make_checkpoint(tmp_path / "good")
    root = make_checkpoint(tmp_path / "ckpt")
    state = read_state(root).digest
    outside = tmp_path / "outside.safetensors"
    (root / "model.safetensors").rename(outside)
    (root / "model.safetensors").symlink_to(outside)  # the same bytes, so only the link itself is wrong
    db, ck = _checkpoint_receipt_db(tmp_path, root, state)
    named = f"{root / 'model.safetensors'}: is a symbolic link (to {outside})"
    assert named in fails(EXIT_USAGE, "digest", root)
    assert named in fails(EXIT_USAGE, "compare", good, root)
    assert named in fails(EXIT_FAILED, "verify", ck.id, "--db", db)
    (root / "model.safetensors").unlink()  # a link to a directory outside is refused the same way
    (root / "model.safetensors").symlink_to(tmp_path)
    assert f"{root / 'model.safetensors'}: is a symbolic link" in fails(EXIT_USAGE, "digest", root)


def test_a_symlinked_manifest_or_scalars_file_is_refused(tmp_path: Path) -> None:
    for name in ("manifest.json", "rng.json"):
        root = make_checkpoint(tmp_path / name)
        (root / name).rename(tmp_path / f"real-{name}")
        (root / name).symlink_to(tmp_path / f"real-{name}")
        assert f"{root / name}: is a symbolic link" in fails(EXIT_USAGE, "digest", root)


# ------------------------------------------------------------------------------------------ 7. nesting depth


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def _deep_body(depth: int) -> bytes:
    """A note receipt's canonical bytes whose deepest value sits ``depth`` levels down (the body object is 1,
    measurements 2); built as text, because make_receipt refuses it."""
    inner = b"[" * (depth - 2) + b'"x"' + b"]" * (depth - 2)  # json.dumps itself would recurse that deep
    return (b'{"alg":"blake3","artifacts":{},"kind":"note","measurements":{"deep":' + inner
            + b'},"parents":[],"prepared":null,"rank":null,"run":null,"selection":null,"step":null,"v":1}')


def test_append_enforces_the_writer_nesting_limit(ledger_db: Path, tmp_path: Path) -> None:
    for depth in (975, digests.MAX_DEPTH + 1):
        source = tmp_path / f"deep{depth}.json"
        source.write_bytes(_deep_body(depth) + b"\n")
        line = fails(EXIT_USAGE, "append", source, "--db", ledger_db)
        assert f"nested {depth} levels deep, deeper than the limit of {digests.MAX_DEPTH}" in line
    (tmp_path / "ok.json").write_bytes(_deep_body(digests.MAX_DEPTH) + b"\n")  # at the limit: accepted
    result = run("append", tmp_path / "ok.json", "--db", ledger_db, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["appended"] == 1, result.output
    # writers in the library meet the same limit, and a value that contains itself is no RecursionError
    assert make_receipt("note", measurements={"deep": _nested(digests.MAX_DEPTH - 2)})
    with pytest.raises(NonCanonical, match="nested deeper than 256 levels"):
        make_receipt("note", measurements={"deep": _nested(digests.MAX_DEPTH - 1)})
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(NonCanonical, match="nested deeper"):
        digests.canonical_bytes(loop)


def test_parsing_never_recurses_without_bound() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(NonCanonical, match="nested 200000 levels deep"):
        digests.parse_canonical(deep)
    assert digests.json_depth(b'{"a":"[[[[\\"[[","b":[{}]}') == 3  # brackets inside strings do not count


def test_a_deep_body_already_stored_breaks_no_read(tmp_path: Path) -> None:
    """A body nested 975 levels, stored by software that did not check the limit: every read path answers one
    line about that receipt, and everything else in the ledger still reads and verifies."""
    chain = build_chain()
    db = ledger_with(tmp_path / "ledger.db", chain)
    body = _deep_body(975)
    deep_id = digests.receipt_id(body)
    conn = sqlite3.connect(db)
    with conn:
        seq = conn.execute("SELECT max(seq) + 1 FROM receipts").fetchone()[0]
        conn.execute("INSERT INTO receipts (seq, id, kind, run, rank, step, prepared, selection, body, recorded_ns)"
                     " VALUES (?, ?, 'note', NULL, NULL, NULL, NULL, NULL, ?, 0)", (seq, deep_id, body))
    conn.close()
    nested = "nested 975 levels deep"
    for args in (["log"], ["log", "--json"], ["show", deep_id]):  # the ledger is damaged, not the input: exit 1
        line = fails(EXIT_FAILED, *args, "--db", db)
        assert deep_id in line and nested in line, line
    line = fails(EXIT_FAILED, "verify", deep_id, "--db", db)
    assert f"receipt {deep_id}: body is not a valid receipt" in line and nested in line
    assert run("verify", chain.eval.id, "--db", db).exit_code == 0
    result = run("log", "--kind", "prepare", "--db", db, "--json")
    assert result.exit_code == 0 and len(json.loads(result.stdout)) == 1
    # appending a child of it names the stored receipt too, and stores nothing
    child = make_receipt("note", parents=[deep_id])
    line = fails(EXIT_FAILED, "append", receipts_file(tmp_path / "child.jsonl", [child]), "--db", db)
    assert deep_id in line and nested in line
    with Store.open(db) as store:
        assert not store.contains(child.id)


def test_a_body_stored_as_text_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """sqlite3 cannot return TEXT that is not UTF-8 and names only the column; the reader finds the receipt that
    holds it and says so (exit 1: the ledger is damaged), and the receipts around it still verify."""
    chain = build_chain()
    db = ledger_with(tmp_path / "ledger.db", chain)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE receipts SET body = CAST(body || x'ff' AS TEXT) WHERE id = ?", (chain.eval.id,))
    conn.close()
    for args in (["log"], ["verify", chain.eval.id]):
        line = fails(EXIT_FAILED, *args, "--db", db)
        assert chain.eval.id in line and "not UTF-8" in line, line
    assert run("verify", chain.prepare.id, "--db", db).exit_code == 0


# -------------------------------------------------------------------------------- 8. compare-runs of two arms


def _rank_row(rank: int, comparisons: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, "comparisons": comparisons, "contents_exactly_equal": False, "file_hashes_equal": False,
            "binding_equal": False, "trajectory_equal": False, "first_trajectory_divergence": 2,
            "first_state_difference": "model/w: first difference at element 0"}


def test_ranks_text_renders_rows_whose_components_differ() -> None:
    counts = {"tensors": 2, "tensor_elements": 1234, "scalars": 3}
    text = _ranks_text([_rank_row(0, {"model": counts, "optimizer": counts, "outer": {}}),
                        _rank_row(1, {"model": counts})])
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[1].split()[5:8] == ["1,234", "1,234", "-"]  # outer absent on one side: "-"
    assert lines[2].split()[5:8] == ["1,234", "-", "-"]
    assert lines[1].endswith("loss at step 2; model/w: first difference at element 0")


@pytest.mark.slow
def test_compare_runs_of_two_different_arms_names_the_divergence(tiny_experiment: TinyExperiment) -> None:
    args = ["compare-runs", "train/ddp-four", "train/diloco-four", "--db", str(tiny_experiment.db)]
    result = run(*args)
    assert result.exit_code == EXIT_FAILED, (result.output, result.exception)
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("ledger: error: rank 0: recovered run diverges from the uninterrupted run: ")
    table = result.stdout.splitlines()
    assert table[0].split()[:5] == ["rank", "state", "files", "binding", "losses"]
    assert len(table) == 5 and all(" - " in row for row in table[1:])  # DDP has no outer optimizer
    result = run(*args, "--json")
    assert result.exit_code == EXIT_FAILED, (result.output, result.exception)
    doc = json.loads(result.stdout)
    assert doc["passed"] is False and len(doc["ranks"]) == 4
    assert result.stderr.startswith("ledger: error: rank 0: recovered run diverges")


# ------------------------------------------------------------------------------- 9. append counts its own


def test_append_many_says_which_receipts_it_stored(ledger_db: Path) -> None:
    chain = build_chain()
    with Store.open(ledger_db) as store:
        first = store.append_many(chain.receipts()[:3])
        assert [s.new for s in first] == [True, True, True]
        again = store.append_many([*chain.receipts(), chain.eval])  # three stored, the rest new, eval twice
        assert [s.new for s in again] == [False] * 3 + [True] * (len(chain.receipts()) - 3) + [False]
        assert store.append(chain.prepare).new is False


def test_append_json_counts_what_this_call_stored_while_others_write(ledger_db: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    chain = build_chain()
    with Store.open(ledger_db) as store:
        store.append_many(chain.receipts()[:2])
    original = Store.append_many
    others = iter(make_receipt("note", measurements={"other": i}) for i in range(100))

    def with_another_writer(self: Store, receipts: Any, **kwargs: Any) -> Any:
        with Store.open(ledger_db) as other:  # commits right before and right after this call's transaction
            original(other, [next(others)])
            out = original(self, receipts, **kwargs)
            original(other, [next(others)])
        return out

    monkeypatch.setattr(Store, "append_many", with_another_writer)
    result = run("append", receipts_file(tmp_path / "r.jsonl", chain.receipts()), "--db", ledger_db, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["appended"], doc["existing"]) == (len(chain.receipts()) - 2, 2)
    result = run("append", tmp_path / "r.jsonl", "--db", ledger_db)
    assert result.stdout.splitlines()[-1] == f"0 appended, {len(chain.receipts())} already present"


# ------------------------------------------------------------------- a tampered ledger, one column at a time
# SQLite stores whatever an UPDATE gives it, of any type in any column. Each edit below is made on a copy of the
# session's tiny experiment (signed, its log head exported by the main job) with the sqlite3 module, as someone
# with the file could. Every command then answers with its documented exit code and, when it fails, one line: no
# traceback (these found five). The second member of each entry names the commands that must fail on the edit; the
# others may pass or fail (a location that names the ledger's directory is a bad copy), but answer the same way.

_MID = "(SELECT seq FROM receipts WHERE kind = 'train-end' ORDER BY seq LIMIT 1)"
_KEY = "(SELECT seq FROM receipts WHERE kind = 'key' LIMIT 1)"
_MID_LEAF = f"(SELECT leaf_index FROM log_leaves WHERE receipt_seq = {_MID})"
_ROW = ("verify",)  # the settlement's ancestry includes the edited row; the log holds no index columns
_LOG = ("verify", "head")  # a leaf (its receipt's body, id or signatures) recomputes otherwise

COLUMN_EDITS: dict[str, tuple[str, tuple[str, ...]]] = {  # name: (the edit, the commands that must fail)
    "body empty": (f"UPDATE receipts SET body = X'' WHERE seq = {_MID}", _LOG),
    "body text": (f"UPDATE receipts SET body = 'garbage' WHERE seq = {_MID}", _LOG),
    "body random": (f"UPDATE receipts SET body = randomblob(300) WHERE seq = {_MID}", _LOG),
    "body integer": (f"UPDATE receipts SET body = 4096 WHERE seq = {_MID}", _LOG),
    "body edited as text": (f"UPDATE receipts SET body = replace(body, '\"v\":1', '\"v\":2') WHERE seq = {_MID}", _LOG),
    "key body edited": (f"UPDATE receipts SET body = replace(body, '\"v\":1', '\"v\":2') WHERE seq = {_KEY}", _LOG),
    "id not a digest": (f"UPDATE receipts SET id = 'x' WHERE seq = {_MID}", _LOG),
    "id integer": (f"UPDATE receipts SET id = 7 WHERE seq = {_MID}", _LOG),
    "id blob": (f"UPDATE receipts SET id = X'00' WHERE seq = {_MID}", _LOG),
    "kind unknown": (f"UPDATE receipts SET kind = 'bogus' WHERE seq = {_MID}", _ROW),
    "rank text": (f"UPDATE receipts SET rank = 'abc' WHERE seq = {_MID}", _ROW),
    "step negative": (f"UPDATE receipts SET step = -1 WHERE seq = {_MID}", _ROW),
    "step huge": (f"UPDATE receipts SET step = 9223372036854775807 WHERE seq = {_MID}", _ROW),
    "prepared null": (f"UPDATE receipts SET prepared = NULL WHERE seq = {_MID}", _ROW),
    "prepared blob": (f"UPDATE receipts SET prepared = X'00ff' WHERE seq = {_MID}", _ROW),
    "run blob": (f"UPDATE receipts SET run = X'00' WHERE seq = {_MID}", _ROW),
    "edges deleted": (f"DELETE FROM receipt_parents WHERE child_seq = {_MID}", _ROW),
    "edge to no row": (f"UPDATE receipt_parents SET parent_seq = 999999 WHERE child_seq = {_MID}", _ROW),
    "edge parent text": (f"UPDATE receipt_parents SET parent_seq = 'x' WHERE child_seq = {_MID}", _ROW),
    "edge child text": (f"UPDATE receipt_parents SET child_seq = 'x' WHERE child_seq = {_MID}", _ROW),
    "artifact digest": (f"UPDATE receipt_artifacts SET digest = 'x' WHERE receipt_seq = {_MID}", _ROW),
    "artifact digest blob": (f"UPDATE receipt_artifacts SET digest = X'0102' WHERE receipt_seq = {_MID}", _ROW),
    "artifact row text": (f"UPDATE receipt_artifacts SET receipt_seq = 'x' WHERE receipt_seq = {_MID}", _ROW),
    "signature text": (f"UPDATE receipt_signatures SET signature = 'text' WHERE receipt_seq = {_MID}", _LOG),
    "signature short": (f"UPDATE receipt_signatures SET signature = X'00' WHERE receipt_seq = {_MID}", _LOG),
    "signature integer": (f"UPDATE receipt_signatures SET signature = 7 WHERE receipt_seq = {_MID}", _LOG),
    "signature key unknown": (f"UPDATE receipt_signatures SET key = 'x' WHERE receipt_seq = {_MID}", _LOG),
    "signature key integer": (f"UPDATE receipt_signatures SET key = 5 WHERE receipt_seq = {_MID}", _LOG),
    "signature row text": (f"UPDATE receipt_signatures SET receipt_seq = 'x' WHERE receipt_seq = {_MID}", _LOG),
    "leaf seq text": (f"UPDATE log_leaves SET receipt_seq = 'x' WHERE receipt_seq = {_MID}", _LOG),
    "leaf index gap": (f"UPDATE log_leaves SET leaf_index = leaf_index + 100000 WHERE receipt_seq = {_MID}", _LOG),
    "leaf hash text": (f"UPDATE log_nodes SET hash = 'text' WHERE level = 0 AND idx = {_MID_LEAF}", _LOG),
    "leaf hash short": (f"UPDATE log_nodes SET hash = X'00' WHERE level = 0 AND idx = {_MID_LEAF}", _LOG),
    "origin integer": ("UPDATE log_info SET origin = 5", ("head",)),
    "log info deleted": ("DELETE FROM log_info", ("head",)),
    "location blob": ("UPDATE artifact_locations SET uri = X'00ff' WHERE rowid = 1", ()),
    "location empty": ("UPDATE artifact_locations SET uri = '' WHERE rowid = 1", ()),
    "location with NUL": ("UPDATE artifact_locations SET uri = CAST(X'2f746d7000' AS TEXT) WHERE rowid = 1", ()),
    "location a device": ("UPDATE artifact_locations SET uri = '/dev/zero' WHERE rowid = 1", ()),
    "location outside": ("UPDATE artifact_locations SET uri = '../../../../etc/passwd' WHERE rowid = 1", ()),
    "location a URL": ("UPDATE artifact_locations SET uri = 'http://127.0.0.1:9/x' WHERE rowid = 1", ()),
    "schema unknown": ("UPDATE alembic_version SET version_num = 'zzz'", ("verify", "head", "show", "log")),
    "signatures dropped": ("DROP TABLE receipt_signatures", ("verify", "head")),
}


@pytest.mark.slow
@pytest.mark.parametrize("edit", list(COLUMN_EDITS))
def test_a_column_edited_behind_the_librarys_back_is_answered_in_one_line(
        tiny_experiment: TinyExperiment, tmp_path: Path, edit: str) -> None:
    sql, caught_by = COLUMN_EDITS[edit]
    db = tmp_path / "ledger.db"
    # closing(): sqlite3's own context manager commits but does not close (an open connection keeps the -wal file)
    with closing(sqlite3.connect(tiny_experiment.db)) as src, closing(sqlite3.connect(db)) as dst:
        src.backup(dst)
        mid, settlement = (dst.execute(f"SELECT id FROM receipts WHERE seq = {_MID}").fetchone()[0],
                           dst.execute("SELECT id FROM receipts WHERE kind = 'settlement' ORDER BY seq DESC")
                           .fetchone()[0])
    with closing(sqlite3.connect(db)) as conn, conn:
        assert conn.execute(sql).rowcount != 0 or sql.startswith("DROP")
    commands = {
        "verify": ("verify", settlement, "--artifacts", tiny_experiment.artifacts),
        "head": ("verify", "--head", tiny_experiment.workdir / "log-head.txt"),
        "show": ("show", mid),
        "log": ("log", "--kind", "train-end"),
    }
    for name, args in commands.items():
        result = run(*args, "--db", db)
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
        assert result.exit_code in (0, 1, 2, 3, 4), (name, result.exit_code)
        if result.exit_code:
            lines = result.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("ledger: error: "), (name, result.stderr)
        assert result.exit_code != 0 or name not in caught_by, (name, "the edit went unnoticed")
