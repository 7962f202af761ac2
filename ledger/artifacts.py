"""Artifacts named by digest. Where the bytes live is a lookup, never part of their identity.

The default artifact directory stores a file under ``<root>/blake3/<2 hex>/<64 hex>``. Other places (a checkpoint
directory, a copy moved elsewhere, a ``file://`` URI) are recorded as locations in the ledger. The verifier
re-hashes whatever it finds, so a moved or fetched copy verifies, a wrong copy fails, and an absent one is missing.
Only regular files are read (ledger.digests.open_regular): a FIFO or a device under an artifact's name is refused.

Files are written readable by everyone the umask allows (0644 by default), not 0600 as ``mkstemp`` would make
them: artifacts exist to be re-hashed, often by an auditor running as another user.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ledger import digests
from ledger.errors import DigestMismatch, InputError, MissingArtifact, UnsafeFile

ENV_ARTIFACTS = "LEDGER_ARTIFACTS"
FILE_MODE = 0o644  # before the umask, as open(2) would create a file


def workdir_root(workdir: str | os.PathLike[str]) -> Path:
    """Where the runners of a work directory keep its artifacts: ``$LEDGER_ARTIFACTS``, else ``<workdir>/artifacts``.

    The one rule for every runner (prepare, the rank workers, recovery, evaluation, serving, replay, the
    experiment), whatever ledger they append to: an SQLite file elsewhere or a PostgreSQL URL has no bearing on
    where a work directory's bytes are. Commands given only a ledger use :func:`default_root`."""
    env = os.environ.get(ENV_ARTIFACTS)
    return artifact_dir(Path(env) if env else Path(workdir) / "artifacts")


def default_root(db_url: str | None = None) -> Path:
    """For commands given a ledger and no work directory: ``$LEDGER_ARTIFACTS``, else ``artifacts/`` beside an
    SQLite ledger file, else ``./artifacts`` (the main job keeps its ledger in its work directory, so the two rules
    agree for it; ``--artifacts`` says otherwise)."""
    env = os.environ.get(ENV_ARTIFACTS)
    if env:
        return artifact_dir(Path(env))
    if db_url:
        from ledger.database import sqlite_path  # SQLAlchemy only for callers that have a ledger URL

        path = sqlite_path(db_url)
        if path is not None:
            return artifact_dir(path.parent / "artifacts")
    return artifact_dir(Path("artifacts"))


def artifact_dir(path: Path) -> Path:
    """``path`` as an artifact directory (:func:`ledger.digests.absent_or_directory`): a file there is named before
    any work, not a directory whose every artifact is missing or a write that fails at the end of a run."""
    return digests.absent_or_directory(path, "artifact directory")


def _create_temp(directory: Path, name: str) -> tuple[int, Path]:
    """A new hidden temporary file beside ``name`` in ``directory``, mode FILE_MODE less the umask (``mkstemp``
    would make it 0600, and the rename would keep that)."""
    while True:
        tmp = directory / f".{name}.{os.urandom(8).hex()}.tmp"  # secrets.token_hex's bytes, without importing hmac
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE), tmp
        except FileExistsError:
            continue


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one, never a mix. Only a
    regular file is replaced: a device, a FIFO or a symbolic link at ``path`` (``--out /dev/full`` as root) is
    refused (UnsafeFile) rather than renamed over."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise UnsafeFile(str(path), f"is {digests.file_kind(mode)}; refusing to replace it with a file (give the "
                                    f"path of a regular file, or a new one)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = _create_temp(path.parent, path.name)
    except OSError as exc:
        raise _writing(exc, path) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _writing(exc, path) from exc
        raise
    fsync_path(path.parent)


def _writing(exc: OSError, path: Path) -> OSError:
    """The same error naming the file being written: not its temporary name (which is gone), nor nothing at all
    (a full disk's ENOSPC from write names no file)."""
    return type(exc)(exc.errno, f"cannot write ({exc.strerror or exc})", os.fspath(path))


def path_from_uri(uri: str) -> Path | None:
    """A local path for a location (plain path or file:// URI); None for schemes we cannot read locally."""
    if "://" not in uri:
        return Path(uri)
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return None


class ArtifactStore:
    """A content-addressed directory of files."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, digest: str) -> Path:
        hexd = digests.digest_hex(digest)
        return self.root / digests.ALGORITHM / hexd[:2] / hexd

    def put_bytes(self, data: bytes) -> str:
        digest = digests.raw_digest(data)
        target = self.path_for(digest)
        if not target.exists():
            atomic_write(target, data)
        return digest

    def put_file(self, src: Path) -> str:
        """Copy a regular file in (atomically); returns its digest. An existing identical artifact is kept."""
        with os.fdopen(digests.open_regular(src), "rb") as fsrc:  # hashed and copied from one open file
            digest = digests.fd_digest(fsrc.fileno())
            target = self.path_for(digest)
            if target.exists():
                return digest
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = _create_temp(target.parent, target.name)
            try:
                with os.fdopen(fd, "wb") as f:
                    shutil.copyfileobj(fsrc, f, 1 << 20)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        fsync_path(target.parent)
        return digest

    def get_bytes(self, digest: str) -> bytes | None:
        path = self.path_for(digest)
        return digests.read_regular(path, follow_symlinks=False) if os.path.lexists(path) else None

    def locate(self, digest: str, recorded: Iterable[str] = (), *, name: str | None = None,
               directory: bool | None = None) -> Path:
        """The first place the artifact is (content-addressed path first, then ``recorded`` locations), as a file
        (``directory=False``), a directory (``True``) or either; raises MissingArtifact. Readers re-hash what they
        read; verification re-hashes every candidate (see verify.receipts)."""
        for path in self.candidates(digest, list(recorded)):
            if path.is_dir() if directory else path.is_file() if directory is False else path.exists():
                return path
        raise MissingArtifact(digest, name, str(self.root))

    def candidates(self, digest: str, locations: list[str]) -> list[Path]:
        """Local places where the artifact may be, the content-addressed path first."""
        out = [self.path_for(digest)]
        for uri in locations:
            p = path_from_uri(uri)
            if p is not None:
                out.append(p)
        return out


# ------------------------------------------------------------------------- canonical JSON and JSONL artifacts
# A JSONL artifact is one canonical JSON value per line, each ending in ``\n``; reading re-checks that every line is
# canonical and that the bytes hash to the digest asked for, so a reader never trusts a renamed file.


def jsonl_bytes(records: Iterable[Any]) -> bytes:
    """Canonical JSONL: each record's canonical bytes, then a newline."""
    return b"".join(digests.canonical_bytes(r) + b"\n" for r in records)


def parse_jsonl(data: bytes, *, source: str = "jsonl") -> list[Any]:
    """Parse canonical JSONL bytes (every line canonical, final newline required)."""
    if data and not data.endswith(b"\n"):
        raise InputError(f"{source}: JSONL must end with a newline")
    out: list[Any] = []
    for n, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            out.append(digests.parse_canonical(line))
        except InputError as exc:
            raise InputError(f"{source} line {n}: {exc.one_line()}") from exc
    return out


def put_json(store: ArtifactStore, value: Any) -> str:
    """Store ``value`` as canonical JSON; returns the artifact digest."""
    return store.put_bytes(digests.canonical_bytes(value))


def put_jsonl(store: ArtifactStore, records: Iterable[Any]) -> str:
    """Store records as canonical JSONL; returns the artifact digest."""
    return store.put_bytes(jsonl_bytes(records))


def read_artifact(store: ArtifactStore, digest: str, *, locations: Iterable[str] = (), name: str = "") -> bytes:
    """The bytes of artifact ``digest`` (content-addressed path first, then ``locations``), re-hashed."""
    path = store.locate(digest, locations, name=name or None, directory=False)
    data = digests.read_regular(path, follow_symlinks=False)  # a copy is a regular file (receipts.md §5.3)
    actual = digests.raw_digest(data)
    if actual != digest:
        raise DigestMismatch(f"artifact {name or digest} at {path}", expected=digest, actual=actual)
    return data


def read_json(store: ArtifactStore, digest: str, **kwargs: Any) -> Any:
    return digests.parse_canonical(read_artifact(store, digest, **kwargs))


def read_jsonl(store: ArtifactStore, digest: str, **kwargs: Any) -> list[Any]:
    return parse_jsonl(read_artifact(store, digest, **kwargs), source=kwargs.get("name") or digest)
