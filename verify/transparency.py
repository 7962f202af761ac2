"""Tamper-evidence checks against whoever holds the database: who signed each receipt, whether the ledger extends
a published head, whether each verified receipt is in it, witnesses, and in-toto attestations (docs/transparency.md).

Every check raises a :class:`~ledger.errors.VerificationError` subclass naming what was found (exit 1):

* signatures: :class:`UnregisteredKey`, :class:`KeyRegisteredLater`, :class:`KeyRevoked` (signed by a key on a
  receipt logged after that key's revocation), ``SignatureInvalid`` (signed bytes differ), :class:`UnsignedReceipt`
  (only when signatures are required), :class:`RevocationUnsigned` (a revocation must be signed, by a registered key
  not revoked before it: ledger/revocation.py);
* a head (a signed checkpoint published before): :class:`LedgerTruncated`, :class:`OlderLedger`,
  :class:`ReceiptRewritten`, :class:`LogReordered`, :class:`LogForked`, :class:`LogRebuilt`, ``NotInLog``;
* a witness: :class:`WitnessRefused`; an attestation: :class:`AttestationMismatch` (and the DSSE errors).

How a head is checked, in this order, each from one read snapshot of the ledger:
  1. the head's signature by a trusted key, and its origin equals the ledger's;
  2. the ledger's log is at least as large as the head (else truncated, or an older copy: see :func:`_short`);
  3. a consistency proof from the head's size to the ledger's, read from the stored nodes, verifies against both
     roots (else the stored tree is not an extension of the head: forked, or rebuilt after a rewrite);
  4. the stored tree is the receipts' tree: every verified receipt's leaf recomputes from its id and signatures and
     matches the stored leaf (else rewritten, or reordered when it matches another leaf), and is included by an
     inclusion proof in the head (or, appended since, in the current tree that step 3 tied to the head). Without
     receipt ids, every leaf is recomputed from the receipt rows (ids re-hashed from bodies) and the whole tree
     refolded, which is stronger than one inclusion proof per receipt and O(n).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from ledger import digests, merkle, note, tlog
from ledger.artifacts import ArtifactStore, atomic_write
from ledger.database import expand_home
from ledger.errors import DigestMismatch, InputError, LedgerError, StoredBodyInvalid, VerificationError
from ledger.reads import Reads, marks, scalar, stored_bytes
from ledger.receipts import Receipt
from ledger.revocation import Revocation, all_revocations
from ledger.signing import ReceiptSignature, verify_receipt_signature
from ledger.store import EXPERIMENT_SPAN, Store
from ledger.tlog import LeafSignature, LogCorrupt
from ledger.transparency import (
    PREDICATE_TYPE,
    NotInLog,
    RegisteredKey,
    consistency,
    inclusion,
    iter_logged,
    leaf_of,
    registered_keys,
    unlogged_receipts,
)
from ledger.transparency_errors import (
    ConsistencyProofInvalid,
    InclusionProofInvalid,
    LogOriginMismatch,
    MalformedEnvelope,
    SignatureInvalid,
    UnknownKey,
)
from verify.receipts import check_rows

T = TypeVar("T")

# ------------------------------------------------------------------------------------------------------ errors


class UnregisteredKey(VerificationError):
    """A receipt signed by a key that no key receipt of the ledger registers."""

    def __init__(self, receipt: str, key: str, registered: list[str]) -> None:
        super().__init__(f"receipt {receipt}: signed by {key}, a key no key receipt registers (registered: "
                         f"{', '.join(registered) or 'none'})", receipt=receipt, field="signature",
                         expected=registered, actual=key)


class KeyRegisteredLater(VerificationError):
    """A receipt signed by a key registered after it in the log (re-signed later, with a key added later)."""

    def __init__(self, receipt: str, key: str, *, leaf: int, registered_at: int, registration: str) -> None:
        super().__init__(f"receipt {receipt} (leaf {leaf}): signed by {key}, registered only at leaf {registered_at} "
                         f"(key receipt {registration}), after the receipt it signs", receipt=receipt,
                         field="signature", expected=f"a key registered at leaf <= {leaf}", actual=registered_at)


class KeyRevoked(VerificationError):
    """Something signed by a key after that key's revocation receipt in the log: a receipt at a later leaf, or a head
    (or an attestation's checkpoint) that includes the revocation."""

    def __init__(self, what: str, key: str, revocation: Revocation, *, after: str, receipt: str | None = None,
                 at: int | None = None) -> None:
        super().__init__(f"{what}: signed by {key}, revoked at leaf {revocation.leaf_index} by key revocation "
                         f"{revocation.receipt}, {after}", receipt=receipt, field="signature",
                         expected=f"a key not revoked before leaf {at}" if at is not None else "a key not revoked",
                         actual=revocation.receipt)
        self.key = key
        self.revocation = revocation.receipt


class RevocationUnsigned(VerificationError):
    """A key revocation with no signature: anyone holding the database could have written it."""

    def __init__(self, revocation: Revocation) -> None:
        super().__init__(f"key revocation {revocation.receipt} (leaf {revocation.leaf_index}) of {revocation.label} "
                         f"is not signed: a revocation must be signed by a registered key not revoked before it",
                         receipt=revocation.receipt, field="signature",
                         expected="a signature by a registered, non-revoked key", actual=None)


class UnsignedReceipt(VerificationError):
    def __init__(self, receipt: str) -> None:
        super().__init__(f"receipt {receipt}: not signed, and signatures are required", receipt=receipt,
                         field="signature", expected="a signature by a registered key", actual=None)


class LedgerTruncated(VerificationError):
    """The ledger holds fewer receipts than the head, and shows it once held more."""

    def __init__(self, *, expected: int, actual: int, evidence: str, whose: str = "the head") -> None:
        super().__init__(f"ledger truncated: {whose} has {expected} leaves, the ledger {actual}; {evidence}",
                         field="log.size", expected=expected, actual=actual)


class OlderLedger(VerificationError):
    """The ledger is smaller than the head and self-consistent: an older copy of it was restored."""

    def __init__(self, *, expected: int, actual: int) -> None:
        super().__init__(f"older ledger: it has {actual} leaves, the head {expected}; an older copy of the database "
                         f"was restored (or truncated with every trace removed)", field="log.size", expected=expected,
                         actual=actual)


class ReceiptRewritten(VerificationError):
    """The receipt (or signatures) at a leaf differ from what the log recorded for that leaf."""

    def __init__(self, receipt: str, *, leaf: int, seq: int, expected: bytes, actual: bytes) -> None:
        super().__init__(f"receipt rewritten: leaf {leaf} (seq {seq}) now holds receipt {receipt}, whose id and "
                         f"signatures are not what the log recorded there", receipt=receipt, field="log.leaf",
                         expected=expected.hex(), actual=actual.hex())
        self.leaf = leaf


class LogReordered(VerificationError):
    """Receipts no longer in the order the log recorded them."""

    def __init__(self, receipt: str, detail: str, *, expected: Any, actual: Any) -> None:
        super().__init__(f"ledger reordered: receipt {receipt} {detail}", receipt=receipt, field="log.order",
                         expected=expected, actual=actual)


class LogForked(VerificationError):
    """The ledger's first n leaves are not the head's: another ledger grown from a common history issued it."""

    def __init__(self, *, size: int, expected: bytes, actual: bytes) -> None:
        super().__init__(f"ledger forked: its tree of {size} leaves has root {actual.hex()}, the head's is "
                         f"{expected.hex()}; the head comes from another ledger grown from a common history (or "
                         f"this one was rewritten and its log rebuilt)", field="log.root", expected=expected.hex(),
                         actual=actual.hex())


class LogRebuilt(VerificationError):
    """The ledger issued the head itself, and its first n leaves changed since: history rewritten, log rebuilt."""

    def __init__(self, *, size: int, expected: bytes, actual: bytes) -> None:
        super().__init__(f"receipts rewritten and the log rebuilt: this ledger issued the head of {size} leaves "
                         f"(root {expected.hex()}), and its tree of {size} leaves now has root {actual.hex()}",
                         field="log.root", expected=expected.hex(), actual=actual.hex())


class WitnessRefused(VerificationError):
    """A witness refuses to cosign a checkpoint (rollback, split view, no consistency proof, unknown log key)."""

    def __init__(self, origin: str, detail: str, *, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"witness refuses the checkpoint of {origin}: {detail}", field="checkpoint",
                         expected=expected, actual=actual)


class AttestationMismatch(VerificationError):
    """An attestation whose signature holds but whose content does not (subjects, receipt, proof)."""

    def __init__(self, detail: str, *, receipt: str | None = None, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"attestation invalid: {detail}", receipt=receipt, field="attestation", expected=expected,
                         actual=actual)


# -------------------------------------------------------------------------------------------------- signatures


@dataclass
class SignatureReport:
    """Who signed the receipts checked: receipts per key label, those signed by no one, and the ledger's keys and
    revocations (all checked: every revocation signed by a registered key not revoked before it)."""

    checked: int = 0
    signed: dict[str, int] = field(default_factory=dict)
    unsigned: list[str] = field(default_factory=list)  # in log order; only the first of them when the count is set
    unsigned_count: int | None = None  # set when only the first unsigned receipt was read (an experiment's check)
    keys: dict[str, RegisteredKey] = field(default_factory=dict)
    revoked: dict[str, Revocation] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for label, count in sorted(self.signed.items()):
            k, r = self.keys[label], self.revoked.get(label)
            revoked = f"; revoked at leaf {r.leaf_index} by {r.receipt}" if r is not None else ""
            out.append(f"signatures: {count} receipt(s) signed by {label} (registered at leaf {k.leaf_index} by "
                       f"{k.receipt}{revoked})")
        if self.unsigned:
            out.append(f"signatures: {self.unsigned_total} receipt(s) unsigned (first {self.unsigned[0]})")
        return out or ["signatures: none checked"]

    @property
    def unsigned_total(self) -> int:
        return len(self.unsigned) if self.unsigned_count is None else self.unsigned_count

    def to_json(self) -> dict[str, Any]:
        def revoked(label: str) -> dict[str, Any] | None:
            r = self.revoked.get(label)
            return None if r is None else {"receipt": r.receipt, "leaf_index": r.leaf_index}

        return {"checked": self.checked, "signed": dict(sorted(self.signed.items())),
                "unsigned": self.unsigned_total, "first_unsigned": self.unsigned[0] if self.unsigned else None,
                "keys": {label: {"key": k.verifier.key(), "receipt": k.receipt, "leaf_index": k.leaf_index,
                                 "revoked": revoked(label)}
                         for label, k in sorted(self.keys.items()) if label in self.signed},
                "revoked": {label: revoked(label) for label in sorted(self.revoked)}}


class _Signatures:
    """Checks stored signatures, each once: a batch signature (ledger/signing.py) signs the receipts the ledger
    stores it with, read through ``conn`` (tlog.signed_together) and verified the first time one of them is met."""

    def __init__(self, conn: Reads, keys: Mapping[str, RegisteredKey], revoked: Mapping[str, Revocation]) -> None:
        self.conn, self.keys, self.revoked = conn, keys, revoked
        self._signs: dict[tuple[str, bytes], frozenset[str]] = {}  # verified signature -> the ids it signs

    def check(self, rid: str, leaf: int, s: LeafSignature) -> None:
        """One signature of the receipt at ``leaf``: by a registered key, registered at or before it, not revoked
        before it, over the receipt's id (alone or with the receipts stored with the same signature)."""
        k = self.keys.get(s.key)
        if k is None:
            raise UnregisteredKey(rid, s.key, sorted(self.keys))
        if k.leaf_index > leaf:
            raise KeyRegisteredLater(rid, s.key, leaf=leaf, registered_at=k.leaf_index, registration=k.receipt)
        r = self.revoked.get(s.key)
        if r is not None and r.leaf_index < leaf:  # a revocation signed by the key it revokes is still its own
            raise KeyRevoked(f"receipt {rid} (leaf {leaf})", s.key, r, after="before the receipt it signs",
                             receipt=rid, at=leaf)
        signs = self._signs.get((s.key, s.signature))
        if signs is None:
            together = tlog.signed_together(self.conn, s.key, s.signature)
            try:
                verify_receipt_signature(ReceiptSignature(rid, s.key, s.signature, together), k.verifier)
            except SignatureInvalid:
                # Another receipt of the batch rewritten is named as such, not as this receipt's bad signature.
                self._rewritten_among([other for other in together if other != rid])
                raise
            signs = self._signs[(s.key, s.signature)] = frozenset(together)
        if rid not in signs:  # signatures are read from the rows that name rid: only a changing ledger gets here
            raise SignatureInvalid(f"receipt {rid}", key=s.key, expected=f"a signature over {rid}",
                                   actual=f"a signature over {len(signs)} other receipt(s)", receipt=rid)

    def _rewritten_among(self, ids: Sequence[str]) -> None:
        """Raise ReceiptRewritten (or LogReordered) for the first of ``ids`` whose leaf no longer recomputes."""
        for rid in ids:
            index, entry = leaf_of(self.conn, rid)
            _check_stored_leaf(self.conn, rid, index, entry.seq, entry, None)

    def check_leaf(self, rid: str, leaf: int, sigs: Sequence[LeafSignature], report: SignatureReport,
                   require: bool) -> None:
        report.checked += 1
        if not sigs:
            if require:
                raise UnsignedReceipt(rid)
            report.unsigned.append(rid)
            return
        for s in sigs:
            self.check(rid, leaf, s)
            report.signed[s.key] = report.signed.get(s.key, 0) + 1

    def check_logged(self, entry: tlog.LogEntry, leaf: int, report: SignatureReport, require: bool,
                     stored: bytes | None = None) -> None:
        """:meth:`check_leaf`, then the leaf itself: it must recompute from the receipt's id and these signatures
        (none added, removed or swapped since it was logged). The signatures first: a signature row replaced after
        logging is named as the bad signature it is. ``stored``: the leaf's stored hash, if read already."""
        self.check_leaf(entry.receipt, leaf, entry.signatures, report, require)
        _check_stored_leaf(self.conn, entry.receipt, leaf, entry.seq, entry, stored)


def checked_revocations(store: Store, keys: Mapping[str, RegisteredKey] | None = None) -> dict[str, Revocation]:
    """The ledger's revocations (ledger/revocation.py), each checked in log order: signed, and every signature by
    a registered key, registered at or before it and not revoked before it, over its id. A revocation that fails
    fails the verification: one that does not count would leave its author believing the key revoked."""
    keys = registered_keys(store) if keys is None else keys
    every = all_revocations(store)
    revoked: dict[str, Revocation] = {}
    for r in every:
        revoked.setdefault(r.label, r)  # the first in log order is when the key stops counting
    with store.reading() as conn:
        signatures = _Signatures(conn, keys, revoked)
        for r in every:
            if not r.signatures:
                raise RevocationUnsigned(r)
            for s in r.signatures:
                signatures.check(r.receipt, r.leaf_index, s)
            # ... and they are the signatures its leaf committed to (none added to an unsigned one since)
            _check_stored_leaf(conn, r.receipt, r.leaf_index, r.seq, tlog.LogEntry(r.seq, r.receipt, r.signatures),
                               None)
    return revoked


def check_signatures(store: Store, receipts: Iterable[str] | None = None, *, require: bool = False
                     ) -> SignatureReport:
    """Check the signatures of ``receipts`` (ids; None: every receipt) against the keys the ledger registers: each
    by a registered key, registered at or before the receipt in log order, not revoked before it, over the
    receipt's id (a batch signature over the ids stored with it, checked once for all of them). Each receipt's leaf
    must still match its id and signatures (a receipt rewritten after it was logged fails here even without a
    head). With ``require`` an unsigned receipt fails. The ledger's revocations are checked first, whichever
    receipts are asked for (:func:`checked_revocations`)."""
    report = _signature_report(store)
    with store.reading() as conn:
        signatures = _Signatures(conn, report.keys, report.revoked)
        if receipts is None:
            for row in iter_logged(conn, bodies=False):
                if row.receipt is None:
                    continue  # a missing row is the integrity checks' (and a head's) to report
                signatures.check_logged(tlog.LogEntry(row.seq, row.receipt, row.signatures), row.leaf_index, report,
                                        require, row.stored_hash)
            for seq, rid in unlogged_receipts(conn):
                raise NotInLog(rid, seq)
            return report
        for rid in receipts:
            index, entry = leaf_of(conn, rid)
            signatures.check_logged(entry, index, report, require)
    return report


def _signature_report(store: Store) -> SignatureReport:
    """An empty report over the ledger's keys and its revocations, those checked first (:func:`checked_revocations`)."""
    keys = registered_keys(store)
    return SignatureReport(keys=keys, revoked=checked_revocations(store, keys))


# The signed receipts in a seq range, with their leaves (read from the signatures' primary key: only signed rows are
# met); rows in a seq range.
_SIGNED_IN_SPAN = ("SELECT s.receipt_seq, r.id, r.prepared, l.leaf_index, s.key, s.signature "
                   "FROM receipt_signatures s JOIN receipts r ON r.seq = s.receipt_seq "
                   "LEFT OUTER JOIN log_leaves l ON l.receipt_seq = s.receipt_seq "
                   "WHERE s.receipt_seq BETWEEN ? AND ? ORDER BY s.receipt_seq")
_ROWS_IN_SPAN = "SELECT seq, id, prepared FROM receipts WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?"


def check_experiment_signatures(store: Store, prepared: str, *, require: bool = False) -> SignatureReport:
    """:func:`check_signatures` of every receipt of an experiment (the rows whose ``prepared`` column holds it, as
    the audit reads them): each signed receipt's signatures checked, and its leaf's; the unsigned ones counted and
    the first named (with ``require`` it fails). Only signed rows are read one by one, so that a ledger with many
    more unsigned receipts costs little more than counting them; the leaves of unsigned receipts, which sign
    nothing, are checked against a head by ``ledger verify --head``."""
    report = _signature_report(store)
    with store.reading() as conn:
        lo, hi, total = conn.all(EXPERIMENT_SPAN, (prepared,))[0]
        if not total:
            return report
        signatures = _Signatures(conn, report.keys, report.revoked)
        signed: dict[int, tuple[str, int | None, list[LeafSignature]]] = {}
        for seq, rid, column, leaf, key, sig in conn.all(_SIGNED_IN_SPAN, (lo, hi)):
            if column == prepared:
                signed.setdefault(seq, (rid, leaf, []))[2].append(LeafSignature.stored(key, sig))
        for seq, (rid, leaf, sigs) in signed.items():
            if leaf is None:
                raise NotInLog(rid, seq)
            signatures.check_logged(tlog.LogEntry(seq, rid, tuple(tlog.in_key_order(sigs))), int(leaf), report,
                                    require)
        report.checked = int(total)
        if total > len(signed):
            first = _first_unsigned(conn, prepared, lo - 1, hi, signed)
            if require:
                raise UnsignedReceipt(first)
            report.unsigned, report.unsigned_count = [first], int(total) - len(signed)
    return report


def _first_unsigned(conn: Reads, prepared: str, after: int, last: int, signed: Mapping[int, object]) -> str:
    """The first receipt of the experiment, in log order, not among ``signed`` (one is: the count says so)."""
    while after < last:
        rows = conn.all(_ROWS_IN_SPAN, (after, last, 512))
        for seq, rid, column in rows:
            if column == prepared and seq not in signed:
                return str(rid)
        after = rows[-1][0]
    raise AssertionError("an unsigned receipt was counted and not found")  # pragma: no cover - one read snapshot


def _stored_leaf(conn: Reads, index: int) -> bytes | None:
    found = scalar(conn, "SELECT hash FROM log_nodes WHERE pos = ?", (tlog.node_pos(0, index),))
    return None if found is None else stored_bytes(found)


def _check_stored_leaf(conn: Reads, rid: str, index: int, seq: int, entry: tlog.LogEntry,
                       stored: bytes | None) -> bytes:
    """The receipt's recomputed leaf hash, which must be the one stored at its leaf (else rewritten or reordered)."""
    actual = tlog.entry_hash(entry)
    if stored is None:
        stored = _stored_leaf(conn, index)
    if stored is None:
        raise LogCorrupt(f"leaf {index} (receipt {rid}) has no hash in log_nodes", receipt=rid,
                         expected="a stored leaf hash", actual=None)
    if actual != stored:
        found = scalar(conn, "SELECT idx FROM log_nodes WHERE level = 0 AND hash = ? LIMIT 1", (actual,))
        if found is not None and int(found) != index:
            raise LogReordered(rid, f"is at leaf {index}, but the log recorded it at leaf {found}",
                               expected=int(found), actual=index)
        raise ReceiptRewritten(rid, leaf=index, seq=seq, expected=stored, actual=actual)
    return actual


# ------------------------------------------------------------------------------------------------------- heads


@dataclass
class HeadReport:
    """A ledger verified against a head: the head, who signed it, how far the ledger has grown since, and how many
    receipts were shown to be included."""

    checkpoint: note.Checkpoint
    signed_by: str
    cosigned_by: list[str]
    ledger_size: int
    included: int
    appended_since: int
    proof_hashes: int
    rows_checked: int | None = None  # rows whose index agrees with their body (every row, when no ids were given)

    def lines(self) -> list[str]:
        cp = self.checkpoint
        cos = f", cosigned by {', '.join(self.cosigned_by)}" if self.cosigned_by else ""
        out = [f"log: extends the head {cp.origin} size {cp.size} root {cp.root.hex()[:16]}... (signed by "
               f"{self.signed_by}{cos}): consistency proof of {self.proof_hashes} hash(es) to size "
               f"{self.ledger_size}",
               f"log: {self.included} receipt(s) included ({self.included - self.appended_since} in the head, "
               f"{self.appended_since} appended since)"]
        if self.rows_checked is not None:
            out.append(f"rows: the index columns, parent edges and artifact rows of all {self.rows_checked} "
                       f"receipt(s) agree with their bodies")
        return out

    def to_json(self) -> dict[str, Any]:
        cp = self.checkpoint
        return {"origin": cp.origin, "head_size": cp.size, "head_root": cp.root.hex(), "signed_by": self.signed_by,
                "cosigned_by": self.cosigned_by, "ledger_size": self.ledger_size, "included": self.included,
                "appended_since": self.appended_since, "consistency_proof_hashes": self.proof_hashes,
                "rows_checked": self.rows_checked}


def open_head(data: bytes | str, trusted: Iterable[note.Verifier], *, witnesses: Sequence[note.Verifier] = ()
              ) -> note.VerifiedCheckpoint:
    """Verify a signed checkpoint against the trusted log keys (whichever signed it) and, if given, require a
    cosignature by each witness."""
    candidates = [v for v in trusted if v.alg == note.ALG_ED25519]
    signed_by = {(s.name, s.key_id) for s in note.parse_note(data).signatures}
    for v in candidates:
        if (v.name, v.key_id) in signed_by:
            return note.verify_checkpoint(data, v, witnesses=witnesses, quorum=len(witnesses))
    raise UnknownKey("log checkpoint", expected=sorted(v.label for v in candidates),
                     actual=[f"{n}+{k:08x}" for n, k in sorted(signed_by)])


def verify_head(store: Store, head: bytes | str, *, trusted: Iterable[note.Verifier] | None = None,
                witnesses: Sequence[note.Verifier] = (), receipts: Sequence[str] | None = None) -> HeadReport:
    """Prove that the ledger extends ``head`` (a signed checkpoint) and that ``receipts`` (ids; None: every
    receipt) are in it; see the module docstring for the order of the checks and what each failure is called.
    ``trusted`` are the log keys the head may be signed by (default: the keys the ledger registers)."""
    registered = registered_keys(store)
    keys = list(trusted) if trusted is not None else [k.verifier for k in registered.values()]
    vc = open_head(head, keys, witnesses=witnesses)
    cp = vc.checkpoint
    _not_revoked_for(checked_revocations(store, registered), [vc.log_signature.label], cp.size, f"log head of size "
                     f"{cp.size}", "which the head includes")
    with store.reading() as conn:
        origin = tlog.origin(conn)
        if origin != cp.origin:
            raise LogOriginMismatch(expected=cp.origin, actual=str(origin))
        size = tlog.log_size(conn)
        if size < cp.size:
            raise _short(conn, size, cp)
        nodes = tlog.DbNodes(conn)
        root = merkle.root_at(nodes, size)
        proof: list[bytes] = []
        if cp.size:
            proof = consistency(conn, cp.size, size)
            try:
                merkle.verify_consistency(cp.size, size, proof, cp.root, root)
            except ConsistencyProofInvalid:
                raise _diverged(conn, cp) from None
        if receipts is None:
            included, since = _refold(conn, cp, size, root)
        else:
            included, since = _included(conn, cp, size, root, receipts)
    # The log vouches for the bodies; readers find receipts by the index rows (kind, prepared, edges, ...): a key
    # revocation whose kind column is edited, an experiment's receipt whose prepared column is, would be missed.
    rows = _check_index_rows(store) if receipts is None else None
    return HeadReport(cp, vc.log_signature.label, [c.label for c in vc.cosignatures], size, included, since,
                      len(proof), rows)


def _check_index_rows(store: Store) -> int:
    """Every stored row's index columns, parent edges and artifact rows against its body (check_row); the number
    of rows."""
    with closing(store.all_rows()) as batches:
        return sum(check_rows(batch) for batch in batches)


def _not_revoked_for(revoked: Mapping[str, Revocation], labels: Iterable[str], size: int, what: str, after: str
                     ) -> None:
    """A head (or a checkpoint) of ``size`` leaves signed by ``labels`` includes no revocation of those keys: a key
    that signs a tree holding its own revocation signed it after it was revoked."""
    for label in labels:
        r = revoked.get(label)
        if r is not None and r.leaf_index < size:
            raise KeyRevoked(what, label, r, after=after)


def _short(conn: Reads, size: int, cp: note.Checkpoint) -> VerificationError:
    """Why a ledger is smaller than the head: truncated if it shows it once held more (leaf hashes left beyond its
    size, or its own record of a larger checkpoint), else an older copy restored."""
    traces = []
    top = scalar(conn, "SELECT max(idx) FROM log_nodes WHERE level = 0")
    if top is not None and int(top) >= size:
        traces.append(f"log_nodes still holds leaf hashes up to leaf {int(top)}")
    issued = scalar(conn, "SELECT max(size) FROM log_checkpoints")
    if issued is not None and int(issued) > size:
        traces.append(f"it issued a checkpoint of size {int(issued)} itself")
    if traces:
        return LedgerTruncated(expected=cp.size, actual=size, evidence="; ".join(traces))
    return OlderLedger(expected=cp.size, actual=size)


def _diverged(conn: Reads, cp: note.Checkpoint) -> VerificationError:
    """The stored tree's first ``cp.size`` leaves are not the head's. If the ledger recorded issuing this very
    head, its history changed since (rewritten, log rebuilt); otherwise another ledger issued it (a fork)."""
    actual = merkle.root_at(tlog.DbNodes(conn), cp.size)
    issued = scalar(conn, "SELECT count(*) FROM log_checkpoints WHERE size = ? AND root = ?", (cp.size, cp.root))
    if issued:
        return LogRebuilt(size=cp.size, expected=cp.root, actual=actual)
    return LogForked(size=cp.size, expected=cp.root, actual=actual)


def _refold(conn: Reads, cp: note.Checkpoint, size: int, root: bytes) -> tuple[int, int]:
    """Every leaf recomputed from the receipt rows (ids re-hashed from the bodies) in leaf order and folded into the
    tree again: its root at the head's size must be the head's, and at the ledger's size the stored one."""
    fold = tlog.Fold()
    head_root = cp.root if cp.size == 0 else None
    previous_seq = 0
    gone: tuple[int, int] | None = None  # the first leaf whose receipt row is gone
    for row in iter_logged(conn):
        if row.leaf_index != fold.size:
            raise LogCorrupt(f"leaf {fold.size} is missing from log_leaves", expected=fold.size,
                             actual=row.leaf_index)
        if row.receipt is None or row.body is None:
            if row.receipt is not None:  # the row is there, its body is not (NULL)
                raise StoredBodyInvalid(row.receipt, f"the row at seq {row.seq} (leaf {row.leaf_index}) has no body")
            gone = gone or (row.leaf_index, row.seq)
            fold.add(row.stored_hash or bytes(32))
            continue
        if gone is not None:  # a receipt after a gone one: a hole, not a truncation
            raise LogCorrupt(f"the receipt of leaf {gone[0]} (seq {gone[1]}) is gone, later ones are not",
                             expected=f"a receipt at seq {gone[1]}", actual=None)
        if row.seq <= previous_seq:
            raise LogReordered(row.receipt, f"(seq {row.seq}) is at leaf {row.leaf_index}, after seq {previous_seq}: "
                               f"the log is not in append order", expected=f"> {previous_seq}", actual=row.seq)
        previous_seq = row.seq
        recomputed = digests.receipt_id(row.body)
        if recomputed != row.receipt:
            raise DigestMismatch("receipt id does not recompute from the stored body", expected=row.receipt,
                                 actual=recomputed, receipt=row.receipt, field="body")
        leaf = tlog.leaf_hash(row.receipt, row.signatures)
        if leaf != row.stored_hash:  # says which: rewritten, reordered, or a leaf hash gone
            _check_stored_leaf(conn, row.receipt, row.leaf_index, row.seq,
                               tlog.LogEntry(row.seq, row.receipt, row.signatures), row.stored_hash)
        fold.add(leaf)
        if fold.size == cp.size:
            head_root = fold.root()
    if gone is not None:  # receipts the head holds are gone, or (after it) receipts the log itself recorded
        before = gone[0] < cp.size
        raise LedgerTruncated(expected=cp.size if before else size, actual=gone[0],
                              evidence=f"leaves {gone[0]} to {size - 1} name receipts no longer stored",
                              whose="the head" if before else "its own log")
    if fold.size != size:
        raise LogCorrupt("log_leaves ends before the log's size", expected=size, actual=fold.size)
    if head_root != cp.root:  # step 3 held, so the stored nodes are not the receipts' tree
        raise LogCorrupt("the head's root does not recompute from the receipts although the stored nodes match it",
                         expected=cp.root.hex(), actual=(head_root or b"").hex())
    if fold.root() != root:
        raise LogCorrupt("the stored nodes do not recompute from the stored leaves", expected=root.hex(),
                         actual=fold.root().hex())
    for seq, rid in unlogged_receipts(conn):
        raise NotInLog(rid, seq)
    return size, size - cp.size


def _included(conn: Reads, cp: note.Checkpoint, size: int, root: bytes, receipts: Sequence[str]
              ) -> tuple[int, int]:
    """An inclusion proof per receipt (its leaf recomputed): in the head if it was logged before it, else in the
    current tree, which the consistency proof ties to the head. A child logged before its parent is reordered."""
    since = 0
    index_of: dict[str, int] = {}
    for rid in receipts:
        index, entry = leaf_of(conn, rid)
        _check_stored_leaf(conn, rid, index, entry.seq, entry, None)
        index_of[rid] = index
        proof = inclusion(conn, rid, cp.size if index < cp.size else size)
        try:
            proof.verify(cp.root if index < cp.size else root)
        except InclusionProofInvalid as exc:
            raise LogCorrupt(f"receipt {rid} matches its stored leaf {index} but is not included: {exc.detail}",
                             receipt=rid, expected=exc.expected, actual=exc.actual) from None
        since += index >= cp.size
    listed = list(index_of)
    bodies = [row for i in range(0, len(listed), 500) for row in conn.all(
        f"SELECT id, body FROM receipts WHERE id IN ({marks(len(listed[i:i + 500]))})", listed[i:i + 500])]
    for rid, body in bodies:
        for parent in Receipt.from_bytes(stored_bytes(body)).parents:
            if parent in index_of and index_of[parent] > index_of[rid]:
                raise LogReordered(rid, f"is at leaf {index_of[rid]}, before its parent {parent} at leaf "
                                   f"{index_of[parent]}", expected=f"> {index_of[parent]}", actual=index_of[rid])
    return len(index_of), since


# ----------------------------------------------------------------------------------------------------- witness

ENV_WITNESS: str = "LEDGER_WITNESS"
DEFAULT_WITNESS_DIR = Path("~/.config/training-ledger/witness")


def witness_dir(given: str | os.PathLike[str] | None = None) -> Path:
    """``given``, else ``$LEDGER_WITNESS``, else ``~/.config/training-ledger/witness``."""
    value = os.fspath(given) if given is not None else os.environ.get(ENV_WITNESS) or str(DEFAULT_WITNESS_DIR)
    return expand_home(value)


@dataclass(frozen=True)
class WitnessResult:
    """A checkpoint a witness accepted and cosigned; ``previous`` is the size it had seen before (None: first)."""

    checkpoint: note.Checkpoint
    previous: int | None
    proof_hashes: int
    cosigned: bytes
    log_key: str

    def to_json(self) -> dict[str, Any]:
        return {"origin": self.checkpoint.origin, "size": self.checkpoint.size, "root": self.checkpoint.root.hex(),
                "previous_size": self.previous, "consistency_proof_hashes": self.proof_hashes,
                "log_key": self.log_key}


def witness_add_head(state: str | os.PathLike[str] | None, head: bytes, witness: note.Signer, *,
                     log_key: note.Verifier | None = None, store: Store | None = None,
                     timestamp: int | None = None) -> WitnessResult:
    """Accept and cosign ``head`` if it extends the last checkpoint this witness accepted for its origin.

    The state directory keeps, per origin, the log's key (pinned the first time: ``log_key``, else the key the
    ledger ``store`` registers that signed it) and the last accepted checkpoint with its cosignature. A larger
    checkpoint needs a consistency proof from the last one; the witness computes it from the ledger ``store`` and
    verifies it against the two roots it holds (the ledger is not trusted). Without a ledger there is no proof, and
    the checkpoint is refused.
    """
    if witness.alg != note.ALG_COSIGNATURE_V1:
        raise WitnessRefused("?", f"key {witness.name} is not a witness (cosignature/v1) key: create one with "
                             f"`ledger keys new NAME --witness`")
    unverified = note.parse_checkpoint(note.parse_note(head).text)
    origin = unverified.origin
    where = witness_dir(state) / quote(origin, safe="")
    pinned_path, last_path = where / "log.vkey", where / "checkpoint"
    pinned = _from_state(pinned_path, lambda data: note.Verifier.from_key(data.decode("utf-8", "replace")))
    if pinned is not None and log_key is not None and log_key != pinned:
        raise WitnessRefused(origin, "the log key given is not the one this witness pinned for the origin",
                             expected=pinned.key(), actual=log_key.key())
    key = pinned or log_key
    if key is None and store is not None:
        signed_by = {f"{s.name}+{s.key_id:08x}" for s in note.parse_note(head).signatures}
        known = [k.verifier for label, k in registered_keys(store).items() if label in signed_by]
        key = known[0] if known else None
    if key is None:
        raise WitnessRefused(origin, "no key for this log: give the log's public key (--log-key) the first time")
    cp = note.verify_checkpoint(head, key, origin=origin).checkpoint
    previous = _from_state(last_path, lambda data: note.parse_checkpoint(note.parse_note(data).text))
    proof: list[bytes] = []
    if previous is not None:
        if cp.size < previous.size:
            raise WitnessRefused(origin, f"size {cp.size} is smaller than the last checkpoint seen ({previous.size}): "
                                 f"a rollback", expected=f">= {previous.size}", actual=cp.size)
        if cp.size == previous.size and cp.root != previous.root:
            raise WitnessRefused(origin, f"a second root for size {cp.size}: a split view",
                                 expected=previous.root.hex(), actual=cp.root.hex())
        if cp.size > previous.size and previous.size > 0:
            proof = _witness_proof(store, origin, previous.size, cp.size)
            try:
                merkle.verify_consistency(previous.size, cp.size, proof, previous.root, cp.root)
            except ConsistencyProofInvalid as exc:
                raise WitnessRefused(origin, f"it does not extend the last checkpoint seen (size {previous.size}): "
                                     f"{exc.detail}; a split view or a rewritten log",
                                     expected=exc.expected, actual=exc.actual) from None
    if store is not None:
        _log_key_not_revoked(store, origin, cp, key)
    cosigned = note.cosign_checkpoint(head, key, witness,
                                      timestamp=int(time.time()) if timestamp is None else timestamp)
    where.mkdir(parents=True, exist_ok=True)
    if pinned is None:
        atomic_write(pinned_path, (key.key() + "\n").encode())
    atomic_write(last_path, cosigned)
    return WitnessResult(cp, None if previous is None else previous.size, len(proof), cosigned, key.label)


def _log_key_not_revoked(store: Store, origin: str, cp: note.Checkpoint, key: note.Verifier) -> None:
    """Refuse a checkpoint whose tree includes a revocation of the log key that signed it (a head the key signed
    after it was revoked). The revocation is taken from the ledger only when it is checked (signed, by a registered
    key not revoked before it) and proved to be in the checkpoint's own tree: a ledger cannot make a witness refuse
    a head with a revocation the head does not commit to. A ledger of another origin, or too small to hold the
    checkpoint's tree, says nothing about it."""
    with store.reading() as conn:
        if tlog.origin(conn) != origin or tlog.log_size(conn) < cp.size:
            return
    revoked = checked_revocations(store).get(key.label)
    if revoked is None or revoked.leaf_index >= cp.size:
        return
    with store.reading() as conn:
        proof = inclusion(conn, revoked.receipt, cp.size)
    try:
        proof.verify(cp.root)
    except InclusionProofInvalid:
        return
    raise WitnessRefused(origin, f"its key {key.label} was revoked at leaf {revoked.leaf_index} by "
                         f"{revoked.receipt}, which this checkpoint of {cp.size} leaves includes",
                         expected=f"a checkpoint of at most {revoked.leaf_index} leaves by {key.label}",
                         actual=cp.size)


def _witness_proof(store: Store | None, origin: str, size1: int, size2: int) -> list[bytes]:
    if store is None:
        raise WitnessRefused(origin, f"no consistency proof from size {size1} to {size2}: give the ledger (--db) "
                             f"to compute one from", expected="a consistency proof", actual=None)
    with store.reading() as conn:
        have = tlog.origin(conn)
        if have != origin:
            raise WitnessRefused(origin, f"the ledger given is another log ({have})", expected=origin, actual=have)
        size = tlog.log_size(conn)
        if size < size2:
            raise WitnessRefused(origin, f"the ledger given has {size} leaves, fewer than the checkpoint's {size2}: "
                                 f"it cannot prove the checkpoint", expected=f">= {size2}", actual=size)
        return consistency(conn, size1, size2)


# ------------------------------------------------------------------------------------------------ attestations


@dataclass
class AttestationReport:
    receipt: str
    kind: str
    signed_by: list[str]
    subjects: list[str]
    rehashed: list[str]
    checkpoint: note.Checkpoint
    leaf_index: int

    def lines(self) -> list[str]:
        cp = self.checkpoint
        return [f"OK attestation of {self.kind} receipt {self.receipt}: DSSE signed by {', '.join(self.signed_by)}",
                f"  subjects: {', '.join(self.subjects)} ({len(self.rehashed)} re-hashed from local bytes)",
                f"  included: leaf {self.leaf_index} of {cp.origin} size {cp.size} root {cp.root.hex()[:16]}..."]

    def to_json(self) -> dict[str, Any]:
        cp = self.checkpoint
        return {"ok": True, "receipt": self.receipt, "kind": self.kind, "signed_by": self.signed_by,
                "subjects": self.subjects, "rehashed": self.rehashed, "origin": cp.origin, "tree_size": cp.size,
                "root": cp.root.hex(), "leaf_index": self.leaf_index}


def _b64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedEnvelope(f"{what} is not a base64 string", actual=type(value).__name__)
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise MalformedEnvelope(f"{what} is not standard base64", actual=value[:80]) from None
    return raw


def _from_state(path: Path, parse: Callable[[bytes], T]) -> T | None:
    """What a witness state file holds (None if there is none): read only if it is a regular file, and a file
    that does not parse is named as the witness's own state, not blamed on the head being added."""
    if not os.path.lexists(path):
        return None
    try:
        return parse(digests.read_regular(path))
    except LedgerError as exc:
        raise InputError(f"witness state {path} is damaged: {exc.one_line()}") from exc


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with os.fdopen(digests.open_regular(path), "rb") as f:  # a FIFO where a file was is refused, not waited on
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _field(value: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, Mapping) or name not in value or not isinstance(value[name], kind):
        raise MalformedEnvelope(f"{where}.{name} is missing or not a {getattr(kind, '__name__', kind)}",
                                actual=repr(value.get(name) if isinstance(value, Mapping) else value)[:80])
    return value[name]


def verify_attestation(data: bytes | str, trusted: Iterable[note.Verifier], *,
                       artifacts: ArtifactStore | None = None, store: Store | None = None) -> AttestationReport:
    """Check an exported attestation (ledger/transparency.py): the DSSE signature by a trusted key first (a failing
    signature rejects it whatever its subjects), then the statement, the receipt recomputing to its id, the
    subjects against the receipt (and the local bytes, where ``artifacts`` holds them), the receipt's signatures,
    the checkpoint's signature and the inclusion proof."""
    from ledger import dsse

    keys = [v for v in trusted if v.alg == note.ALG_ED25519]
    env = dsse.Envelope.from_json(data)
    public = {v.label: note.ed25519_public_key(v.public_key) for v in keys}
    if not public:
        raise UnknownKey("DSSE envelope", expected=[], actual=[s.keyid for s in env.signatures])
    # The signature first, as protocol.md orders it: nothing of a payload whose signature fails is looked at.
    signed_by = list(dsse.verify_envelope(env, public, payload_type=dsse.PAYLOAD_TYPE_IN_TOTO))
    stmt = dsse.parse_statement(env.payload)
    if stmt["predicateType"] != PREDICATE_TYPE:
        raise AttestationMismatch("not a receipt attestation", expected=PREDICATE_TYPE, actual=stmt["predicateType"])
    pred = _field(stmt, "predicate", dict, "statement")
    rid = _field(pred, "receipt_id", str, "predicate")
    body = digests.canonical_bytes(_field(pred, "receipt", dict, "predicate"))
    actual = digests.receipt_id(body)
    if actual != rid:
        raise DigestMismatch("attested receipt id does not recompute from the attested body", expected=rid,
                             actual=actual, receipt=rid, field="predicate.receipt")
    receipt = Receipt.from_bytes(body)
    subjects = {s["name"]: s["digest"] for s in stmt["subject"]}
    if len(subjects) != len(stmt["subject"]):
        raise AttestationMismatch("two subjects share a name", receipt=rid)
    want = {"sha256": hashlib.sha256(body).hexdigest(), "blake3": digests.digest_hex(digests.raw_digest(body))}
    if subjects.get(rid) != want:
        raise AttestationMismatch("the receipt's subject does not name its bytes", receipt=rid, expected=want,
                                  actual=subjects.get(rid))
    rehashed = []
    for name, digest in subjects.items():
        if name == rid:
            continue
        if name not in receipt.artifacts or digest.get("blake3") != digests.digest_hex(receipt.artifacts[name]):
            raise AttestationMismatch(f"subject {name!r} is not an artifact of the receipt", receipt=rid,
                                      expected=receipt.artifacts.get(name), actual=digest.get("blake3"))
        if set(digest) != {"sha256", "blake3"}:
            raise AttestationMismatch(f"subject {name!r} lacks sha256 or blake3", receipt=rid,
                                      expected=["blake3", "sha256"], actual=sorted(digest))
        if artifacts is not None:
            places = store.evidence_locations(rid, name, receipt.artifacts[name]) if store is not None else []
            path = next((p for p in artifacts.candidates(receipt.artifacts[name], places)
                         if p.is_file() and not p.is_symlink()), None)
            if path is not None:
                sha = _sha256_file(path)
                if sha != digest["sha256"] or digests.file_digest(path) != receipt.artifacts[name]:
                    raise DigestMismatch(f"subject {name!r} at {path}", expected=digest["sha256"], actual=sha,
                                         receipt=rid, field=f"subject.{name}")
                rehashed.append(name)
    by_label = {v.label: v for v in keys}
    sigs = []
    for i, s in enumerate(_field(pred, "signatures", list, "predicate")):
        key = _field(s, "key", str, f"predicate.signatures[{i}]")
        raw = _b64(_field(s, "sig", str, f"predicate.signatures[{i}]"), f"predicate.signatures[{i}].sig")
        batch = s.get("batch", [])
        if not (isinstance(batch, list) and all(digests.is_digest(b) for b in batch)):
            raise AttestationMismatch(f"predicate.signatures[{i}].batch is not a list of receipt ids", receipt=rid,
                                      actual=repr(batch)[:80])
        if key not in by_label:
            raise UnknownKey(f"receipt {rid}", expected=sorted(by_label), actual=[key])
        verify_receipt_signature(ReceiptSignature(rid, key, raw, tuple(batch)), by_label[key])
        sigs.append(LeafSignature(key, raw))
    log = _field(pred, "log", dict, "predicate")
    cp = open_head(_field(log, "checkpoint", str, "predicate.log"), keys).checkpoint
    index = _field(log, "leaf_index", int, "predicate.log")
    proof = [_b64(h, "predicate.log.inclusion_proof") for h in _field(log, "inclusion_proof", list, "predicate.log")]
    try:
        merkle.verify_inclusion(tlog.leaf_hash(rid, sigs), index, cp.size, proof, cp.root)
    except InclusionProofInvalid as exc:
        raise AttestationMismatch(f"the receipt is not included in the attested checkpoint: {exc.detail}",
                                  receipt=rid, expected=exc.expected, actual=exc.actual) from None
    if store is not None:  # the ledger at hand must be the attested log and extend the attested checkpoint
        verify_head(store, _field(log, "checkpoint", str, "predicate.log"), trusted=keys, receipts=[rid])
        # ... and says which keys were revoked: none may have signed the envelope or the receipt after that
        revoked = checked_revocations(store)
        _not_revoked_for(revoked, signed_by, cp.size, f"attestation of receipt {rid}", "which its checkpoint includes")
        for sig in sigs:
            r = revoked.get(sig.key)
            if r is not None and r.leaf_index < index:
                raise KeyRevoked(f"receipt {rid} (leaf {index})", sig.key, r, after="before the receipt it signs",
                                 receipt=rid, at=index)
    return AttestationReport(rid, receipt.kind, signed_by, sorted(subjects), rehashed, cp, index)
