"""The receipt: a small canonical document whose id is the digest of its bytes.

Every receipt body has exactly these keys (``null`` where a field does not apply), see docs/receipts.md:

    v, alg, kind, run, rank, step, prepared, selection, parents, artifacts, measurements

``parents`` is a sorted list of distinct receipt ids, so a receipt commits to its whole history (a DAG, like git).
``artifacts`` maps a name to the digest of what it refers to (a file, a tensor state, a table).
``measurements`` is any canonical JSON object (integers, exact floats, strings, lists, objects).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
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
    def from_bytes(cls, data: bytes) -> Receipt:
        """Parse canonical receipt bytes. Non-canonical bytes or a bad shape raise MalformedReceipt/NonCanonical."""
        document = digests.parse_canonical(data)  # proves data == canonical_bytes(document)
        validate_fields(document)
        receipt = cls._of_valid(document)
        # The receipt holds exactly the parsed document (see _of_valid), so its canonical bytes are ``data``: keep
        # them as the body instead of encoding them a second time.
        receipt.__dict__["body"] = bytes(data)  # fills the cached_property (the dataclass is frozen)
        return receipt

    @classmethod
    def from_document(cls, document: Any) -> Receipt:
        validate_fields(document)
        return cls._of_valid(document)

    @classmethod
    def _of_valid(cls, document: Mapping[str, Any]) -> Receipt:
        """The receipt of a document :func:`validate_fields` accepted, checked once, not again by ``__post_init__``
        (a stored receipt is parsed once per read: a second validation cost a fifth of scanning a ledger).

        Its fields are the document's values, containers copied as ``__init__`` would (``parents`` a tuple of the
        list's items, ``artifacts`` and ``measurements`` dicts), so ``to_document()`` equals the document.
        tests/ledger/test_receipts.py checks that this and the validating constructor build the same receipt."""
        receipt = object.__new__(cls)
        kind = document["kind"]
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


def validate_fields(doc: Any) -> None:
    """Check a receipt document's shape; raise MalformedReceipt naming the first bad field."""
    if not isinstance(doc, dict):
        raise MalformedReceipt("body is not a JSON object")
    if doc.keys() != _FIELD_SET:
        keys = set(doc)
        missing = sorted(set(FIELDS) - keys)
        extra = sorted(keys - set(FIELDS))
        raise MalformedReceipt(f"fields: missing {missing}, unexpected {extra}")
    if doc["v"] != SCHEMA_VERSION or not _is_int(doc["v"]):
        raise MalformedReceipt(f"v: expected schema version {SCHEMA_VERSION}, got {doc['v']!r}")
    if doc["alg"] != digests.ALGORITHM:
        raise MalformedReceipt(f"alg: expected {digests.ALGORITHM!r}, got {doc['alg']!r}")
    if not isinstance(doc["kind"], str) or doc["kind"] not in KINDS:
        raise MalformedReceipt(f"kind: {doc['kind']!r} is not one of {', '.join(sorted(KINDS))}")
    run = doc["run"]
    if run is not None and (not isinstance(run, str) or not _NAME_RE.fullmatch(run)):
        raise MalformedReceipt(f"run: expected null or a name matching {_NAME_RE.pattern}, got {run!r}")
    for name in ("rank", "step"):
        value = doc[name]
        if value is not None and (not _is_int(value) or value < 0):
            raise MalformedReceipt(f"{name}: expected null or a non-negative integer, got {value!r}")
    for name in ("prepared", "selection"):
        value = doc[name]
        if value is not None and not digests.is_digest(value):
            raise MalformedReceipt(f"{name}: expected null or blake3:<64 hex>, got {value!r}")
    parents = doc["parents"]
    if not isinstance(parents, (list, tuple)):
        raise MalformedReceipt("parents: expected a list of receipt ids")
    for p in parents:
        if not digests.is_digest(p):
            raise MalformedReceipt(f"parents: {p!r} is not blake3:<64 hex>")
    if list(parents) != sorted(set(parents)):
        raise MalformedReceipt("parents: must be sorted and distinct")
    artifacts = doc["artifacts"]
    if not isinstance(artifacts, Mapping):
        raise MalformedReceipt("artifacts: expected an object of name -> digest")
    for name, value in artifacts.items():
        if not _NAME_RE.fullmatch(name):
            raise MalformedReceipt(f"artifacts: bad name {name!r}")
        if not digests.is_digest(value):
            raise MalformedReceipt(f"artifacts.{name}: {value!r} is not blake3:<64 hex>")
    if not isinstance(doc["measurements"], Mapping):
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
