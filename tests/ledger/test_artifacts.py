"""Artifacts named by digest (ledger.artifacts): content-addressed paths, where bytes are looked for, atomic writes,
canonical JSONL, and reads that re-hash what they find."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ledger import digests
from ledger.artifacts import (
    ENV_ARTIFACTS,
    ArtifactStore,
    atomic_write,
    default_root,
    jsonl_bytes,
    parse_jsonl,
    path_from_uri,
    put_jsonl,
    read_artifact,
    read_jsonl,
)
from ledger.errors import DigestMismatch, InputError, MissingArtifact, UnsafeFile


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


# --------------------------------------------------------------------------------------- the store's paths


def test_put_bytes_stores_under_the_digest(store: ArtifactStore) -> None:
    digest = store.put_bytes(b"hello")
    assert digest == digests.raw_digest(b"hello")
    hexd = digest.removeprefix("blake3:")
    assert store.path_for(digest) == store.root / "blake3" / hexd[:2] / hexd
    assert store.path_for(digest).read_bytes() == b"hello"
    assert store.get_bytes(digest) == b"hello"
    assert store.put_bytes(b"hello") == digest  # idempotent
    assert os.listdir(store.path_for(digest).parent) == [hexd]  # no temp file left beside it
    assert store.get_bytes(digests.raw_digest(b"absent")) is None
    with pytest.raises(InputError, match="sha256:"):
        store.path_for("sha256:" + "00" * 32)


def test_candidates_put_the_content_addressed_path_first(store: ArtifactStore, tmp_path: Path) -> None:
    digest = digests.raw_digest(b"x")
    located = store.candidates(digest, [str(tmp_path / "plain"), (tmp_path / "a b").as_uri(), "s3://bucket/key"])
    assert located == [store.path_for(digest), tmp_path / "plain", tmp_path / "a b"]


def test_locate_finds_a_file_or_a_directory_where_recorded(store: ArtifactStore, tmp_path: Path) -> None:
    stored = store.put_bytes(b"stored")
    assert store.locate(stored, [str(tmp_path / "elsewhere")]) == store.path_for(stored)
    moved = digests.raw_digest(b"moved")
    (tmp_path / "copy.bin").write_bytes(b"moved")
    (tmp_path / "ckpt").mkdir()
    recorded = ["s3://bucket/copy.bin", str(tmp_path / "gone"), (tmp_path / "ckpt").as_uri(),
                str(tmp_path / "copy.bin")]
    assert store.locate(moved, recorded) == tmp_path / "ckpt"  # the first that exists, file or directory
    assert store.locate(moved, recorded, directory=False) == tmp_path / "copy.bin"
    assert store.locate(moved, recorded, directory=True) == tmp_path / "ckpt"
    with pytest.raises(MissingArtifact, match=f"artifact 'outcomes' {moved} is missing") as info:
        store.locate(moved, recorded[:2], name="outcomes")
    assert info.value.digest == moved and str(store.root) in str(info.value)
    with pytest.raises(MissingArtifact):
        store.locate(moved, [str(tmp_path / "copy.bin")], directory=True)


def test_path_from_uri() -> None:
    assert path_from_uri("/data/ckpt") == Path("/data/ckpt")
    assert path_from_uri("relative/ckpt") == Path("relative/ckpt")
    assert path_from_uri("file:///data/a%20b/ckpt") == Path("/data/a b/ckpt")
    assert path_from_uri("s3://bucket/ckpt") is None
    assert path_from_uri("https://example.org/ckpt") is None


# ---------------------------------------------------------------------------------------------- atomic write


def test_atomic_write_creates_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "file.json"
    atomic_write(target, b"first")
    atomic_write(target, b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["file.json"]


@pytest.mark.parametrize("failure", ["write", "replace", "directory"])
def test_atomic_write_leaves_no_temp_file_on_failure(tmp_path: Path, failure: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "file.json"
    if failure == "write":  # the write itself fails: the old file stays as it was
        target.write_bytes(b"old")
        data: Any = "not bytes"
        with pytest.raises(TypeError):
            atomic_write(target, data)
        assert target.read_bytes() == b"old"
    elif failure == "replace":  # the rename fails (another file system, say): the old file stays
        target.write_bytes(b"old")

        def refuse(src: Any, dst: Any) -> None:
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "replace", refuse)
        with pytest.raises(OSError, match="cross-device"):
            atomic_write(target, b"new")
        assert target.read_bytes() == b"old"
    else:  # a directory in the way: refused before anything is written, as a FIFO, a device or a link would be
        (target / "inside").mkdir(parents=True)
        with pytest.raises(UnsafeFile, match="is a directory; refusing to replace it"):
            atomic_write(target, b"new")
        assert target.is_dir()
    assert os.listdir(tmp_path) == ["file.json"]


# ----------------------------------------------------------------------------------------------------- JSONL


def test_jsonl_is_one_canonical_value_per_line() -> None:
    records: list[Any] = [{"b": 1, "a": [2.5, None]}, "x", 3]
    data = jsonl_bytes(records)
    assert data == b'{"a":[2.5,null],"b":1}\n"x"\n3\n'
    assert parse_jsonl(data) == records
    assert jsonl_bytes([]) == b"" and parse_jsonl(b"") == []


@pytest.mark.parametrize(("data", "message"), [
    (b'{"a":1}\n{"a":2}', "outcomes: JSONL must end with a newline"),
    (b'{"a":1}\n{"a": 2}\n', "outcomes line 2: non-canonical JSON"),
    (b'{"a":1}\n\n{"a":2}\n', "outcomes line 2:"),
    (b'1\n2\n{"b":1,"a":2}\n', "outcomes line 3: non-canonical JSON"),
])
def test_parse_jsonl_names_the_line(data: bytes, message: str) -> None:
    with pytest.raises(InputError) as info:
        parse_jsonl(data, source="outcomes")
    assert info.value.one_line().startswith(message), info.value.one_line()


# ------------------------------------------------------------------------------------------------- reading


def test_read_artifact_rehashes_what_it_finds(store: ArtifactStore, tmp_path: Path) -> None:
    a = put_jsonl(store, [{"doc": 1}])
    b = store.put_bytes(b"other bytes")
    assert read_artifact(store, a, name="outcomes") == b'{"doc":1}\n'
    assert read_jsonl(store, a) == [{"doc": 1}]
    os.replace(store.path_for(b), store.path_for(a))  # another artifact renamed into a's place
    with pytest.raises(DigestMismatch, match=f"artifact outcomes at {store.path_for(a)}") as info:
        read_artifact(store, a, name="outcomes")
    assert (info.value.expected, info.value.actual) == (a, b)
    # not in the store: read from a recorded location, which is re-hashed too
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(b'{"doc":1}\n')
    store.path_for(a).unlink()
    assert read_artifact(store, a, locations=[str(copy)]) == b'{"doc":1}\n'
    copy.write_bytes(b'{"doc":2}\n')
    with pytest.raises(DigestMismatch) as info:
        read_artifact(store, a, locations=[str(copy)])
    assert info.value.actual == digests.raw_digest(b'{"doc":2}\n')
    with pytest.raises(MissingArtifact, match="artifact 'outcomes'") as missing:
        read_artifact(store, b, name="outcomes")
    assert missing.value.digest == b


def test_read_jsonl_names_the_artifact_of_a_bad_line(store: ArtifactStore) -> None:
    digest = store.put_bytes(b'{"a":1}\n{"a": 1}\n')
    with pytest.raises(InputError, match="retention line 2: non-canonical JSON"):
        read_jsonl(store, digest, name="retention")


# --------------------------------------------------------------------------------------------- default root


def test_default_root(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_root("sqlite:////srv/ledger/ledger.db") == Path("/srv/ledger/artifacts")
    assert default_root("sqlite:///work/ledger.db").resolve() == Path("work/artifacts").resolve()  # relative
    assert default_root("postgresql+psycopg://host/ledger") == Path("artifacts")
    assert default_root(None) == Path("artifacts")
    monkeypatch.setenv(ENV_ARTIFACTS, "")  # empty is unset
    assert default_root("sqlite:////srv/ledger/ledger.db") == Path("/srv/ledger/artifacts")
    monkeypatch.setenv(ENV_ARTIFACTS, "/mnt/artifacts")
    assert default_root("sqlite:////srv/ledger/ledger.db") == Path("/mnt/artifacts")
    assert default_root(None) == Path("/mnt/artifacts")


def test_a_file_given_as_the_artifact_directory_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `verify --artifacts FILE` reported every artifact missing (exit 0), and `ledger run prepare` with
    LEDGER_ARTIFACTS=FILE failed at its first write, after pretraining the seed."""
    from typer.testing import CliRunner

    from ledger.artifacts import artifact_dir, default_root, workdir_root
    from ledger.cli import app
    from ledger.errors import InputError
    from ledger.receipts import make_receipt

    a_file = tmp_path / "artifacts"
    a_file.write_bytes(b"not a directory")
    assert artifact_dir(tmp_path / "new") == tmp_path / "new"  # not made yet: fine
    with pytest.raises(InputError, match=f"artifact directory {a_file} is a regular file, not a directory"):
        artifact_dir(a_file)
    with pytest.raises(InputError):  # the default beside an SQLite ledger
        default_root(f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.setenv("LEDGER_ARTIFACTS", "/dev/null")
    for where in (lambda: default_root(None), lambda: workdir_root(tmp_path)):
        with pytest.raises(InputError, match="/dev/null is a character device, not a directory"):
            where()
    monkeypatch.delenv("LEDGER_ARTIFACTS")
    db = tmp_path / "l.db"
    assert CliRunner().invoke(app, ["init", "--db", str(db)]).exit_code == 0
    receipt = make_receipt("note")
    (tmp_path / "r.jsonl").write_bytes(receipt.body + b"\n")
    assert CliRunner().invoke(app, ["append", str(tmp_path / "r.jsonl"), "--db", str(db)]).exit_code == 0
    result = CliRunner().invoke(app, ["verify", receipt.id, "--db", str(db), "--artifacts", str(a_file)])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == f"ledger: error: artifact directory {a_file} is a regular file, not a directory\n"
