"""`ledger digest`, `ledger compare` and `ledger verify` of checkpoint receipts, through typer's CliRunner."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from ledger import digests
from ledger.cli import app
from ledger.cli.state import _ProgressBar
from ledger.digests import prepared_digest
from ledger.receipts import Receipt, make_receipt
from ledger.state import SafetensorsFile, read_state
from ledger.store import Store
from tests.conftest import fake_digest, schema_fill
from tests.helpers_state import flip_bit, make_checkpoint, model_tensors, pickle_payloads

runner = CliRunner()


def run(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def flip_tensor(root: Path, tensor: str, file: str = "model.safetensors") -> None:
    with SafetensorsFile(root / file) as sf:
        at = sf.tensors[tensor].begin
    flip_bit(root / file, at, bit=1)


# ------------------------------------------------------------------------------------------------- digest


def test_digest_directory_table_and_json(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    state = read_state(root)
    result = run("digest", root)
    assert result.exit_code == 0, result.output
    assert f"digest {state.digest}" in result.stdout
    for comp in state.components.values():
        assert comp.digest in result.stdout  # whole digests, never elided, even at 80 columns in a pipe
    assert state.components["model"].tensors["layers.0.weight"].digest in result.stdout
    result = run("digest", root, "--json", "--files")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["digest"] == state.digest and doc["kind"] == "checkpoint"
    assert doc["components"]["optimizer"]["scalars"] == 7
    assert doc["tensors"]["model"]["head.weight"]["dtype"] == "F32"
    assert doc["files"]["model.safetensors"] == digests.file_digest(root / "model.safetensors")
    assert doc["manifest_matches"] is True
    doc = json.loads(run("digest", root, "--json", "--no-tensors").stdout)
    assert "tensors" not in doc and "files" not in doc


def test_digest_tables_hold_one_row_a_tensor_and_file_each_whole(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    state = read_state(root, files=True)
    lines = run("digest", root, "--files").stdout.splitlines()
    for comp in state.components.values():
        row = next(line for line in lines if comp.digest in line)
        # right-justified counts, as the JSON has them
        assert row.split("\u2502")[2].strip() == str(len(comp.tensors)) and row.endswith(f" {comp.scalar_count}")
        for name, t in comp.tensors.items():
            assert sum(name in line and t.digest in line for line in lines) == 1
    assert state.files is not None
    for name, digest in state.files.items():
        assert f" {name} " in next(line for line in lines if line.endswith(digest))
    assert lines[:3] == [f"checkpoint {root}", f"digest {state.digest}", "components"]
    assert {"tensors", "files"} <= set(lines)


def test_digest_single_file_is_its_component_digest(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt", shards=2)
    shard = root / "model-00001-of-00002.safetensors"
    doc = json.loads(run("digest", shard, "--json").stdout)
    assert doc["kind"] == "file" and list(doc["components"]) == ["model"]
    assert doc["digest"] == doc["components"]["model"]["digest"] == read_state(shard).digest
    assert doc["digest"] != read_state(root).components["model"].digest  # one shard holds only part of it


def test_digest_warns_when_the_manifest_disagrees(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    flip_tensor(root, "head.weight")
    result = run("digest", root)
    assert result.exit_code == 0
    assert "warning" in result.stderr and "manifest.json records" in result.stderr


def test_digest_files_warns_when_the_manifest_records_other_files(tmp_path: Path) -> None:
    """The state digest alone cannot see a manifest whose `files` map names a file the directory does not hold (a
    `../` name, say) or records another digest for one: with --files, `digest` says which (exit 0: it reports)."""
    root = make_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((root / "manifest.json").read_bytes())
    assert json.loads(run("digest", root, "--json", "--files").stdout)["manifest_files_match"] is True
    manifest["files"]["../outside.safetensors"] = manifest["files"].pop("model.safetensors")
    (root / "manifest.json").write_bytes(digests.canonical_bytes(manifest))
    result = run("digest", root, "--json", "--files")
    assert result.exit_code == 0 and json.loads(result.stdout)["manifest_files_match"] is False
    assert json.loads(result.stdout)["manifest_matches"] is True  # the state digest cannot tell
    assert result.stderr == (f"ledger: warning: {root}/manifest.json records file '../outside.safetensors', which "
                             "the directory does not hold (see `ledger verify`)\n")
    manifest["files"]["model.safetensors"] = manifest["files"].pop("../outside.safetensors")
    manifest["files"]["rng.json"] = fake_digest("other")
    (root / "manifest.json").write_bytes(digests.canonical_bytes(manifest))
    found = digests.file_digest(root / "rng.json")
    assert run("digest", root, "--files").stderr == (
        f"ledger: warning: {root}/manifest.json records file 'rng.json' as {fake_digest('other')}, but its bytes "
        f"hash to {found} (see `ledger verify`)\n")
    assert "manifest_files_match" not in json.loads(run("digest", root, "--json").stdout)  # files not hashed


@pytest.mark.parametrize("kind", ["pickle", "zip"])
def test_digest_and_compare_refuse_pickles_and_leave_no_marker(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "MARKER"
    payload = pickle_payloads(tmp_path, marker)[kind]
    pt = tmp_path / "model.pt"
    pt.write_bytes(payload)
    renamed = tmp_path / "r" / "model.safetensors"
    renamed.parent.mkdir()
    renamed.write_bytes(payload)
    root = make_checkpoint(tmp_path / "ckpt")
    (root / "optimizer.pt").write_bytes(payload)
    for args in (("digest", pt), ("digest", renamed), ("digest", root), ("compare", renamed, renamed),
                 ("compare", root, root)):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "is a pickle/torch file; refusing to read it" in result.stderr
        assert result.stderr.count("\n") == 1  # one line
    assert not marker.exists()


def test_digest_errors_are_one_line(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt", manifest=False)
    result = run("digest", root)
    assert result.exit_code == 2 and "incomplete checkpoint" in result.stderr
    result = run("digest", tmp_path / "nope")
    assert result.exit_code == 2 and "No such file or directory" in result.stderr
    (tmp_path / "x.txt").write_text("x")
    result = run("digest", tmp_path / "x.txt")
    assert result.exit_code == 2 and "not a .safetensors file" in result.stderr
    (tmp_path / "a.safetensors").symlink_to("b.safetensors")  # a loop: not "no such file"
    (tmp_path / "b.safetensors").symlink_to("a.safetensors")
    result = run("digest", tmp_path / "a.safetensors")
    assert result.exit_code == 2 and "symbolic link that leads nowhere" in result.stderr, result.stderr


# ------------------------------------------------------------------------------------------------ compare


def test_compare_paths(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    b = make_checkpoint(tmp_path / "b")
    result = run("compare", a, b)
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith("EQUAL")
    assert "contents_exactly_equal: yes  file_hashes_equal: yes" in result.stdout
    doc = json.loads(run("compare", a, b, "--json").stdout)
    assert doc["equal"] and doc["contents_exactly_equal"] and doc["file_hashes_equal"]
    assert doc["components"]["model"]["a"] == {"tensors": 5, "tensor_elements": 100, "scalars": 0}

    w = model_tensors()["layers.1.weight"].copy()
    w.flat[13] = -0.0
    m = model_tensors()
    m["layers.1.weight"] = w
    c = make_checkpoint(tmp_path / "c", model=m)
    result = run("compare", a, c)
    assert result.exit_code == 1
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("DIFFERENT: model/layers.1.weight: first difference at element 13 of 16 (F64): A ")
    assert "B -0.0 (0x8000000000000000)" in last
    doc = json.loads(run("compare", a, c, "--json").stdout)
    assert doc["equal"] is False and doc["first_difference"]["index"] == 13
    assert doc["components"]["optimizer"]["equal"] is True

    d = make_checkpoint(tmp_path / "d", shards=2)  # same state, other files
    assert run("compare", a, d).exit_code == 1
    result = run("compare", a, d, "--ignore-files")
    assert result.exit_code == 0 and "file_hashes_equal: not compared" in result.stdout
    result = run("compare", a, tmp_path / "missing")
    assert result.exit_code == 2 and "not a receipt id" in result.stderr


def _ledger_with(tmp_path: Path, runs: dict[str, Path]) -> tuple[Path, dict[str, Receipt]]:
    """A ledger where each run's checkpoint receipt names the state of its directory (recorded as its location)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = tmp_path / "ledger.db"
    store = Store.open(db, create=True)
    arts = {"data": fake_digest("data"), "config": fake_digest("config")}
    prepare = make_receipt("prepare", prepared=prepared_digest(arts), artifacts=arts,
                           measurements=schema_fill("prepare"))
    out: dict[str, Receipt] = {}
    for run_name, root in runs.items():
        state = read_state(root)
        start = make_receipt("train-start", run=run_name, rank=0, step=0, prepared=prepare.prepared,
                             parents=[prepare], measurements=schema_fill("train-start"))
        ck = make_receipt("checkpoint", run=run_name, rank=0, step=4, prepared=prepare.prepared, parents=[start],
                          artifacts={"state": state.digest, "model": state.components["model"].digest},
                          measurements=schema_fill("checkpoint"))
        store.append_many([prepare, start, ck])
        store.add_location(state.digest, str(root))
        store.add_location(state.components["model"].digest, root.resolve().as_uri())
        out[run_name] = ck
    store.close()
    return db, out


def test_compare_receipts(tmp_path: Path) -> None:
    m = model_tensors()
    m["head.weight"] = m["head.weight"] * 2
    db, ck = _ledger_with(tmp_path, {"uninterrupted": make_checkpoint(tmp_path / "u"),
                                     "recovered": make_checkpoint(tmp_path / "r", model=m)})
    u, r = ck["uninterrupted"].id, ck["recovered"].id
    result = run("compare", u, r.removeprefix("blake3:")[:12], "--db", db)  # a unique prefix
    assert result.exit_code == 1, result.output
    assert "DIFFERENT: model/head.weight: first difference at element 0 of 32" in result.stdout
    assert f"checkpoint {u[:19]}" in result.stdout
    result = run("compare", u, tmp_path / "u", "--db", db)  # a receipt against a path
    assert result.exit_code == 0, result.output
    # a checkpoint directory that no longer holds the state its receipt names
    flip_tensor(tmp_path / "r", "embed.weight")
    result = run("compare", u, r, "--db", db)
    assert result.exit_code == 1
    assert f"receipt {r}: checkpoint {tmp_path / 'r'}: state digest" in result.stderr
    # a receipt without a state
    store = Store.open(db)
    prepare = store.get(ck["recovered"].parents[0]).receipt.parents[0]
    result = run("compare", prepare, u, "--db", db)
    assert result.exit_code == 2 and "names no state artifact" in result.stderr


# ------------------------------------------------------------------------------------------------- verify


def test_verify_checkpoint_receipt_recomputes_from_files_and_names_the_tensor(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    db, ck = _ledger_with(tmp_path, {"run-a": root})
    rid = ck["run-a"].id
    result = run("verify", rid, "--db", db, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["artifacts_verified"] == 2  # state and model, both from the directory

    flip_tensor(root, "layers.0.bias")
    result = run("verify", rid, "--db", db)
    assert result.exit_code == 1
    assert "component 'model' tensor 'layers.0.bias' (model.safetensors) does not match its manifest" \
        in result.stderr
    assert f"receipt {rid}" in result.stderr

    root2 = make_checkpoint(tmp_path / "ckpt2")
    db2, ck2 = _ledger_with(tmp_path / "second", {"run-b": root2})
    (root2 / "manifest.json").unlink()
    result = run("verify", ck2["run-b"].id, "--db", db2)
    assert result.exit_code == 1 and "incomplete checkpoint" in result.stderr


def test_verify_refuses_a_pickle_in_a_checkpoint_and_leaves_no_marker(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    db, ck = _ledger_with(tmp_path, {"run-a": root})
    marker = tmp_path / "MARKER"
    (root / "model.safetensors").write_bytes(pickle_payloads(tmp_path, marker)["pickle"])
    result = run("verify", ck["run-a"].id, "--db", db)
    assert result.exit_code == 1 and "is a pickle/torch file; refusing to read it" in result.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- progress, startup


def test_progress_bar_only_on_a_terminal_and_after_the_delay() -> None:
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=100)
    with _ProgressBar("hashing", console=term) as bar:
        bar(10, 100)  # before the delay: nothing
        assert not bar.shown
        bar.DELAY = 0.0
        bar(10, 100)
        assert bar.shown
    assert "hashing" in buf.getvalue()
    pipe = Console(file=io.StringIO(), force_terminal=False)
    with _ProgressBar("hashing", console=pipe) as bar:
        bar.DELAY = 0.0
        bar(10, 100)
        assert not bar.shown


def test_digest_and_compare_import_neither_torch_nor_numpy(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from ledger.cli import app\n"
        f"r = CliRunner().invoke(app, ['digest', {str(root)!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(app, ['compare', {str(root)!r}, {str(root)!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"



HOSTILE_NAMES = ("[/]", "[bold red]EQUAL[/bold red]", "a\x1b[2J\x1b[31mOK", "a\nb\nEQUAL", "r\u202etxt",
                 "w:x:y")  # rich would show an emoji for ":x:"


def test_names_from_a_file_are_printed_as_they_are(tmp_path: Path) -> None:
    """Tensor names are the file's: never read as rich markup (a '[/]' raised MarkupError, a traceback), escape
    sequences and newlines written as escapes, one table row per tensor; the JSON keeps them exact."""
    from tests.helpers_state import raw_safetensors

    a = raw_safetensors(tmp_path / "a.safetensors", {n: ("U8", [1], b"\x00") for n in HOSTILE_NAMES})
    b = raw_safetensors(tmp_path / "b.safetensors", {n: ("U8", [1], b"\x01" if n in ("[/]", "w:x:y") else b"\x00")
                                                     for n in HOSTILE_NAMES})
    result = run("digest", a)
    assert result.exit_code == 0, result.output
    for shown in ("[/]", "[bold red]EQUAL[/bold red]", "a\\x1b[2J\\x1b[31mOK", "a\\x0ab\\x0aEQUAL", "r\\u202etxt",
                  "w:x:y"):
        assert shown in result.stdout, (shown, result.stdout)
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert not any(line.strip() in ("b", "EQUAL") for line in result.stdout.splitlines())
    assert set(json.loads(run("digest", a, "--json").stdout)["tensors"]["a"]) == set(HOSTILE_NAMES)
    result = run("compare", a, b)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.stdout.rstrip().splitlines()[-1].startswith("DIFFERENT") and "[/]" in result.stdout
    assert "w:x:y" in result.stdout and "\u274c" not in result.stdout  # not rich's emoji for ":x:"
