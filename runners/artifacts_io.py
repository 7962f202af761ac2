"""Canonical JSON and JSONL artifacts: write them into the artifact store, read them back by digest.

A JSONL artifact is one canonical JSON value per line, each line ending in ``\\n``; reading re-checks that every
line is canonical and that the bytes hash to the digest asked for, so a reader never trusts a renamed file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.errors import DigestMismatch, InputError, MissingArtifact


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
    for path in store.candidates(digest, list(locations)):
        if Path(path).is_file():
            data = Path(path).read_bytes()
            actual = digests.raw_digest(data)
            if actual != digest:
                raise DigestMismatch(f"artifact {name or digest} at {path}", expected=digest, actual=actual)
            return data
    raise MissingArtifact(digest, name or None, str(store.root))


def read_json(store: ArtifactStore, digest: str, **kwargs: Any) -> Any:
    return digests.parse_canonical(read_artifact(store, digest, **kwargs))


def read_jsonl(store: ArtifactStore, digest: str, **kwargs: Any) -> list[Any]:
    return parse_jsonl(read_artifact(store, digest, **kwargs), source=kwargs.get("name") or digest)
