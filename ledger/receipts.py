"""The receipt: a small canonical document whose id is the digest of its bytes.

Every receipt body has exactly these keys (``null`` where a field does not apply), see docs/receipts.md:

    v, alg, kind, run, rank, step, prepared, selection, parents, artifacts, measurements

``parents`` is a sorted list of distinct receipt ids, so a receipt commits to its whole history (a DAG, like git).
``artifacts`` maps a name to the digest of what it refers to (a file, a tensor state, a table).
``measurements`` is any canonical JSON object (integers, exact floats, strings, lists, objects).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any, Final

from ledger import digests
from ledger.errors import LedgerError, MalformedReceipt

SCHEMA_VERSION: Final = 1



class Kind(StrEnum):
    """Every receipt kind. Each has one row in ledger/kinds.py (its chain rule and measurement schema) and one in
    verify/checks.py (what verification recomputes); tests/ledger/test_kinds.py fails when a row is missing."""

    PREPARE = "prepare"  # data, tokenizer, seed model, config -> the `prepared` digest
    SELECTION = "selection"  # the evaluation selection and retention probes -> the `selection` digest
    CONTRACT = "contract"  # pre-registered thresholds, recorded before training
    TRAIN_START = "train-start"  # binds a rank's identity to a run
    CHECKPOINT = "checkpoint"  # state digests at a step
    TRAIN_END = "train-end"  # final digests and per-rank figures
    ARM_SUMMARY = "arm-summary"  # max-rank and total figures of an arm, ratios
    FAULT = "fault"  # a killed rank / failed group
    RESTORE = "restore"  # which checkpoint a rank restored
    COMPARISON = "comparison"  # uninterrupted vs recovered, or model vs model
    EVAL = "eval"  # per-document outcomes of a model on the selection
    QUALITY = "quality"  # the pre-registered quality contract judged from paired comparisons
    REPLICA = "replica"  # a serving replica proving the model it loaded
    SERVE_PHASE = "serve-phase"  # one serving phase: its replicas, request set and per-request log
    SERVE_SUMMARY = "serve-summary"  # the serving section: the three phases judged against the contract
    AUDIT = "audit"  # the recomputed report
    SETTLEMENT = "settlement"  # tokens issued when the contracts pass
    REPORT = "report"  # the audit's report rendered as one HTML page
    NOTE = "note"  # free-form evidence (examples, operator remarks); no extra rules
    KEY = "key"  # registers a public key allowed to sign receipts from here on (docs/transparency.md)


KINDS: Final = frozenset(k.value for k in Kind)


def a_kind(kind: str) -> str:
    """``kind`` after its indefinite article, for messages: "an eval", "an arm-summary", "a checkpoint"."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


FIELDS: Final = (
    "v",
    "alg",
    "kind",
    "run",
    "rank",
    "step",
    "prepared",
    "selection",
    "parents",
    "artifacts",
    "measurements",
)
_FIELD_SET: Final = frozenset(FIELDS)
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,199}$")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Strings already found well-formed, by validate_fields, which meets the same few again and again in a scan of a
# ledger (run and artifact names, prepared and selection digests; not parents, each new). A bounded memo of a pure
# predicate: it changes no verdict, only how often the regular expression runs. One memo per pattern: a string
# well-formed as a name ("abc") is not a digest.
_WELL_FORMED_MAX: Final = 1 << 16


def _memoized_fullmatch(pattern: re.Pattern[str]) -> Callable[[object], bool]:
    """Whether a value is a string that ``pattern`` matches in full, remembering (up to _WELL_FORMED_MAX) the
    strings it matched."""
    seen: set[str] = set()
    fullmatch = pattern.fullmatch

    def well_formed(value: object) -> bool:
        if type(value) is not str:
            return isinstance(value, str) and fullmatch(value) is not None
        if value in seen:
            return True
        if fullmatch(value) is None:
            return False
        if len(seen) < _WELL_FORMED_MAX:
            seen.add(value)
        return True

    return well_formed


_well_formed_name: Final = _memoized_fullmatch(_NAME_RE)
_well_formed_digest: Final = _memoized_fullmatch(digests.DIGEST_RE)


@dataclass(frozen=True, eq=False)
class Receipt:
    """An immutable receipt. Build with :func:`make_receipt` or parse with :meth:`from_bytes`."""

    kind: str
    run: str | None = None
    rank: int | None = None
    step: int | None = None
    prepared: str | None = None
    selection: str | None = None
    parents: tuple[str, ...] = ()
    artifacts: Mapping[str, str] = field(default_factory=dict)
    measurements: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.kind) is not str:  # a Kind member: store its plain value, so encoding never sees the enum
            object.__setattr__(self, "kind", str(self.kind))
        validate_fields(self.to_document())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Receipt) and self.body == other.body

    def __hash__(self) -> int:
        return hash(self.id)

    def to_document(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "alg": digests.ALGORITHM,
            "kind": self.kind,
            "run": self.run,
            "rank": self.rank,
            "step": self.step,
            "prepared": self.prepared,
            "selection": self.selection,
            "parents": list(self.parents),
            "artifacts": dict(self.artifacts),
            "measurements": dict(self.measurements),
        }

    @cached_property
    def body(self) -> bytes:
        """The canonical bytes; the receipt's id is their digest."""
        return digests.canonical_bytes(self.to_document())

    @cached_property
    def id(self) -> str:
        return digests.receipt_id(self.body)

    @classmethod
    def from_bytes(cls, data: bytes, *, keep_body: bool = True) -> Receipt:
        """Parse canonical receipt bytes. Non-canonical bytes or a bad shape raise MalformedReceipt/NonCanonical.

        ``keep_body=False`` for a reader that holds many receipts and never asks for their bytes again (the verifier):
        the body is then encoded again, to the same bytes, only if asked for. Holding it costs an audit of 100,000
        receipts 50 MB and a microsecond each."""
        document = digests.parse_canonical(data)  # proves data == canonical_bytes(document)
        validate_fields(document)
        receipt = cls._of_valid(document, owned=True)
        # The receipt holds exactly the parsed document (see _of_valid), so its canonical bytes are ``data``: keep
        # them as the body instead of encoding them a second time.
        # fills the cached_property (the dataclass is frozen); a bytes-like argument is kept as bytes
        if keep_body:
            receipt.__dict__["body"] = data if type(data) is bytes else bytes(data)
        return receipt

    @classmethod
    def from_document(cls, document: Any) -> Receipt:
        validate_fields(document)
        return cls._of_valid(document)

    @classmethod
    def _of_valid(cls, document: Mapping[str, Any], *, owned: bool = False) -> Receipt:
        """The receipt of a document :func:`validate_fields` accepted, checked once, not again by ``__post_init__``
        (a stored receipt is parsed once per read: a second validation cost a fifth of scanning a ledger).

        Its fields are the document's values, containers copied as ``__init__`` would (``parents`` a tuple of the
        list's items, ``artifacts`` and ``measurements`` dicts), so ``to_document()`` equals the document. ``owned``:
        the document was parsed for this receipt and nothing else holds it, so it is taken (and changed), not
        copied.
        tests/ledger/test_receipts.py checks that this and the validating constructor build the same receipt."""
        receipt = object.__new__(cls)
        kind = document["kind"]
        if owned and type(document) is dict and type(kind) is str:
            # The parsed dict becomes the receipt's attributes (its keys are the fields and the two constants, which
            # go): half of building a fresh one, per stored receipt read.
            del document["v"], document["alg"]
            document["parents"] = tuple(document["parents"])
            object.__setattr__(receipt, "__dict__", document)
            return receipt
        receipt.__dict__.update(
            kind=kind if type(kind) is str else str(kind),  # a Kind member: its plain value, as __post_init__ does
            run=document["run"],
            rank=document["rank"],
            step=document["step"],
            prepared=document["prepared"],
            selection=document["selection"],
            parents=tuple(document["parents"]),
            artifacts=dict(document["artifacts"]),
            measurements=dict(document["measurements"]),
        )
        return receipt


def _natural(value: object) -> bool:
    """A non-negative integer, not a bool (exact ints first: the common case costs no isinstance)."""
    return (type(value) is int or _is_int(value)) and value >= 0  # type: ignore[operator]


def _mapping(value: object) -> bool:
    return type(value) is dict or isinstance(value, Mapping)


def validate_fields(doc: Any) -> None:
    """Check a receipt document's shape; raise MalformedReceipt naming the first bad field.

    Every stored receipt passes here once per read, so the common case is kept cheap: exact types before
    isinstance, the memo of well-formed names and digests, the sort check only for two parents or more."""
    if not isinstance(doc, dict):
        raise MalformedReceipt("body is not a JSON object")
    if doc.keys() != _FIELD_SET:
        keys = set(doc)
        missing = sorted(set(FIELDS) - keys)
        extra = sorted(keys - set(FIELDS))
        raise MalformedReceipt(f"fields: missing {missing}, unexpected {extra}")
    version = doc["v"]
    if version != SCHEMA_VERSION or not (type(version) is int or _is_int(version)):
        raise MalformedReceipt(f"v: expected schema version {SCHEMA_VERSION}, got {version!r}")
    if doc["alg"] != digests.ALGORITHM:
        raise MalformedReceipt(f"alg: expected {digests.ALGORITHM!r}, got {doc['alg']!r}")
    kind = doc["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise MalformedReceipt(f"kind: {kind!r} is not one of {', '.join(sorted(KINDS))}")
    run = doc["run"]
    if run is not None and not _well_formed_name(run):
        raise MalformedReceipt(f"run: expected null or a name matching {_NAME_RE.pattern}, got {run!r}")
    rank, step = doc["rank"], doc["step"]
    if rank is not None and not _natural(rank):
        raise MalformedReceipt(f"rank: expected null or a non-negative integer, got {rank!r}")
    if step is not None and not _natural(step):
        raise MalformedReceipt(f"step: expected null or a non-negative integer, got {step!r}")
    prepared, selection = doc["prepared"], doc["selection"]
    if prepared is not None and not _well_formed_digest(prepared):
        raise MalformedReceipt(f"prepared: expected null or blake3:<64 hex>, got {prepared!r}")
    if selection is not None and not _well_formed_digest(selection):
        raise MalformedReceipt(f"selection: expected null or blake3:<64 hex>, got {selection!r}")
    parents = doc["parents"]
    if not isinstance(parents, (list, tuple)):
        raise MalformedReceipt("parents: expected a list of receipt ids")
    for p in parents:
        if not digests.is_digest(p):
            raise MalformedReceipt(f"parents: {p!r} is not blake3:<64 hex>")
    count = len(parents)  # two parents (the common case beyond one) are in order if the first is the smaller
    if count > 1 and (parents[0] >= parents[1] if count == 2 else list(parents) != sorted(set(parents))):
        raise MalformedReceipt("parents: must be sorted and distinct")
    artifacts = doc["artifacts"]
    if not _mapping(artifacts):
        raise MalformedReceipt("artifacts: expected an object of name -> digest")
    for name, value in artifacts.items():
        if not _well_formed_name(name):
            raise MalformedReceipt(f"artifacts: bad name {name!r}")
        if not digests.is_digest(value):
            raise MalformedReceipt(f"artifacts.{name}: {value!r} is not blake3:<64 hex>")
    if not _mapping(doc["measurements"]):
        raise MalformedReceipt("measurements: expected an object")


def make_receipt(
    kind: str | Kind,
    *,
    run: str | None = None,
    rank: int | None = None,
    step: int | None = None,
    prepared: str | None = None,
    selection: str | None = None,
    parents: Iterable[str | Receipt] = (),
    artifacts: Mapping[str, str] | None = None,
    measurements: Mapping[str, Any] | None = None,
) -> Receipt:
    """Build a receipt; parents may be ids or receipts and are sorted and de-duplicated here."""
    ids = sorted({p.id if isinstance(p, Receipt) else p for p in parents})
    receipt = Receipt(
        kind=kind,
        run=run,
        rank=rank,
        step=step,
        prepared=prepared,
        selection=selection,
        parents=tuple(ids),
        artifacts=dict(artifacts or {}),
        measurements=dict(measurements or {}),
    )
    receipt.body  # noqa: B018 - encode now so an unencodable measurement fails at the writer, not later
    return receipt


def parse_receipt(data: bytes, *, source: str = "input") -> Receipt:
    """Parse receipt bytes from a file or stdin; a trailing newline is tolerated (files often end in one)."""
    if data.endswith(b"\n"):
        data = data[:-1]
    try:
        return Receipt.from_bytes(data)
    except LedgerError:
        raise
    except Exception as exc:  # pragma: no cover - defensive: any parser surprise becomes one line
        raise MalformedReceipt(f"{source}: {exc}") from exc
