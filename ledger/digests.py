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

Two implementations give the same bytes and the same errors. :func:`canonical_bytes_reference` and
:func:`parse_canonical_reference` are the reference: a walk that checks every value (naming the path of the first
bad one), then ``json.dumps``. :func:`canonical_bytes` and :func:`parse_canonical` take a fast path (one cached C
encoder; for parsing, orjson's parser and encoder where its text is the canonical one; checks that cost no
per-value Python where the input allows it) and hand anything the fast path cannot prove canonical to the reference,
which then accepts it or raises its own error. The property tests and the vectors of docs/receipts.md §8 check
that both agree byte for byte (tests/ledger/test_digests.py).
"""

from __future__ import annotations

import errno
import json
import json.encoder
import json.scanner
import math
import mmap
import os
import re
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import blake3
import orjson

from ledger.errors import InputError, MalformedDigest, NonCanonical, UnsafeFile

ALGORITHM: Final = "blake3"
ENCODING_VERSION: Final = 1
DIGEST_HEX_LEN: Final = 64
_PREFIX: Final = f"{ALGORITHM}:"
DIGEST_RE: Final = re.compile(r"blake3:[0-9a-f]{64}")  # for fullmatch only (search would find it inside)
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


def canonical_bytes_reference(value: Any) -> bytes:
    """The reference encoder: check every value (:func:`_check_value`), then ``json.dumps``. Slower than
    :func:`canonical_bytes`, which must give exactly these bytes and these errors."""
    _check_value(value, "$")
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


# The fast path. One encoder built once (json.dumps builds one per call, a few microseconds for a small document);
# no circular-reference markers, since only values proven to be finite trees (_plain) or fresh from json.loads
# reach it. It refuses NaN and infinities itself (ValueError), and a lone surrogate fails the UTF-8 encoding
# (UnicodeEncodeError, a ValueError): both go to the reference, which names the value.
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False,
                                   check_circular=False)


def _c_encoder() -> Any:
    """json's C encoder configured as _ENCODER, built once (``JSONEncoder.encode`` builds one per call); None where
    the C accelerator is missing or takes other arguments (then _ENCODER.encode is used)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        encoder = make(None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", True, False, False)
        probe = {"b": [1, -2.5, None, True, "é\n"], "a": {"": 1e16}}
        return encoder if "".join(encoder(probe, 0)) == _ENCODER.encode(probe) else None
    except Exception:  # noqa: BLE001 - another Python's signature: use the portable path
        return None


_C_ENCODER: Final = _c_encoder()


def _encode(value: Any) -> str:
    """The canonical text of a value the fast path vouches for (see canonical_bytes)."""
    return "".join(_C_ENCODER(value, 0)) if _C_ENCODER is not None else _ENCODER.encode(value)


# json's C scanner: json.loads without its Python layers (whitespace skipping, which canonical text never needs).
_MAKE_SCANNER = getattr(json.scanner, "c_make_scanner", None)
_SCANNER: Final = _MAKE_SCANNER(json.JSONDecoder()) if _MAKE_SCANNER is not None else None


def _scan(text: str) -> Any:
    """The value of JSON text (json.loads' defaults); ValueError unless one value spans the whole text."""
    if _SCANNER is None:
        return json.loads(text)
    try:
        value, end = _SCANNER(text, 0)
    except StopIteration as exc:
        raise ValueError("no JSON value at the start") from exc
    if end != len(text):
        raise ValueError("extra data")
    return value


_encode_string: Final = json.encoder.encode_basestring  # json's C string encoder (ensure_ascii=False)
# Leaves the encoder checks by itself (floats: finite; strings: no lone surrogate, found by the UTF-8 encoding).
# Exact types only: a subclass (an enum member, say) takes the reference path, which treats it as before.
_LEAVES: Final = frozenset({str, float, bool, type(None)})


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is built only of exact dict (string keys), list, tuple, str, int (signed 64-bit), float,
    bool and None, at most MAX_DEPTH levels deep: what the fast encoder may encode without the reference walk.
    False means "ask the reference", never "invalid"."""
    t = type(value)
    if t is dict:
        for k in value:
            if type(k) is not str:
                return False
        items: Any = value.values()
    elif t is list or t is tuple:
        items = value
    elif t is int:
        return _INT_MIN <= value <= _INT_MAX
    else:
        return t in _LEAVES
    if depth >= MAX_DEPTH:
        return False
    for x in items:
        tx = type(x)
        if tx in _LEAVES:
            continue
        if tx is int:
            if _INT_MIN <= x <= _INT_MAX:
                continue
            return False
        if not _plain(x, depth + 1):
            return False
    return True


def canonical_bytes(value: Any) -> bytes:
    """Encode ``value`` as canonical JSON bytes; raise NonCanonical for anything without an exact encoding.

    Exactly :func:`canonical_bytes_reference`'s bytes and errors: values the fast path cannot vouch for (a subclass,
    an integer out of range, a non-string key, NaN, a lone surrogate, too deep) are encoded by the reference."""
    if _plain(value):
        try:
            return _encode(value).encode("utf-8")
        except (ValueError, RecursionError):
            pass
    return canonical_bytes_reference(value)


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
    shown = token if len(token) <= 40 else f"{token[:20]}...{token[-8:]} ({len(token):,} characters)"
    if not math.isfinite(value):
        raise NonCanonical(f"float {shown} is out of range (beyond a 64-bit float)")
    if repr(value) != token:
        raise NonCanonical(f"float {shown} is not in shortest round-trip form ({value!r})")
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


# For the fast parser's integer check: digits become "0", the bytes an integer token can follow ("[", ":", ",", and
# "-" for its sign) become "(", everything else " ". An integer of 19 or more digits (the only ones that can fall
# outside signed 64 bits) then shows as "(" and 19 zeros, or 19 zeros at the start. So can a digit run inside a
# string ("blake3:1234..."): the parsed value is then checked exactly, by _plain.
_NUMBER_SHAPE: Final = bytes(0x30 if 0x30 <= b <= 0x39 else 0x28 if b in b"[:,-" else 0x20 for b in range(256))
_LONG_INT: Final = b"(" + b"0" * 19
_LONG_INT_AT_START: Final = b"0" * 19


# orjson (a Rust parser and encoder, 4-5x json's C scanner and encoder on a receipt) writes every value of canonical
# JSON as the specification does except floats below 1e-4 in magnitude: "0.00001" for repr's "1e-05", "1e-7" for
# "1e-07" (tests/ledger/test_digests.py compares every code point and floats of every exponent). Text with neither
# "e-" nor "0.0000" holds no such float, so there its re-encoding is the canonical one; elsewhere json's path decides.
# Its encoder also keeps the limits: it refuses integers beyond 53 bits (OPT_STRICT_INTEGER; larger ones take json's
# path) and nesting beyond 254 levels, both inside receipts.md's, so what it vouches for needs no other check
# (test_fast_encoder_and_parser_agree_at_the_depth_limit would see a change of orjson's limit).
_UNSURE: Final = object()
_ORJSON_CANONICAL: Final = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
# The two searches as literal patterns: SRE's literal search takes half the time of ``bytes in`` on a receipt body
# (0.27 against 0.55 us for "e-", whose "e" fills every hex digest); one pattern with both would be slower.
_EXPONENT_MINUS: Final = re.compile(rb"e-").search
_FOUR_ZEROS: Final = re.compile(rb"0\.0000").search


def _orjson_round_trip(data: bytes) -> Any:
    """The value of ``data`` if orjson re-encodes it to exactly ``data`` where its encoding is the canonical one,
    else _UNSURE (never an error of its own). Such a value is within the limits of receipts.md §1."""
    if _EXPONENT_MINUS(data) is not None or _FOUR_ZEROS(data) is not None:  # b"e-" in data or b"0.0000" in data
        return _UNSURE
    try:
        value = orjson.loads(data)
        if orjson.dumps(value, option=_ORJSON_CANONICAL) != data:
            return _UNSURE
    except (ValueError, TypeError):  # orjson's JSONDecodeError and JSONEncodeError (deep, a long integer)
        return _UNSURE
    return value


def _within_limits(data: bytes, value: Any) -> bool:
    """Whether the value parsed from ``data`` is within the limits: decided from the bytes (brackets, long digit runs)
    or, when those are inconclusive, on the value itself."""
    shape = data.translate(_NUMBER_SHAPE)
    unsure = (data.count(b"[") + data.count(b"{") > MAX_DEPTH or _LONG_INT in shape
              or shape.startswith(_LONG_INT_AT_START))
    return not unsure or _plain(value)


def parse_canonical(data: bytes) -> Any:
    """Parse canonical JSON bytes. Anything that would not re-encode to exactly ``data`` is an error.

    The same values and errors as :func:`parse_canonical_reference`. The fast path parses with orjson (or json's
    C scanner) and no Python hooks, re-encodes the same way and compares: bytes that re-encode to themselves cannot
    hold a duplicate key, a non-shortest float, NaN or a non-canonical escape. Only the limits are left to check
    (:func:`_within_limits`). Whatever fails or is unsure is parsed again by the reference, for its verdict and its
    message."""
    if type(data) is bytes:
        value = _orjson_round_trip(data)
        if value is not _UNSURE:
            return value
        try:
            value = _scan(data.decode("utf-8"))
            again = _encode(value).encode("utf-8")
        except (ValueError, RecursionError):  # not UTF-8, not JSON, NaN, a lone surrogate, too deep, ...
            return parse_canonical_reference(data)
        if again == data and _within_limits(data, value):
            return value
    return parse_canonical_reference(data)


def parse_canonical_lines(lines: Sequence[bytes]) -> list[Any] | None:
    """The values of many canonical JSON texts (a JSONL file's lines), parsed as one array: one call of the fast
    path's parser and encoder instead of one per line. None when that cannot vouch for every line; parse each with
    :func:`parse_canonical` then, for its verdict and its message.

    The bracketed, comma-joined lines re-encode to themselves with one element per line exactly when each line is
    the canonical text of its value (a line that is not one value either changes the count or fails to parse)."""
    if not lines or any(type(line) is not bytes for line in lines):
        return None
    joined = b"[" + b",".join(lines) + b"]"
    values = _orjson_round_trip(joined)
    if values is _UNSURE:
        try:
            values = _scan(joined.decode("utf-8"))
            again = _encode(values).encode("utf-8")
        except (ValueError, RecursionError):
            return None
        if again != joined:
            return None
    if len(values) != len(lines):
        return None
    # Where the joined text holds a run of 19 digits (a long integer, or the decimal start of a hex digest after a
    # colon: 2 of the main job's 15 JSONL artifacts), each line is checked as parse_canonical checks it; else only the
    # depth, line by line (the array adds one level).
    long_digit_runs = _LONG_INT in joined.translate(_NUMBER_SHAPE)
    for line, value in zip(lines, values, strict=True):
        if long_digit_runs:
            if not _within_limits(line, value):
                return None
        elif line.count(b"[") + line.count(b"{") > MAX_DEPTH and not _plain(value):
            return None
    return values


def parse_canonical_reference(data: bytes) -> Any:
    """The reference parser: json.loads with hooks refusing duplicate keys, NaN and non-shortest floats, then the
    reference encoder, then a byte comparison. :func:`parse_canonical` must agree with it on every input."""
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
        again = canonical_bytes_reference(value)
    except json.JSONDecodeError as exc:
        raise NonCanonical(f"not JSON: {exc.msg.removesuffix(' at')} at char {exc.pos}") from exc
    except (_TooDeep, RecursionError) as exc:
        raise NonCanonical(f"nested {json_depth(data)} levels deep, deeper than the limit of {MAX_DEPTH} "
                           f"(receipts.md §1)") from exc
    except NonCanonical:
        raise
    except ValueError as exc:  # an integer of over 4,300 digits (Python's limit on converting one)
        raise NonCanonical(f"out of range: an integer of more than {sys.get_int_max_str_digits():,} digits") from exc
    if again != data:
        at = next((i for i, (a, b) in enumerate(zip(again, data, strict=False)) if a != b), min(len(again), len(data)))
        raise NonCanonical(f"not canonical: differs from its canonical form at byte {at}")
    return value


# ------------------------------------------------------------------------------------------------ digests


def format_digest(raw: bytes) -> str:
    return _PREFIX + raw.hex()


def is_digest(text: object) -> bool:
    return isinstance(text, str) and DIGEST_RE.fullmatch(text) is not None


def check_digest(text: object, what: str = "digest") -> str:
    """Return ``text`` if it is a well-formed ``blake3:<64 hex>``; raise MalformedDigest naming ``what``."""
    if not is_digest(text):
        raise MalformedDigest(what, text)
    assert isinstance(text, str)
    return text


def digest_hex(digest: str) -> str:
    return check_digest(digest)[len(_PREFIX) :]


# One hasher per domain with its context key already derived; each digest hashes into a copy of it, which skips
# deriving the key again (a BLAKE3 compression and an object built from a Python string, per digest).
_DOMAIN_HASHERS: Final = {domain: blake3.blake3(derive_key_context=_context(domain)) for domain in DOMAINS}


def digest_bytes(domain: str, data: bytes | memoryview) -> str:
    """Domain-separated digest of ``data``."""
    prototype = _DOMAIN_HASHERS.get(domain)
    hasher = prototype.copy() if prototype is not None else blake3.blake3(derive_key_context=_context(domain))
    hasher.update(data)
    return _PREFIX + hasher.hexdigest()


def digest_json(domain: str, value: Any) -> str:
    """Domain-separated digest of the canonical encoding of ``value``."""
    return digest_bytes(domain, canonical_bytes(value))


def raw_hasher(*, threads: bool = False) -> blake3.blake3:
    """An incremental plain BLAKE3 hasher (``raw_digest`` fed in parts); read it with :func:`hasher_digest`."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)


def hasher_digest(hasher: blake3.blake3) -> str:
    """The ``blake3:<hex>`` digest of what a :func:`raw_hasher` has been fed."""
    return _PREFIX + hasher.hexdigest()


def raw_digest(data: bytes | memoryview, *, threads: bool = True) -> str:
    """Plain BLAKE3 of raw bytes (files, tensor data): equal to what ``b3sum`` prints."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    hasher.update(data)
    return format_digest(hasher.digest())


def file_digest(path: str | os.PathLike[str], *, follow_symlinks: bool = True, threads: bool = True) -> str:
    """Plain BLAKE3 of a regular file's bytes, read through mmap with multi-threaded hashing unless not
    ``threads`` (equals ``b3sum``).

    Anything but a regular file (a FIFO would block, ``/dev/zero`` would never end) is refused unread, and so is
    a symbolic link unless ``follow_symlinks``."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        return fd_digest(fd, threads=threads)
    finally:
        os.close(fd)


def fd_digest(fd: int, *, threads: bool = True) -> str:
    """Plain BLAKE3 of the whole regular file open at ``fd`` (on one thread unless ``threads``)."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
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


def absent_or_directory(path: Path, what: str) -> Path:
    """``path`` when a directory is there or nothing yet (a writer makes it, a reader finds nothing in it); a file
    or anything else there is a mistake, named as ``what`` (InputError, exit 2), not a directory found empty."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return path
    if not stat.S_ISDIR(mode):
        raise InputError(f"{what} {path} is {file_kind(mode)}, not a directory")
    return path


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


def read_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True, max_bytes: int | None = None
                 ) -> bytes:
    """The bytes of the regular file at ``path`` (see :func:`open_regular`); with ``max_bytes``, UnsafeFile for a
    larger file, of which no more than that is read."""
    with os.fdopen(open_regular(path, follow_symlinks=follow_symlinks), "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeFile(os.fspath(path), f"is larger than {max_bytes:,} bytes; refusing to read it")
    return data


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
    dims = list(shape)
    # A checkpoint has one of these per tensor (tens of thousands per audit): its document's canonical bytes are
    # written directly, keys in their sorted order, when every part is of the exact type that makes that safe.
    # Anything else takes the general encoder; tests/ledger/test_digests.py checks both give the same digest.
    if (type(name) is str and type(dtype) is str and type(data) is str
            and all(type(d) is int and _INT_MIN <= d <= _INT_MAX for d in dims)):
        text = (f'{{"data":{_encode_string(data)},"dtype":{_encode_string(dtype)},"name":{_encode_string(name)},'
                f'"shape":[{",".join(map(str, dims))}]}}')
        try:
            return digest_bytes("tensor", text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: the general encoder raises NonCanonical naming it
            pass
    return digest_json("tensor", {"name": name, "dtype": dtype, "shape": dims, "data": data})


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
