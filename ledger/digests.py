"""The canonical encoding and every digest the ledger uses.

This is the one module that defines bytes-to-identity. Writers (runners) and checkers (verify) both import it;
nothing else may build canonical bytes or call BLAKE3 for an identity. The format is specified in
``docs/receipts.md``; a change here is a change of that document and of ``ENCODING_VERSION``.

Canonical JSON (version 1) is UTF-8 JSON with:
* objects whose keys are strings, sorted by code point (= by UTF-8 bytes), no duplicates;
* no insignificant whitespace;
* strings escaped as Python's ``json`` does with ``ensure_ascii=False``: ``\\"``, ``\\\\``, ``\\b \\f \\n \\r \\t``,
  other U+0000..U+001F as ``\\u00xx`` (lowercase hex), everything else as raw UTF-8; lone surrogates rejected;
* integers in decimal, within signed 64 bits;
* floats finite only, written as Python's ``repr`` (shortest round-trip decimal, always with ``.`` or ``e``), so a
  float is exact and never confused with an integer;
* ``true``, ``false``, ``null``;
* arrays and objects nested at most ``MAX_DEPTH`` (256) levels deep, for writers and readers alike, so that no
  parser or encoder ever recurses without bound on a hostile document.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import stat
from collections.abc import Mapping, Sequence
from typing import Any, Final

import blake3

from ledger.errors import MalformedDigest, NonCanonical, UnsafeFile

ALGORITHM: Final = "blake3"
ENCODING_VERSION: Final = 1
DIGEST_HEX_LEN: Final = 64
_PREFIX: Final = f"{ALGORITHM}:"
_DIGEST_RE: Final = re.compile(r"^blake3:[0-9a-f]{64}$")
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**63 - 1
# docs/receipts.md §1: writers MUST NOT nest deeper than 256 levels, verifiers MUST accept 256. One limit for both
# keeps every encoder and parser here far below Python's recursion limit, whatever a stored body holds.
MAX_DEPTH: Final = 256

# Domain separation: every kind of digest uses BLAKE3's derive_key mode with its own context string, so bytes
# hashed as one kind can never collide with another kind. Plain BLAKE3 (no context) is reserved for the raw
# bytes of files and tensor data, so those digests equal what `b3sum` prints.
_CONTEXT_BASE: Final = "content-addressed-training-ledger 2026-11 v1 "
DOMAINS: Final = ("receipt", "tensor", "component", "state", "prepared", "selection", "document", "json")


def _context(domain: str) -> str:
    if domain not in DOMAINS:
        raise ValueError(f"unknown digest domain {domain!r}; known: {', '.join(DOMAINS)}")
    return _CONTEXT_BASE + domain


JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]


# ----------------------------------------------------------------------------------------------- encoding


class _TooDeep(NonCanonical):
    """A value nested deeper than MAX_DEPTH (parse_canonical reports the text's depth instead)."""


def _check_value(value: Any, path: str, depth: int = 0) -> None:
    """Reject anything canonical JSON cannot represent exactly (before json.dumps can coerce it).

    The walk recurses at most MAX_DEPTH levels: a value nested deeper (or a list that contains itself) is an
    error, never a RecursionError.
    """
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise NonCanonical(f"{path}: string is not valid Unicode (lone surrogate)") from exc
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise NonCanonical(f"{path}: integer {value} outside signed 64-bit range")
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise NonCanonical(f"{path}: {value!r} is not a finite number")
        return
    if isinstance(value, (list, tuple, Mapping)) and depth >= MAX_DEPTH:
        shown = path if len(path) <= 60 else path[:57] + "..."
        raise _TooDeep(f"{shown}: nested deeper than {MAX_DEPTH} levels (the limit of receipts.md §1)")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise NonCanonical(f"{path}: object key {key!r} is not a string")
            _check_value(key, f"{path}.<key>", depth + 1)
            _check_value(item, f"{path}.{key}", depth + 1)
        return
    raise NonCanonical(f"{path}: {type(value).__name__} has no canonical JSON form")


def canonical_bytes(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes; raise NonCanonical for anything without an exact encoding."""
    _check_value(value, "$")
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


# ------------------------------------------------------------------------------------------------ parsing


def _reject_constant(token: str) -> Any:
    raise NonCanonical(f"{token} is not allowed")


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.loads`` object hook: an object with a key twice is an error, not a silent last-one-wins."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise NonCanonical(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_float(token: str) -> float:
    value = float(token)
    if repr(value) != token:
        raise NonCanonical(f"float {token} is not in shortest round-trip form ({value!r})")
    return value


# A string token (so that brackets inside strings are not counted) or one bracket.
_STRUCTURE: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_depth(data: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (``[]`` is 1), found by scanning, never by recursing."""
    depth = deepest = 0
    for m in _STRUCTURE.finditer(data):
        c = data[m.start()]
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def parse_canonical(data: bytes) -> Any:
    """Parse canonical JSON bytes. Anything that would not re-encode to exactly ``data`` is an error."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NonCanonical(f"not UTF-8 at byte {exc.start}") from exc
    # Depth is bounded before anything recurses without bound: json's C parser counts its nesting against the
    # recursion limit (a RecursionError, caught here), and the re-encoding refuses more than MAX_DEPTH levels, so
    # whatever reads the value afterwards never meets a deeper one.
    try:
        value = json.loads(
            text, object_pairs_hook=reject_duplicate_keys, parse_constant=_reject_constant, parse_float=_parse_float
        )
        again = canonical_bytes(value)
    except json.JSONDecodeError as exc:
        raise NonCanonical(f"not JSON: {exc.msg} at char {exc.pos}") from exc
    except (_TooDeep, RecursionError) as exc:
        raise NonCanonical(f"nested {json_depth(data)} levels deep, deeper than the limit of {MAX_DEPTH} "
                           f"(receipts.md §1)") from exc
    except NonCanonical:
        raise
    except ValueError as exc:  # an integer of over 4,300 digits
        raise NonCanonical(f"out of range: {str(exc)[:80]}") from exc
    if again != data:
        at = next((i for i, (a, b) in enumerate(zip(again, data, strict=False)) if a != b), min(len(again), len(data)))
        raise NonCanonical(f"not canonical: differs from its canonical form at byte {at}")
    return value


# ------------------------------------------------------------------------------------------------ digests


def format_digest(raw: bytes) -> str:
    return _PREFIX + raw.hex()


def is_digest(text: object) -> bool:
    return isinstance(text, str) and _DIGEST_RE.fullmatch(text) is not None


def check_digest(text: object, what: str = "digest") -> str:
    """Return ``text`` if it is a well-formed ``blake3:<64 hex>``; raise MalformedDigest naming ``what``."""
    if not is_digest(text):
        raise MalformedDigest(what, text)
    assert isinstance(text, str)
    return text


def digest_hex(digest: str) -> str:
    return check_digest(digest)[len(_PREFIX) :]


def digest_bytes(domain: str, data: bytes | memoryview) -> str:
    """Domain-separated digest of ``data``."""
    hasher = blake3.blake3(derive_key_context=_context(domain))
    hasher.update(data)
    return format_digest(hasher.digest())


def digest_json(domain: str, value: Any) -> str:
    """Domain-separated digest of the canonical encoding of ``value``."""
    return digest_bytes(domain, canonical_bytes(value))


def raw_digest(data: bytes | memoryview, *, threads: bool = True) -> str:
    """Plain BLAKE3 of raw bytes (files, tensor data): equal to what ``b3sum`` prints."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    hasher.update(data)
    return format_digest(hasher.digest())


def file_digest(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> str:
    """Plain BLAKE3 of a regular file's bytes, read through mmap with multi-threaded hashing (equals ``b3sum``).

    Anything but a regular file (a FIFO would block, ``/dev/zero`` would never end) is refused unread, and so is
    a symbolic link unless ``follow_symlinks``."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        return fd_digest(fd)
    finally:
        os.close(fd)


def fd_digest(fd: int) -> str:
    """Plain BLAKE3 of the whole regular file open at ``fd``."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if os.fstat(fd).st_size:  # mmap refuses an empty file
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            hasher.update(mm)
    return format_digest(hasher.digest())


# ------------------------------------------------------------------------------------------- reading files
# Every file the ledger hashes or parses is opened through open_regular: a FIFO, a device or a socket under a
# trusted name (an artifact location, a checkpoint's model.safetensors) is refused before a byte is read.


def file_kind(mode: int) -> str:
    """What a stat mode is, for messages: "a FIFO", "a character device", ..."""
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of the regular file at ``path``; UnsafeFile (naming the path and what it is)
    for anything else, or for a symbolic link when ``follow_symlinks`` is false.

    The path is stat-ed before it is opened (opening some devices has effects), then opened non-blocking (a FIFO
    swapped in meanwhile cannot block the open) and without following a final symlink when asked, and the open
    descriptor is checked again, which closes the race between the two.
    """
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:  # became a symlink after the stat
            raise _not_regular(path, stat.S_IFLNK) from exc
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    return fd


def read_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file at ``path`` (see :func:`open_regular`)."""
    with os.fdopen(open_regular(path, follow_symlinks=follow_symlinks), "rb") as f:
        return f.read()


def _not_regular(path: str | os.PathLike[str], mode: int) -> UnsafeFile:
    return UnsafeFile(os.fspath(path), f"is {file_kind(mode)}, not a regular file; refusing to read it")


def receipt_id(body: bytes) -> str:
    """A receipt's id: the receipt-domain digest of its canonical bytes."""
    return digest_bytes("receipt", body)


# ------------------------------------------------------------------------------------------ composite digests
# Every composite digest of the system, in one place: writers (runners) and checkers (verify, an independent
# verifier following docs/receipts.md section 3) compute them with these functions and nothing else.


def tensor_digest(name: str, dtype: str, shape: Sequence[int], data: str) -> str:
    """The tensor digest: commits to name, dtype, shape and the data digest of its raw bytes."""
    return digest_json("tensor", {"name": name, "dtype": dtype, "shape": list(shape), "data": data})


def component_digest(component: str, tensors: Mapping[str, str], scalars: Mapping[str, Any]) -> str:
    """The component digest over its tensor digests (by name) and its scalars."""
    return digest_json("component", {"component": component, "tensors": dict(tensors), "scalars": dict(scalars)})


def state_digest(components: Mapping[str, str]) -> str:
    """The checkpoint (state) digest over its component digests."""
    return digest_json("state", {"components": dict(components)})


def prepared_digest(artifacts: Mapping[str, str]) -> str:
    """The `prepared` digest: commits to every artifact of the prepare step (data, tokenizer, seed, config)."""
    return digest_json("prepared", dict(artifacts))


def selection_digest(artifacts: Mapping[str, str]) -> str:
    """The `selection` digest: commits to the evaluation selection and the retention probes."""
    return digest_json("selection", dict(artifacts))


DOCUMENT_KEYS: Final = ("family", "variant", "prompt", "answer", "fields")


def document_digest(body: Mapping[str, Any]) -> str:
    """A task document's or retention probe's digest (domain ``document``) over its body (for a task document,
    exactly the DOCUMENT_KEYS)."""
    return digest_json("document", dict(body))


def text_digest(text: str) -> str:
    """The digest of a prompt or output text: plain BLAKE3 of its UTF-8 bytes (what ``b3sum`` prints)."""
    return raw_digest(text.encode("utf-8"))


def binding_digest(binding: Mapping[str, Any]) -> str:
    """The digest of a rank's binding (who ran it where, with which software)."""
    return digest_json("json", dict(binding))
