"""Checkpoint state read straight from safetensors + canonical JSON (no torch, no pickle), and its digests.

A checkpoint is a directory per rank (the format is specified in docs/receipts.md, "State digests"):

    <component>.safetensors | <component>-00001-of-0000N.safetensors   tensors of a component
    <component>.json                                                  its scalars, canonical JSON
    manifest.json                                                     written last: marks a complete checkpoint

Digests (all built by ledger.digests):

* data digest   = plain BLAKE3 of a tensor's raw little-endian bytes (what ``b3sum`` prints for them);
* tensor digest = digest_json("tensor", {"name", "dtype", "shape", "data"});
* component     = digest_json("component", {"component", "tensors": {name: tensor digest}, "scalars"});
* state         = digest_json("state", {"components": {name: component digest}}).

Canonical JSON sorts keys, so tensor order, re-saving and sharding never change a state digest; file digests
(plain BLAKE3 of each file) are recorded in the manifest too, but equality of states never depends on them.

Files are validated before a byte of tensor data is touched (see :class:`SafetensorsFile`) and hashed through
read-only mmap views: memory stays bounded whatever the checkpoint size, and BLAKE3 runs on every core. Only
regular files are opened (ledger.digests.open_regular), and a checkpoint directory's entries are never followed
as symbolic links: a FIFO would block a reader and a link could point outside the checkpoint.

Reading many checkpoints (:func:`read_states`) is a pipeline: while the hashing threads hash one, the next is
validated; a few are mapped at a time. With file digests, a large file among others is hashed in one pass for its
digest and its tensors' (:func:`hash_file_and_tensors`), its bytes read from memory once. Inside a
:class:`StateCache` (a verification holds one) a checkpoint is read once however often it is asked for.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from ledger import digests
from ledger.artifacts import atomic_write
from ledger.errors import DigestMismatch, InputError, NonCanonical, UnsafeFile

if TYPE_CHECKING:  # imported where the pool starts: concurrent.futures and the logging it imports cost every command
    from concurrent.futures import Future, ThreadPoolExecutor  # that reads states (digest, verify) 4-6 ms of start-up

COMPONENTS: Final = ("model", "optimizer", "outer", "rng")
MANIFEST: Final = "manifest.json"
MANIFEST_FORMAT: Final = "ledger-checkpoint"
MANIFEST_VERSION: Final = 1
MANIFEST_KEYS: Final = frozenset({"format", "version", "checkpoint", "components", "tensors", "files", "meta"})

# Byte-sized safetensors dtypes and their item sizes. Sub-byte types (F4, F6_*) are refused as unknown.
DTYPE_SIZES: Final[Mapping[str, int]] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
MAX_HEADER: Final = 100_000_000  # the limit safetensors itself enforces
# Tensors a file may hold: more than any published checkpoint's shard (DeepSeek-V3 has about 91,000 in all); a
# header within MAX_HEADER could otherwise declare millions, and parsing them takes gigabytes and minutes.
MAX_TENSORS: Final = 200_000

_SHARD_RE: Final = re.compile(r"^(?P<c>[a-z][a-z0-9_]*)-(?P<i>[0-9]{1,6})-of-(?P<n>[0-9]{1,6})\.safetensors$")
_SINGLE_RE: Final = re.compile(r"^(?P<c>[a-z][a-z0-9_]*)\.(?P<ext>safetensors|json)$")

# Tensors at least this large are hashed one at a time with BLAKE3's own threads (one buffer split across
# cores); smaller ones are hashed single-threaded, many at once, by a thread pool (BLAKE3 releases the GIL), so
# hundreds of small tensors keep every core busy too. Measured in benchmarks/digest_bench.py.
PARALLEL_MIN_BYTES: Final = 32 << 20
_INLINE_MAX_BYTES: Final = 64 << 10  # below this a thread hand-off costs more than the hashing

Progress = Callable[[int, int], None]
"""Called from the calling thread as ``progress(bytes_just_hashed, total_bytes)``."""


# ------------------------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


# Pickle protocols 0 and 1 have no header: a stream opening with one of their usual first opcodes (MARK, an empty
# dict, list or tuple, GLOBAL, NONE or a scalar) and ending with STOP is called one. Only where the bytes are
# refused anyway: this names what they are, it decides nothing.
_OLD_PICKLE_FIRST: Final = frozenset(b"(}])cNILFSVXUTJKMG")


def sniff_pickle(head: bytes, tail: bytes = b"") -> str | None:
    """'zip' or 'pickle' when ``head`` (the first bytes) starts like a torch/pickle file, or with ``tail`` (the last
    ones), like a pickle of protocol 0 or 1; else None."""
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if tail.endswith(b".") and head[:1] and head[0] in _OLD_PICKLE_FIRST:
        return "pickle"
    return None


def _last_byte(f: Any) -> bytes:
    """The last byte of the open file ``f`` (b"" when empty); its position is left at the end."""
    size = os.fstat(f.fileno()).st_size
    if not size:
        return b""
    f.seek(size - 1)
    return bytes(f.read(1))


def _refuse_pickle(path: Path, kind: str) -> UnsafeFile:
    what = "a zip archive, as torch.save writes" if kind == "zip" else "a pickle stream"
    return UnsafeFile(str(path), f"is a pickle/torch file; refusing to read it ({what})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsFile:
    """A safetensors file, validated from its header and mapped read-only. Nothing in it is trusted.

    Checks: an 8-byte little-endian header length that fits in the file; a JSON object header (no duplicate
    keys) of ``{name: {"dtype", "shape", "data_offsets"}}`` plus an optional ``"__metadata__"`` of strings;
    known dtypes; offsets inside the data buffer, of exactly numel*itemsize bytes; tensors that neither overlap
    nor leave gaps and cover the buffer to its end. A file that looks like a pickle or a torch zip is refused
    before anything else. Every violation raises :class:`~ledger.errors.UnsafeFile` naming the file.
    """

    def __init__(self, path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> None:
        self.path = Path(path)
        self._follow = follow_symlinks  # False for a checkpoint directory's entries
        self._mm: mmap.mmap | None = None
        self._base: memoryview | None = None
        self._views: list[memoryview] = []
        with os.fdopen(digests.open_regular(self.path, follow_symlinks=follow_symlinks), "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            head = f.read(9)
            if len(head) < 8:
                kind = sniff_pickle(head, head)
                raise _refuse_pickle(self.path, kind) if kind else self._bad(
                    f"truncated: {self.size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head[:8])
            fits = 2 <= n <= MAX_HEADER and 8 + n <= self.size
            # A pickle's first bytes can also read as a small header length; only a header that does not fit
            # or does not open a JSON object makes the file a pickle rather than a damaged safetensors file.
            if not (fits and head[8:9] == b"{"):
                kind = sniff_pickle(head, _last_byte(f))
                if kind:
                    raise _refuse_pickle(self.path, kind)
            if not fits:
                raise self._bad(f"header length {n} runs past the end of the file ({self.size} bytes)")
            f.seek(8)
            raw = f.read(n)
        if len(raw) != n:
            raise self._bad("file shrank while being read")
        self.header_end = 8 + n
        self.metadata, self.tensors = self._parse_header(raw)

    def _bad(self, detail: str) -> UnsafeFile:
        return UnsafeFile(str(self.path), detail)

    def _parse_header(self, raw: bytes) -> tuple[dict[str, str], dict[str, TensorEntry]]:
        # Before parsing: every tensor entry is a JSON object, so '{' bounds their number from above (the header
        # and __metadata__ are the other two).
        objects = raw.count(b"{")
        if objects > MAX_TENSORS + 2:
            raise self._bad(f"header holds {objects:,} JSON objects, more than a file of at most {MAX_TENSORS:,} "
                            f"tensors can (one each)")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=digests.reject_duplicate_keys)
        except (UnicodeDecodeError, ValueError, NonCanonical) as exc:
            raise self._bad(f"header is not JSON: {exc}") from exc
        except RecursionError as exc:  # json's C scanner gives up cleanly; nothing after it recurses
            raise self._bad("header is not a safetensors header: nested too deeply") from exc
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ is not an object of strings")
        if len(header) > MAX_TENSORS:  # the count above lets one more through when there is no __metadata__
            raise self._bad(f"header names {len(header):,} tensors, more than the {MAX_TENSORS:,} a file may hold")
        buffer_len = self.size - self.header_end
        entries: list[TensorEntry] = []
        for name, info in header.items():
            if not name.isascii():  # a "\ud800" escape parses to a lone surrogate, which no digest can encode
                try:
                    name.encode("utf-8")
                except UnicodeEncodeError:
                    raise self._bad(f"tensor name {name!r} is not valid Unicode (a lone surrogate)") from None
            entries.append(self._entry(name, info, buffer_len))
        # Sorted by position, each tensor must start exactly where the previous one ended (zero-size tensors
        # sit between neighbours), the first at 0 and the last ending at the end of the file.
        entries.sort(key=lambda e: (e.begin, e.end))
        at, prev = self.header_end, None
        for e in entries:
            if e.begin < at:
                assert prev is not None
                raise self._bad(f"tensors {prev.name!r} and {e.name!r} overlap (bytes {e.begin - self.header_end}"
                                f"..{at - self.header_end} of the data buffer)")
            if e.begin > at:
                after = f"after tensor {prev.name!r}" if prev else "at the start of the data buffer"
                raise self._bad(f"{e.begin - at} unused bytes {after} (offsets must be contiguous)")
            at, prev = e.end, e
        if at != self.size:
            raise self._bad(f"{self.size - at} trailing bytes after the last tensor")
        return metadata, {e.name: e for e in entries}

    def _entry(self, name: str, info: Any, buffer_len: int) -> TensorEntry:
        # A well-formed entry, recognised in one expression (a checkpoint has thousands); anything else goes
        # through the checks below, in their order, which name what is wrong.
        if name and type(info) is dict and len(info) == 3:
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if (type(dtype) is str and dtype in DTYPE_SIZES and type(shape) is list and type(offsets) is list
                    and len(offsets) == 2):
                begin, end = offsets
                if (type(begin) is int and type(end) is int and 0 <= begin <= end <= buffer_len
                        and all(type(d) is int and d >= 0 for d in shape)
                        and end - begin == prod(shape) * DTYPE_SIZES[dtype]):
                    return TensorEntry(name, dtype, tuple(shape), self.header_end + begin, self.header_end + end)
        return self._checked_entry(name, info, buffer_len)

    def _checked_entry(self, name: str, info: Any, buffer_len: int) -> TensorEntry:
        where = f"tensor {name!r}"
        if not name:
            raise self._bad("a tensor has an empty name")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise self._bad(f"{where}: entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise self._bad(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self._bad(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise self._bad(f"{where}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > buffer_len:
            raise self._bad(f"{where}: data_offsets [{begin}, {end}] run past the end of the data buffer "
                            f"({buffer_len} bytes; truncated file?)")
        expected = prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expected:
            raise self._bad(f"{where}: {end - begin} data bytes, but {dtype}{shape} needs {expected}")
        return TensorEntry(name, dtype, tuple(shape), self.header_end + begin, self.header_end + end)

    # ---- mapped access

    def _buffer(self) -> memoryview:
        if self._base is None:
            with os.fdopen(digests.open_regular(self.path, follow_symlinks=self._follow), "rb") as f:
                if os.fstat(f.fileno()).st_size != self.size:
                    raise self._bad("file changed size while being read")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(self._mm, "madvise"):
                self._mm.madvise(mmap.MADV_SEQUENTIAL)
            self._base = memoryview(self._mm)
        return self._base

    def _track(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    def view(self, name: str) -> memoryview:
        """A read-only view of a tensor's raw bytes (valid until :meth:`close`)."""
        e = self.tensors[name]
        return self._track(self._buffer()[e.begin : e.end])

    def file_view(self) -> memoryview:
        """A read-only view of the whole file (for its file digest)."""
        return self._track(self._buffer()[:])

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._views.clear()
        if self._base is not None:
            self._base.release()
            self._base = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- hashing


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The process's hashing threads, one per core, started once: starting threads for every checkpoint cost more
    than hashing a small one. A forked child (whose copy of the pool has no threads) starts its own."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="ledger-hash"))
        return _POOL[1]


def _workers() -> int:
    return os.cpu_count() or 1


def _hash_all(buffers: Sequence[bytes | memoryview], threads: bool = False) -> list[str]:
    return [digests.raw_digest(b, threads=threads) for b in buffers]


def _balanced(indices: list[int], sizes: Sequence[int], parts: int) -> list[list[int]]:
    """``indices`` split into at most ``parts`` lists of about equal total size (largest first, each to the
    lightest list), so a few pool tasks carry many buffers and finish together."""
    bins: list[list[int]] = [[] for _ in range(max(1, min(parts, len(indices))))]
    loads = [0] * len(bins)
    for i in sorted(indices, key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        bins[k].append(i)
        loads[k] += sizes[i]
    return [b for b in bins if b]


def hash_buffers(buffers: Sequence[bytes | memoryview], progress: Progress | None = None) -> list[str]:
    """Plain BLAKE3 (``raw_digest``) of each buffer, using every core, without copying.

    Large buffers go one at a time through BLAKE3's multi-threaded mode; the rest run single-threaded on the
    hashing threads, in a few tasks of about equal size, while the smallest are hashed by the calling thread.
    """
    sizes = [len(b) for b in buffers]
    total = sum(sizes)
    out: list[str] = [""] * len(buffers)

    def done(indices: Sequence[int]) -> None:
        if progress is not None:
            for i in indices:
                progress(sizes[i], total)

    workers = _workers()
    big = [i for i, n in enumerate(sizes) if n >= PARALLEL_MIN_BYTES]
    pooled = [i for i, n in enumerate(sizes) if _INLINE_MAX_BYTES <= n < PARALLEL_MIN_BYTES]
    inline = [i for i, n in enumerate(sizes) if n < _INLINE_MAX_BYTES]
    if workers == 1 or len(pooled) < 2:
        inline, pooled = inline + pooled, []
    for i in big:
        out[i] = digests.raw_digest(buffers[i])
        done([i])
    tasks: list[tuple[list[int], Future[list[str]]]] = []
    if pooled:
        pool = _executor()
        for part in _balanced(pooled, sizes, 2 * workers):
            tasks.append((part, pool.submit(_hash_all, [buffers[i] for i in part])))
    for i in inline:  # the small ones run here while the pool works
        out[i] = digests.raw_digest(buffers[i], threads=False)
    done(inline)
    for part, fut in tasks:
        for i, d in zip(part, fut.result(), strict=True):
            out[i] = d
        done(part)
    return out


_WINDOW: Final = 256 << 10  # bytes fed to both hashers at a time: they stay in the core's cache between the two


def hash_file_and_tensors(sf: SafetensorsFile) -> tuple[str, dict[str, str]]:
    """A safetensors file's digest and each of its tensors' data digests, in one pass over its bytes.

    Each window of the file is fed to the file's hasher and to its tensor's hasher while it is still in the CPU's
    cache, so the bytes come from memory once instead of twice (tensors tile the data buffer without gaps: see
    :class:`SafetensorsFile`). Single-threaded: run several files at once to use every core."""
    view = sf.file_view()
    whole = digests.raw_hasher()
    whole.update(view[: sf.header_end])
    tensors: dict[str, str] = {}
    for e in sorted(sf.tensors.values(), key=lambda e: (e.begin, e.end)):
        part = digests.raw_hasher()
        for at in range(e.begin, e.end, _WINDOW):
            window = view[at : min(at + _WINDOW, e.end)]
            part.update(window)
            whole.update(window)
        tensors[e.name] = digests.hasher_digest(part)
    return digests.hasher_digest(whole), tensors


# --------------------------------------------------------------------------------------------- digests


tensor_digest = digests.tensor_digest
component_digest = digests.component_digest
state_digest = digests.state_digest


def count_scalars(value: Any) -> int:
    """Leaf values in a JSON value: every non-container value, list elements counted one by one."""
    if isinstance(value, dict):
        return sum(count_scalars(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_scalars(v) for v in value)
    return 1


@dataclass(frozen=True)
class TensorDigest:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: str  # plain BLAKE3 of the raw bytes
    digest: str  # the tensor digest
    file: str  # file name (relative to the checkpoint directory) holding it

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "dtype": self.dtype, "shape": list(self.shape), "data": self.data,
                "file": self.file}


@dataclass(frozen=True)
class ComponentState:
    name: str
    digest: str
    tensors: Mapping[str, TensorDigest]
    scalars: Mapping[str, Any]
    files: tuple[str, ...]  # its .safetensors shards and .json file, relative names

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def tensor_elements(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def scalar_count(self) -> int:
        return count_scalars(dict(self.scalars))

    def counts(self) -> dict[str, int]:
        return {"tensors": self.tensor_count, "tensor_elements": self.tensor_elements,
                "scalars": self.scalar_count}


@dataclass(frozen=True)
class CheckpointState:
    """Recomputed digests of a checkpoint directory (kind "checkpoint") or of one safetensors file ("file").

    For a file, ``digest`` is the digest of its single component (named after the file's stem).
    ``files`` holds file digests when they were asked for, else None.
    """

    path: Path
    kind: Literal["checkpoint", "file"]
    digest: str
    components: Mapping[str, ComponentState]
    files: Mapping[str, str] | None = None
    manifest: Manifest | None = None

    def file_of(self, component: str, tensor: str) -> Path:
        name = self.components[component].tensors[tensor].file
        return self.path / name if self.kind == "checkpoint" else self.path

    def to_json(self, *, tensors: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": str(self.path),
            "kind": self.kind,
            "digest": self.digest,
            "components": {
                c.name: {"digest": c.digest, **c.counts(), "files": list(c.files)} for c in self.components.values()
            },
        }
        if tensors:
            out["tensors"] = {c.name: {t.name: t.to_json() for t in c.tensors.values()}
                              for c in self.components.values()}
        if self.files is not None:
            out["files"] = dict(self.files)
        if self.manifest is not None:
            out["manifest_checkpoint"] = self.manifest.checkpoint
            out["manifest_matches"] = self.manifest.checkpoint == self.digest
            if self.files is not None:
                out["manifest_files_match"] = next(self.file_differences(), None) is None
        return out

    def file_differences(self) -> Iterator[tuple[str, str | None, str | None]]:
        """Each file (by name) whose digest the manifest records otherwise than the directory's bytes hash to:
        (name, recorded, found), None for a file on one side only; none when either side is unknown (no manifest,
        files not hashed)."""
        if self.manifest is None or self.files is None:
            return
        for name in sorted(set(self.manifest.files) | set(self.files)):
            if self.manifest.files.get(name) != self.files.get(name):
                yield name, self.manifest.files.get(name), self.files.get(name)


# ---------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Which files of a checkpoint directory hold what (validated names only; nothing read yet)."""

    root: Path
    tensor_files: Mapping[str, tuple[str, ...]]  # component -> its .safetensors file(s), shard order
    scalar_files: Mapping[str, str]  # component -> its .json file
    has_manifest: bool

    @property
    def components(self) -> list[str]:
        return order_components(set(self.tensor_files) | set(self.scalar_files))

    @property
    def files(self) -> list[str]:
        return sorted([f for fs in self.tensor_files.values() for f in fs] + list(self.scalar_files.values()))


def order_components(names: set[str] | Sequence[str]) -> list[str]:
    """Known components in their fixed order, then any others by name."""
    known = [c for c in COMPONENTS if c in names]
    return known + sorted(set(names) - set(known))


def _unexpected(root: Path, name: str, why: str) -> UnsafeFile:
    p = root / name
    kind = None
    if why == "file":  # a regular file (scan_checkpoint checked): sniff it, so a pickle is called one
        try:
            with os.fdopen(digests.open_regular(p, follow_symlinks=False), "rb") as f:
                kind = sniff_pickle(f.read(4), _last_byte(f))
        except (OSError, UnsafeFile):
            kind = None
    if kind:
        return _refuse_pickle(p, kind)
    return UnsafeFile(str(p), f"unexpected {why} in a checkpoint directory (expected manifest.json and, for "
                              f"components {', '.join(COMPONENTS)}: <component>.json, <component>.safetensors or "
                              f"<component>-NNNNN-of-NNNNN.safetensors)")


def _not_regular_entry(root: Path, entry: os.DirEntry[str]) -> UnsafeFile:
    """A checkpoint entry that is not a regular file, named with what it is (never opened: a FIFO would block)."""
    p = root / entry.name
    if entry.is_symlink():
        try:
            target = f" (to {os.readlink(p)})"
        except OSError:
            target = ""
        return UnsafeFile(str(p), f"is a symbolic link{target}; a checkpoint directory holds only regular files: "
                                  f"refusing to follow it")
    if entry.is_dir(follow_symlinks=False):
        return _unexpected(root, entry.name, "directory")
    kind = digests.file_kind(entry.stat(follow_symlinks=False).st_mode)
    return UnsafeFile(str(p), f"is {kind}, not a regular file; a checkpoint directory holds only regular files")


def scan_checkpoint(path: str | os.PathLike[str], *, require_manifest: bool = True) -> Layout:
    """Classify a checkpoint directory's files; any other entry (a symbolic link, a FIFO, a directory, a file of
    another name) or a missing manifest is an error."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a checkpoint directory")
    shards: dict[str, dict[int, tuple[int, str]]] = {}
    singles: dict[str, str] = {}
    scalars: dict[str, str] = {}
    has_manifest = False
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        name = entry.name
        if not entry.is_file(follow_symlinks=False):
            raise _not_regular_entry(root, entry)
        if name == MANIFEST:
            has_manifest = True
            continue
        m = _SINGLE_RE.match(name)
        s = _SHARD_RE.match(name)
        comp = m["c"] if m else s["c"] if s else None
        if comp not in COMPONENTS:
            raise _unexpected(root, name, "file")
        assert comp is not None
        if m and m["ext"] == "json":
            scalars[comp] = name
        elif m:
            singles[comp] = name
        else:
            assert s is not None
            i, n = int(s["i"]), int(s["n"])
            if not 1 <= i <= n:
                raise UnsafeFile(str(root / name), f"shard number {i} is not within 1..{n}")
            if i in shards.setdefault(comp, {}):
                raise UnsafeFile(str(root / name), f"shard {i} of component {comp!r} appears twice "
                                                   f"(also {shards[comp][i][1]})")
            shards[comp][i] = (n, name)
    if require_manifest and not has_manifest:
        raise UnsafeFile(str(root), f"no {MANIFEST}: an incomplete checkpoint (the manifest is written last) is "
                                    f"never taken as valid")
    tensor_files: dict[str, tuple[str, ...]] = {c: (f,) for c, f in singles.items()}
    for comp, by_index in shards.items():
        if comp in singles:
            raise UnsafeFile(str(root / singles[comp]), f"component {comp!r} is both a single file and sharded")
        counts = {n for n, _ in by_index.values()}
        if len(counts) != 1:
            raise UnsafeFile(str(root), f"shards of component {comp!r} disagree on the shard count {sorted(counts)}")
        (n,) = counts
        missing = sorted(set(range(1, n + 1)) - set(by_index))
        if missing:
            raise UnsafeFile(str(root), f"component {comp!r}: shard(s) {missing} of {n} are missing")
        tensor_files[comp] = tuple(by_index[i][1] for i in range(1, n + 1))
    return Layout(root, tensor_files, scalars, has_manifest)


def component_of_file(path: Path) -> str:
    """Component name of a lone safetensors file: its name up to the first '-' or '.'."""
    return re.split(r"[-.]", path.name, maxsplit=1)[0]


def _read_scalars(path: Path) -> tuple[bytes, dict[str, Any]]:
    data = digests.read_regular(path, follow_symlinks=False)
    kind = sniff_pickle(data[:4], data[-1:])
    if kind:
        raise _refuse_pickle(path, kind)
    try:
        value = digests.parse_canonical(data)
    except NonCanonical as exc:
        raise UnsafeFile(str(path), exc.detail) from exc
    if not isinstance(value, dict):
        raise UnsafeFile(str(path), "component scalars must be a JSON object")
    return data, value


# ------------------------------------------------------------------------------------------------ state


@dataclass
class _Opened:
    """One checkpoint (or file) being hashed: its validated files and the buffers to hash."""

    path: Path
    kind: Literal["checkpoint", "file"]
    files: dict[str, SafetensorsFile] = field(default_factory=dict)  # relative name -> file
    owner: dict[str, str] = field(default_factory=dict)  # relative name -> component
    scalars: dict[str, tuple[str, bytes, dict[str, Any]]] = field(default_factory=dict)  # comp -> (name, raw, value)
    components: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    prehashed: dict[str, str] = field(default_factory=dict)  # relative name -> file digest, hashed before opening
    known: set[str] = field(default_factory=set)  # of those, the files whose bytes another file read has (not opened)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _open(path: Path, require_manifest: bool, prehashed: Mapping[str, str] | None = None,
          known: set[str] | frozenset[str] = frozenset()) -> _Opened:
    """Open and validate a checkpoint directory or a lone file. ``prehashed`` holds the file digests already computed
    of some of its safetensors files, and ``known`` those whose bytes are read from another copy: they are not
    opened here (see :func:`_plan_copies`)."""
    if path.is_dir():
        layout = scan_checkpoint(path, require_manifest=require_manifest)
        opened = _Opened(path, "checkpoint", components=layout.components, prehashed=dict(prehashed or {}))
        try:
            if layout.has_manifest:
                opened.manifest = read_manifest(path)
            for comp, names in layout.tensor_files.items():
                for name in names:
                    if name in known and name in opened.prehashed:
                        opened.known.add(name)
                    else:
                        opened.files[name] = SafetensorsFile(path / name, follow_symlinks=False)
                    opened.owner[name] = comp
            for comp, name in layout.scalar_files.items():
                raw, value = _read_scalars(path / name)
                opened.scalars[comp] = (name, raw, value)
        except BaseException:
            opened.close()
            raise
        return opened
    if not path.exists():
        if path.is_symlink():  # exists() follows links: a dangling one or a loop
            raise UnsafeFile(str(path), "is a symbolic link that leads nowhere (dangling, or a loop)")
        raise FileNotFoundError(2, "No such file or directory", str(path))
    # A lone file: refuse pickles whatever the extension (SafetensorsFile sniffs .safetensors files itself, where
    # a valid header length may begin like a pickle), and anything else not named .safetensors.
    if path.suffix != ".safetensors":
        with os.fdopen(digests.open_regular(path), "rb") as f:  # a FIFO or a device is refused unopened
            kind = sniff_pickle(f.read(4), _last_byte(f))
        if kind:
            raise _refuse_pickle(path, kind)
        raise UnsafeFile(str(path), "not a .safetensors file or a checkpoint directory")
    comp = component_of_file(path)
    return _Opened(path, "file", files={path.name: SafetensorsFile(path)}, owner={path.name: comp},
                   components=[comp])


class StateCache:
    """States already recomputed, by path, while it is active (:meth:`active`): within one verification (an audit
    reads a checkpoint directory cited by several receipts, compares ranks' checkpoints it also verified) each
    state is read once. Only complete checkpoints and files read with their manifest required are kept. Whoever
    activates a cache vouches that the files do not change while it is active.

    It also keeps what each distinct safetensors file holds, by file digest (:class:`_Content`): a checkpoint read
    with its file digests hashes each of its files whole first, and a file whose bytes were read before in this
    cache (a copy: the same seed checkpoint in every run, a model every rank holds after a sync) is only hashed
    whole, its tensors' digests taken from the copy read first. Equal BLAKE3 digests are equal bytes, the premise
    of every digest the ledger records; each copy's own bytes are still hashed, as its file digest."""

    def __init__(self) -> None:
        self._states: dict[Path, CheckpointState] = {}
        self.contents: dict[str, _Content] = {}

    @contextmanager
    def active(self) -> Iterator[StateCache]:
        token = _ACTIVE_CACHE.set(self)
        try:
            yield self
        finally:
            _ACTIVE_CACHE.reset(token)

    def get(self, path: Path, files: bool) -> CheckpointState | None:
        state = self._states.get(path)
        if state is None or (files and state.files is None):
            return None
        return state if files or state.files is None else replace(state, files=None)

    def put(self, state: CheckpointState) -> None:
        have = self._states.get(state.path)
        if have is None or have.files is None:
            self._states[state.path] = state


_ACTIVE_CACHE: ContextVar[StateCache | None] = ContextVar("ledger_state_cache", default=None)


def read_states(
    paths: Sequence[str | os.PathLike[str]],
    *,
    files: bool = False,
    require_manifest: bool = True,
    progress: Progress | None = None,
) -> list[CheckpointState]:
    """Recompute the state digests of checkpoint directories or single safetensors files, hashed together.

    ``files=True`` also computes every file's digest (each byte is then hashed twice; a large file is read once for
    both where other files keep the other cores busy: :func:`hash_file_and_tensors`). A directory without its
    manifest is refused unless ``require_manifest=False`` (used while writing it). Inside an active
    :class:`StateCache`, a path already read is not read again.

    Every path is opened and validated first, in order, and its hashing starts on the hashing threads as soon as it
    is, so that validating the next one overlaps with hashing this one; at most ``_IN_FLIGHT`` checkpoints are
    mapped at a time. States are assembled in order once all are hashed, so errors come in the order of the paths.
    """
    cache = _ACTIVE_CACHE.get() if require_manifest else None
    wanted = [Path(p) for p in paths]
    found = {p: cache.get(p, files) for p in wanted} if cache is not None else {}
    todo = [p for p in dict.fromkeys(wanted) if found.get(p) is None]
    contents = cache.contents if cache is not None and files else None
    for state in _read(todo, files, require_manifest, progress, skip_failed=False, contents=contents):
        found[state.path] = state
        if cache is not None:
            cache.put(state)
    out = []
    for p in wanted:
        got = found[p]
        assert got is not None
        out.append(got)
    return out


def prefetch_states(paths: Sequence[str | os.PathLike[str]], *, files: bool = False) -> None:
    """Read the states of complete checkpoints into the active :class:`StateCache` before they are asked for, all
    at once, so that their hashing keeps every core busy. A path that fails to read is skipped: whoever reads it
    later (:func:`read_states`) meets the error where it belongs. Without an active cache, nothing is read."""
    cache = _ACTIVE_CACHE.get()
    if cache is None:
        return
    todo = [p for p in dict.fromkeys(Path(p) for p in paths) if cache.get(p, files) is None]
    try:
        states = _read(todo, files, True, None, skip_failed=True, contents=cache.contents if files else None)
    except Exception:  # e.g. an I/O error while hashing: the reader meets it again
        return
    for state in states:
        cache.put(state)


def _read(todo: list[Path], files: bool, require_manifest: bool, progress: Progress | None, *,
          skip_failed: bool, contents: dict[str, _Content] | None = None) -> list[CheckpointState]:
    listings = {p: _listing(p) for p in todo}
    total = sum(_planned_bytes(p, listings[p]) for p in todo)  # bytes to hash, known before opening
    report = None if progress is None else (lambda n: progress(n, total * (2 if files else 1)))
    # With ``contents`` (a StateCache's, and file digests asked for), every safetensors file of the checkpoints is
    # hashed whole first; a file whose bytes another file has is then neither opened nor hashed again.
    prehashed, known = _plan_copies(todo, listings, contents, report) if contents is not None else ({}, {})
    opened: list[_Opened] = []
    hashed: dict[int, _Hashed] = {}
    running: deque[tuple[int, _Hashing]] = deque()
    closing: list[Future[None]] = []
    out: list[CheckpointState] = []
    try:
        for p in todo:
            try:
                opened.append(_open(p, require_manifest, prehashed.get(p), known.get(p, frozenset())))
            except Exception:
                if not skip_failed:
                    raise
                continue
            running.append((len(opened) - 1, _submit(opened[-1], files, total)))
            while len(running) > _IN_FLIGHT:
                k, job = running.popleft()
                hashed[k] = _collect(opened[k], job, report, closing)
        while running:
            k, job = running.popleft()
            hashed[k] = _collect(opened[k], job, report, closing)
        for k, o in enumerate(opened):
            data, file_digests = hashed[k]
            try:
                held = _contents(o, data, file_digests, contents)
                out.append(_assemble(o, held, file_digests if files else None))
            except Exception:
                if not skip_failed:
                    raise
    finally:
        for _, job in running:  # an error left hashing running: let it finish before unmapping its files
            job.wait()
        for fut in closing:
            fut.result()
        for o in opened:
            o.close()
    return out


@dataclass(frozen=True)
class _Content:
    """What a safetensors file's bytes hold, as far as a state needs: each tensor (header order) as (name, dtype,
    shape, data digest, tensor digest). Built once per distinct file digest inside a StateCache."""

    tensors: tuple[tuple[str, str, tuple[int, ...], str, str], ...]


def _content_of(sf: SafetensorsFile, data: Mapping[str, str]) -> _Content:
    return _Content(tuple((n, e.dtype, e.shape, data[n], tensor_digest(n, e.dtype, e.shape, data[n]))
                          for n, e in sf.tensors.items()))


def _plan_copies(todo: list[Path], listings: Mapping[Path, list[tuple[str, int]] | None],
                 contents: Mapping[str, _Content], report: Callable[[int], None] | None
                 ) -> tuple[dict[Path, dict[str, str]], dict[Path, set[str]]]:
    """The file digest of every safetensors file in the checkpoint directories of ``todo`` (``listings``, by
    :func:`_listing`), hashed on every core, and per directory the files not to open: those whose digest is in
    ``contents`` or belongs to a file met earlier in ``todo`` (read in full there). A file that cannot be hashed
    here (not a regular file, unreadable, gone) is left out: its checkpoint's reading meets the problem in its
    turn, in its order."""
    where = [(p, name, size) for p in todo for name, size in listings[p] or ()]  # in the order of todo
    found = hash_files([p / name for p, name, _ in where], [n for *_, n in where])
    prehashed: dict[Path, dict[str, str]] = {p: {} for p in todo}
    known: dict[Path, set[str]] = {}
    first: set[str] = set()
    for (p, name, size), digest in zip(where, found, strict=True):
        if digest is None:
            continue
        prehashed[p][name] = digest
        if report is not None:
            report(size)
        if digest in contents or digest in first:
            known.setdefault(p, set()).add(name)
            if report is not None:
                report(size)  # its tensors' half, taken from the copy
        else:
            first.add(digest)
    return prehashed, known


def hash_files(paths: list[Path], sizes: list[int]) -> list[str | None]:
    """Plain BLAKE3 of each file (None for one that cannot be opened as a regular file or read), on every core: a
    large file by BLAKE3's threads, the others single-threaded in a few tasks of about equal size."""

    def one(path: Path, threads: bool) -> str | None:
        try:
            return digests.file_digest(path, follow_symlinks=False, threads=threads)
        except (OSError, ValueError, UnsafeFile):
            return None

    def some(indices: list[int]) -> list[str | None]:
        return [one(paths[i], False) for i in indices]

    out: list[str | None] = [None] * len(paths)
    small = [i for i, n in enumerate(sizes) if n < PARALLEL_MIN_BYTES]
    tasks = [(part, _executor().submit(some, part)) for part in _balanced(small, sizes, 2 * _workers())]
    for i, n in enumerate(sizes):
        if n >= PARALLEL_MIN_BYTES:
            out[i] = one(paths[i], True)
    for part, fut in tasks:
        for i, d in zip(part, fut.result(), strict=True):
            out[i] = d
    return out


def _contents(o: _Opened, data: dict[str, dict[str, str]], file_digests: dict[str, str],
              contents: dict[str, _Content] | None) -> dict[str, _Content]:
    """What each safetensors file of ``o`` holds: from its own bytes (and then kept in ``contents``), or, for a file
    not opened, from the copy read first. Should that copy have failed to read, the file is read here."""
    held: dict[str, _Content] = {}
    for fname, sf in o.files.items():
        held[fname] = content = _content_of(sf, data[fname])
        digest = file_digests.get(fname)
        if contents is not None and digest is not None:
            contents.setdefault(digest, content)
    for fname in o.known:
        digest = o.prehashed[fname]
        if contents is not None and digest in contents:
            held[fname] = contents[digest]
            continue
        with SafetensorsFile(o.path / fname, follow_symlinks=False) as sf:
            whole, tensors = hash_file_and_tensors(sf)
            held[fname] = _content_of(sf, tensors)
        file_digests[fname] = whole
        if contents is not None:
            contents.setdefault(whole, held[fname])
    return held


_IN_FLIGHT: Final = 8  # checkpoints whose files are mapped and being hashed at once
FUSE_MIN_BYTES: Final = 16 << 20  # smaller files are hashed twice from the CPU cache: one pass gains nothing there

# Per checkpoint: file -> tensor -> data digest, and file -> file digest.
_Hashed = tuple[dict[str, dict[str, str]], dict[str, str]]
_Slot = tuple[str, str | None]  # (file, tensor), or (file, None) for the digest of the whole file


def _listing(path: Path) -> list[tuple[str, int]] | None:
    """The safetensors files of a checkpoint directory by name, with their sizes, from one listing made before
    anything is opened (empty if it cannot be listed: _open reports it); None for a path that is no directory."""
    if not path.is_dir():
        return None
    try:
        with os.scandir(path) as it:
            return sorted((e.name, e.stat(follow_symlinks=False).st_size) for e in it
                          if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False))
    except OSError:
        return []


def _planned_bytes(path: Path, listing: list[tuple[str, int]] | None) -> int:
    """The bytes a checkpoint's hashing will read (its safetensors files, or the file itself): what tells a file
    that dominates the work from one among many."""
    if listing is not None:
        return sum(size for _, size in listing)
    try:
        return path.stat().st_size
    except OSError:
        return 0  # _open reports it


@dataclass
class _Hashing:
    """A checkpoint's digests being computed on the hashing threads: which slots each task fills."""

    tasks: list[tuple[list[_Slot], Future[list[str]], int]]  # the slots a task fills, its future, its bytes

    def wait(self) -> None:
        for _, fut, _ in self.tasks:
            if not fut.cancel():
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the error that ended the read is the one raised
                    pass


def _fused(sf: SafetensorsFile) -> list[str]:
    whole, tensors = hash_file_and_tensors(sf)
    return [whole, *(tensors[name] for name in sf.tensors)]


def _submit(o: _Opened, files: bool, total: int) -> _Hashing:
    """Start hashing one opened checkpoint: every tensor's bytes and, with ``files``, every file.

    A file of at least FUSE_MIN_BYTES that leaves room for other work (``total`` is all the bytes of the read) is
    one pass for its digest and its tensors'. Otherwise each buffer is hashed on its own: one at least
    PARALLEL_MIN_BYTES long by BLAKE3's threads, the rest in a few tasks of about equal size."""
    tasks: list[tuple[list[_Slot], Future[list[str]], int]] = []
    try:
        _submit_tasks(o, files, total, tasks)
    except BaseException:
        _Hashing(tasks).wait()  # what started must end before the files are unmapped
        raise
    return _Hashing(tasks)


def _submit_tasks(o: _Opened, files: bool, total: int, tasks: list[tuple[list[_Slot], Future[list[str]], int]]) -> None:
    workers = _workers()
    pool = _executor()
    buffers: list[bytes | memoryview] = []
    slots: list[_Slot] = []
    for fname, sf in o.files.items():
        whole = files and fname not in o.prehashed  # its file digest is still to compute
        if whole and sf.size >= FUSE_MIN_BYTES and workers > 1 and sf.size * workers <= total:
            tasks.append(([(fname, None), *((fname, t) for t in sf.tensors)], pool.submit(_fused, sf),
                          2 * sf.size - sf.header_end))
            continue
        for tname in sf.tensors:
            buffers.append(sf.view(tname))
            slots.append((fname, tname))
        if whole:
            buffers.append(sf.file_view())
            slots.append((fname, None))
    if files:
        for name, raw, _ in o.scalars.values():
            buffers.append(raw)
            slots.append((name, None))
    sizes = [len(b) for b in buffers]
    big = [i for i, n in enumerate(sizes) if n >= PARALLEL_MIN_BYTES]
    rest = [i for i, n in enumerate(sizes) if n < PARALLEL_MIN_BYTES]
    for i in big:
        tasks.append(([slots[i]], pool.submit(_hash_all, [buffers[i]], threads=True), sizes[i]))
    for part in _balanced(rest, sizes, 2 * workers if sum(sizes[i] for i in rest) >= _INLINE_MAX_BYTES else 1):
        tasks.append(([slots[i] for i in part], pool.submit(_hash_all, [buffers[i] for i in part]),
                      sum(sizes[i] for i in part)))


def _collect(o: _Opened, job: _Hashing, report: Callable[[int], None] | None,
             closing: list[Future[None]]) -> _Hashed:
    """Wait for a checkpoint's digests, then unmap its files on a hashing thread (unmapping costs about what hashing
    a small checkpoint does; its state is assembled from the digests)."""
    data: dict[str, dict[str, str]] = {name: {} for name in o.files}
    file_digests: dict[str, str] = dict(o.prehashed)
    try:
        for task_slots, fut, nbytes in job.tasks:
            for (fname, tname), digest in zip(task_slots, fut.result(), strict=True):
                if tname is None:
                    file_digests[fname] = digest
                else:
                    data[fname][tname] = digest
            if report is not None:
                report(nbytes)
    except BaseException:
        job.wait()
        raise
    closing.append(_executor().submit(o.close))
    return data, file_digests


def _assemble(o: _Opened, held: Mapping[str, _Content], file_digests: dict[str, str] | None) -> CheckpointState:
    per_comp: dict[str, dict[str, TensorDigest]] = {c: {} for c in o.components}
    comp_files: dict[str, list[str]] = {c: [] for c in o.components}
    for fname, comp in o.owner.items():
        tensors = per_comp[comp]
        for tname, dtype, shape, d, digest in held[fname].tensors:
            if tname in tensors:
                raise UnsafeFile(str(o.path / fname), f"tensor {tname!r} of component {comp!r} also appears in "
                                                      f"{tensors[tname].file}")
            tensors[tname] = TensorDigest(tname, dtype, shape, d, digest, fname)
    for fname, comp in o.owner.items():
        comp_files[comp].append(fname)
    components: dict[str, ComponentState] = {}
    for comp in o.components:
        scal_name, _, scalars = o.scalars.get(comp, ("", b"", {}))
        if scal_name:
            comp_files[comp].append(scal_name)
        tensors = dict(sorted(per_comp[comp].items()))
        digest = component_digest(comp, {n: t.digest for n, t in tensors.items()}, scalars)
        components[comp] = ComponentState(comp, digest, tensors, scalars, tuple(comp_files[comp]))
    if o.kind == "file":
        (only,) = components.values()
        digest = only.digest
    else:
        digest = state_digest({c.name: c.digest for c in components.values()})
    return CheckpointState(o.path, o.kind, digest, components,
                           dict(sorted(file_digests.items())) if file_digests is not None else None, o.manifest)


def read_state(path: str | os.PathLike[str], *, files: bool = False,
               progress: Progress | None = None) -> CheckpointState:
    """Recompute the digests of one checkpoint directory (which must be complete) or one safetensors file."""
    return read_states([path], files=files, progress=progress)[0]


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """The state digest of a complete checkpoint directory, recomputed from its tensors and scalars only."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{p}: not a checkpoint directory")
    return read_state(p).digest


# --------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json``: recorded digests and non-state facts (``meta``)."""

    checkpoint: str
    components: Mapping[str, str]
    tensors: Mapping[str, Mapping[str, str]]
    files: Mapping[str, str]
    meta: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checkpoint": self.checkpoint,
                "components": dict(self.components), "tensors": {c: dict(t) for c, t in self.tensors.items()},
                "files": dict(self.files), "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        def bad(detail: str) -> UnsafeFile:
            return UnsafeFile(where, f"malformed manifest: {detail}")

        if not isinstance(doc, dict) or set(doc) != MANIFEST_KEYS:
            raise bad(f"expected exactly the keys {', '.join(sorted(MANIFEST_KEYS))}")
        if doc["format"] != MANIFEST_FORMAT or doc["version"] != MANIFEST_VERSION:
            raise bad(f"format {doc['format']!r} version {doc['version']!r}, expected {MANIFEST_FORMAT!r} "
                      f"version {MANIFEST_VERSION}")

        def digest_map(value: Any, what: str) -> dict[str, str]:
            if not isinstance(value, dict) or not all(digests.is_digest(v) for v in value.values()):
                raise bad(f"{what} must map names to blake3 digests")
            return value

        if not digests.is_digest(doc["checkpoint"]):
            raise bad("checkpoint is not a blake3 digest")
        if not isinstance(doc["tensors"], dict) or not isinstance(doc["meta"], dict):
            raise bad("tensors and meta must be objects")
        tensors = {c: digest_map(t, f"tensors.{c}") for c, t in doc["tensors"].items()}
        return cls(doc["checkpoint"], digest_map(doc["components"], "components"), tensors,
                   digest_map(doc["files"], "files"), doc["meta"])


def build_manifest(state: CheckpointState, meta: Mapping[str, Any]) -> Manifest:
    """The manifest recording ``state`` (which must include file digests)."""
    if state.files is None:
        raise ValueError("build_manifest needs file digests: read the state with files=True")
    return Manifest(
        checkpoint=state.digest,
        components={c.name: c.digest for c in state.components.values()},
        tensors={c.name: {t.name: t.digest for t in c.tensors.values()} for c in state.components.values()},
        files=dict(state.files),
        meta=dict(meta),
    )


def write_manifest(path: str | os.PathLike[str], meta: Mapping[str, Any],
                   progress: Progress | None = None) -> Manifest:
    """Hash a checkpoint directory's files and write its ``manifest.json`` atomically (call it last)."""
    root = Path(path)
    digests.canonical_bytes(dict(meta))  # refuse a non-canonical meta before hashing anything
    (state,) = read_states([root], files=True, require_manifest=False, progress=progress)
    manifest = build_manifest(state, meta)
    atomic_write(root / MANIFEST, digests.canonical_bytes(manifest.to_json()))
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and validate a checkpoint directory's ``manifest.json`` (canonical JSON)."""
    p = Path(path) / MANIFEST
    if not os.path.lexists(p):  # anything else there (a FIFO, a link) is refused by read_regular, unread
        raise UnsafeFile(str(Path(path)), f"no {MANIFEST}: an incomplete checkpoint is never taken as valid")
    try:
        doc = digests.parse_canonical(digests.read_regular(p, follow_symlinks=False))
    except NonCanonical as exc:
        raise UnsafeFile(str(p), exc.detail) from exc
    return Manifest.from_json(doc, str(p))


# ------------------------------------------------------------------------------------------- verification


def _walk_mismatches(state: CheckpointState, manifest: Manifest) -> Iterator[tuple[str, str, str, str]]:
    """(what, field, recorded, recomputed) for each manifest entry that disagrees, most specific first."""
    absent = "absent"
    comps = order_components(set(manifest.components) | set(state.components))
    for comp in comps:
        have = state.components.get(comp)
        recorded = manifest.tensors.get(comp, {})
        actual = {n: t.digest for n, t in have.tensors.items()} if have else {}
        for name in sorted(set(recorded) | set(actual)):
            if recorded.get(name) != actual.get(name):
                where = f" ({have.tensors[name].file})" if have and name in have.tensors else ""
                yield (f"component {comp!r} tensor {name!r}{where}", f"tensors.{comp}.{name}",
                       recorded.get(name, absent), actual.get(name, absent))
    for comp in comps:
        have = state.components.get(comp)
        rec_c, act_c = manifest.components.get(comp, absent), have.digest if have else absent
        if rec_c != act_c:
            what = "scalars" if have and manifest.tensors.get(comp) is not None else "digest"
            yield f"component {comp!r} {what}", f"components.{comp}", rec_c, act_c
    if manifest.checkpoint != state.digest:
        yield "state digest", "checkpoint", manifest.checkpoint, state.digest
    for name, recorded_file, actual_file in state.file_differences():
        yield f"file {name!r}", f"files.{name}", recorded_file or absent, actual_file or absent


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected_state: str | None = None,
    expected_components: Mapping[str, str] | None = None,
    receipt: str | None = None,
    progress: Progress | None = None,
) -> CheckpointState:
    """Recompute every digest of a complete checkpoint and check it against its manifest (and expectations).

    Raises :class:`~ledger.errors.DigestMismatch` naming the first component and tensor (or scalars, or file)
    whose recorded digest no longer recomputes, then a state or component digest that differs from
    ``expected_state``/``expected_components`` (e.g. a receipt's). Returns the recomputed state.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a checkpoint directory")
    state = read_state(root, files=True, progress=progress)
    assert state.manifest is not None
    for what, fld, recorded, actual in _walk_mismatches(state, state.manifest):
        raise DigestMismatch(f"checkpoint {root}: {what} does not match its manifest", expected=recorded,
                             actual=actual, receipt=receipt, field=fld)
    if expected_state is not None and expected_state != state.digest:
        raise DigestMismatch(f"checkpoint {root}: state digest", expected=expected_state, actual=state.digest,
                             receipt=receipt, field="state")
    for comp, expected in sorted((expected_components or {}).items()):
        actual = state.components[comp].digest if comp in state.components else "absent"
        if expected != actual:
            raise DigestMismatch(f"checkpoint {root}: component {comp!r}", expected=expected, actual=actual,
                                 receipt=receipt, field=comp)
    return state


def recompute(path: Path) -> str:
    """The digest of the artifact at ``path``: a file's bytes, or a checkpoint directory's state digest. A file
    copy must be a regular file itself (receipts.md §5.3): a symbolic link, a FIFO or a device is refused."""
    return checkpoint_digest(path) if path.is_dir() else digests.file_digest(path, follow_symlinks=False)

