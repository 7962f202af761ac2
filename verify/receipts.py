"""Verify a receipt and its whole ancestry from the database rows and the artifact bytes.

Ladder levels 1 and 2 (DESIGN.md): every receipt id recomputes from its stored body, every index row (kind, run,
parent edges, artifact digests...) agrees with the body, the chain rules hold, and every artifact whose bytes can
be found re-hashes to its digest. Raises a :class:`~ledger.errors.VerificationError` naming the first receipt
(oldest first) and field that fails; returns a :class:`VerifyReport` when everything holds.

A :class:`Verifier` verifies many receipts over one ledger (an audit verifies each receipt its report cites, and
their ancestries overlap) at the cost of their union: each stored row is re-hashed and parsed once, each receipt's
chain rule and kind checks run once, each artifact place is re-hashed once, each checkpoint state is read once and
the ledger is asked each question once. It remembers only what held, and the same receipts fail with the same
errors as one :func:`verify_receipt` each. :meth:`Verifier.verify_many` verifies a whole experiment's receipts (all
of an audit's) a batch of rows at a time, each receipt whose ancestry is verified checked alone: linear in the
number of receipts, not in the sum of their ancestries. :meth:`Verifier.prefetch` starts the one slow check (a report
page's rendering) on a worker process ahead of its turn; the check still runs in its turn, on its own inputs.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ledger import chain, digests
from ledger.artifacts import ArtifactStore, path_from_uri
from ledger.errors import (
    DigestMismatch,
    LedgerError,
    MissingArtifact,
    RecordInvalid,
    RecordMismatch,
    UnsafeFile,
    VerificationError,
)
from ledger.receipts import Receipt
from ledger.state import CheckpointState, StateCache, prefetch_states, recompute
from ledger.store import ArtifactRef, ParentEdge, RowBatch, Store, StoredRow
from verify.checks import run_checks, schema_alone
from verify.context import KindCheckContext, Memo, ModelRunner

ArtifactStatus = Literal["verified", "missing"]


@dataclass(frozen=True)
class ArtifactCheck:
    receipt: str
    name: str
    digest: str
    status: ArtifactStatus
    location: str | None = None


@dataclass
class VerifyReport:
    receipt: str
    receipts_checked: int
    artifacts: list[ArtifactCheck] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # one line per kind-specific check that held (statistics...)

    @property
    def missing(self) -> list[ArtifactCheck]:
        return [a for a in self.artifacts if a.status == "missing"]

    def to_json(self) -> dict[str, Any]:
        return {
            "receipt": self.receipt,
            "ok": True,
            "receipts_checked": self.receipts_checked,
            "artifacts_verified": sum(a.status == "verified" for a in self.artifacts),
            "artifacts_missing": [
                {"receipt": a.receipt, "name": a.name, "digest": a.digest, "location": a.location}
                for a in self.missing
            ],
            "checks": list(self.checks),
        }


_COLUMNS = ("kind", "run", "rank", "step", "prepared", "selection")
assert StoredRow._fields[2:8] == _COLUMNS


def _index_columns(row: StoredRow) -> tuple[Any, ...]:
    """The row's index columns (those of _COLUMNS), in that order."""
    return row[2:8]


def _index_rows(edges: Iterable[ParentEdge], arts: Iterable[ArtifactRef]
                ) -> tuple[dict[str, list[ParentEdge]], dict[str, list[ArtifactRef]]]:
    """Index rows read together: each child's parent edges, each receipt's artifact rows."""
    by_child: dict[str, list[ParentEdge]] = {}
    for e in edges:
        by_child.setdefault(e.child, []).append(e)
    by_receipt: dict[str, list[ArtifactRef]] = {}
    for a in arts:
        by_receipt.setdefault(a.receipt, []).append(a)
    return by_child, by_receipt


def check_row(row: StoredRow, edges: list[ParentEdge], arts: list[ArtifactRef]) -> Receipt:
    """Integrity of one stored receipt: its id, its body, and the index rows derived from the body."""
    # sqlite3's replace()/substr() on a BLOB store TEXT; hash whatever bytes the row holds, never crash on it
    rid, body = row.id, row.body_bytes()
    actual = digests.receipt_id(body)
    if actual != rid:
        raise DigestMismatch("receipt id does not recompute from the stored body", expected=rid,
                             actual=actual, receipt=rid, field="body")
    try:
        receipt = Receipt.from_bytes(body, keep_body=False)  # verification never reads it again
    except LedgerError as exc:  # only a forged row can get here: the id matched a non-receipt body
        raise RecordInvalid.at(f"receipt {rid}: body is not a valid receipt: {exc.one_line()}",
                               receipt=rid, field="body", expected="a receipt body", actual=exc.one_line()) from exc
    receipt.__dict__["id"] = actual  # the digest of its body, just computed: fills the cached_property
    columns = _index_columns(row)
    if columns != (receipt.kind, receipt.run, receipt.rank, receipt.step, receipt.prepared, receipt.selection):
        for name, stored in zip(_COLUMNS, columns, strict=True):
            if stored != getattr(receipt, name):
                raise RecordMismatch(rid, name, expected=getattr(receipt, name), actual=stored)
    stored_parents = [edges[0].parent] if len(edges) == 1 else sorted(e.parent for e in edges)
    if stored_parents != list(receipt.parents) and not _deleted_parents_only(stored_parents, receipt.parents):
        raise RecordMismatch(rid, "parents", expected=list(receipt.parents), actual=stored_parents)
    if not arts and not receipt.artifacts:  # most receipts cite none
        return receipt
    stored_arts = {a.name: a.digest for a in arts}
    if stored_arts == receipt.artifacts:
        return receipt
    for name in sorted(set(stored_arts) | set(receipt.artifacts)):
        if stored_arts.get(name) != receipt.artifacts.get(name):
            raise RecordMismatch(rid, f"artifacts.{name}", expected=receipt.artifacts.get(name),
                                 actual=stored_arts.get(name))
    return receipt


def check_rows(batch: RowBatch) -> int:
    """:func:`check_row` of every row of ``batch`` with its own edges and artifact rows; the number checked."""
    by_child, by_receipt = _index_rows(batch.edges, batch.artifacts)
    for row in batch.rows:
        check_row(row, by_child.get(row.id, []), by_receipt.get(row.id, []))
    return len(batch.rows)


def _deleted_parents_only(stored: list[str], named: tuple[str, ...]) -> bool:
    """The edges match the body except where an edge's parent row is gone (store.missing_parent). Whether the
    receipts the body names there are really absent (a broken chain) or stored elsewhere (a re-pointed edge) is
    decided by load_verified_closure, which can look them up."""
    resolved = [p for p in stored if digests.is_digest(p)]
    return len(resolved) < len(stored) == len(named) and set(resolved) <= set(named)


_RowKey = tuple[str, bytes, tuple[Any, ...], tuple[str, ...], tuple[tuple[str, str], ...]]


@dataclass
class _Known:
    """What a :class:`Verifier` has established: only what held (a failure raises and ends the verification)."""

    rows: dict[_RowKey, Receipt] = field(default_factory=dict)  # everything check_row reads -> its receipt
    receipts: dict[str, Receipt] = field(default_factory=dict)  # id -> receipt, rows checked (the chain rules' parents)
    seqs: dict[str, int] = field(default_factory=dict)  # id -> seq, for the same receipts
    prepares: dict[str, tuple[str, ...]] = field(default_factory=dict)  # id -> the prepares of its ancestry, by seq
    # (the prepares of an ancestry, a prepared digest) -> those of that digest: one tuple shared by most receipts
    same_digest: dict[tuple[tuple[str, ...], str | None], tuple[str, ...]] = field(default_factory=dict)
    chained: set[str] = field(default_factory=set)  # receipts whose chain rule held
    # (receipt, the prepare receipts of its digest in the closure) -> what its kind checks said. Checks read the
    # receipt's ancestry, and some look its prepare receipt up in the whole closure: with that in the key, a check
    # is reused only where it would read the same receipts.
    checked: dict[tuple[str, tuple[str, ...]], list[str]] = field(default_factory=dict)
    artifacts: dict[str, list[ArtifactCheck]] = field(default_factory=dict)  # receipt -> its artifacts' checks
    checkpoints: dict[Path, CheckpointState] = field(default_factory=dict)  # directory -> verified against manifest


def _checked_row(row: StoredRow, edges: list[ParentEdge], arts: list[ArtifactRef], known: _Known | None) -> Receipt:
    """:func:`check_row`, once per distinct stored row (id, body, index columns, edges and artifact rows)."""
    if known is None:
        return check_row(row, edges, arts)
    key = (row.id, row.body, _index_columns(row), tuple(sorted(e.parent for e in edges)),
           tuple(sorted((a.name, a.digest) for a in arts)))
    receipt = known.rows.get(key)
    if receipt is None:
        receipt = known.rows[key] = check_row(row, edges, arts)
    known.receipts[row.id] = receipt
    known.seqs[row.id] = row.seq
    return receipt


def load_verified_closure(store: Store, rid: str, *, known: _Known | None = None) -> dict[str, Receipt]:
    """Ancestry of ``rid`` with every row integrity-checked; follows the bodies' parents, not only the edges."""
    rows, edges, arts = store.raw_closure(rid)
    checked: dict[str, Receipt] = {}
    dangling: dict[str, list[str]] = {}  # child -> its stored parents, where one of them has no row
    while rows:
        by_child, by_receipt = _index_rows(edges, arts)
        for row in sorted(rows, key=lambda r: r.seq):
            mine = by_child.get(row.id, [])
            receipt = checked[row.id] = _checked_row(row, mine, by_receipt.get(row.id, []), known)
            stored_parents = sorted(e.parent for e in mine)
            if stored_parents != list(receipt.parents):  # check_row let it through: see _deleted_parents_only
                dangling[row.id] = stored_parents
        # Parents named by a body but absent from the edge closure (the edge rows were tampered with) are
        # caught by check_row; this fetches anything else still missing so the chain check sees it.
        wanted = {p for r in checked.values() for p in r.parents} - set(checked)
        rows, edges, arts = store.raw_rows(wanted) if wanted else ([], [], [])
        found = {r.id for r in rows}
        if wanted - found:
            child = next(r for r in checked.values() if set(r.parents) & (wanted - found))
            raise chain.ChainBroken(child.id, f"parent {sorted(wanted - found)[0]} is not in the ledger",
                                    field="parents")
    # An edge to a deleted row stood for a parent that turned out to be stored: the edge was re-pointed.
    for cid, stored_parents in dangling.items():
        named = list(checked[cid].parents)
        if (set(named) - set(stored_parents)) & checked.keys():
            raise RecordMismatch(cid, "parents", expected=named, actual=stored_parents)
    return checked


def verify_receipt(
    store: Store,
    ref: str,
    *,
    artifacts: ArtifactStore | None = None,
    require_artifacts: bool = False,
    progress: Callable[[str], None] | None = None,
    rescore: int = 0,
    rescore_seed: int | None = None,
    runner: ModelRunner | None = None,
) -> VerifyReport:
    """Verify the receipt ``ref`` (id or unique prefix) and every ancestor; see the module docstring.

    With ``artifacts``, each kind's checks (verify/checks.py) run on every receipt of the ancestry before the artifacts
    are re-hashed, so a tampered outcome is named by its document, not only by its file's digest; ``rescore`` > 0
    also re-executes a random sample (seeded by ``rescore_seed``, random when None) of each eval.
    """
    verifier = Verifier(store, artifacts, require_artifacts=require_artifacts, rescore=rescore,
                        rescore_seed=rescore_seed, runner=runner)
    return verifier.verify(ref, progress=progress)


class Verifier:
    """Verifies receipts of one ledger with one set of options, remembering what held (see the module docstring).

    ``verify(ref)`` checks exactly what :func:`verify_receipt` would and raises the same error; what an earlier call
    established (rows, chain rules, kind checks, artifact places, checkpoint states, ledger lookups) is not
    recomputed. The ledger and the artifacts must not change while a verifier is in use; the receipts appended
    meanwhile (by concurrent writers) are not in the ancestry of anything it verifies.
    """

    def __init__(self, store: Store, artifacts: ArtifactStore | None = None, *, require_artifacts: bool = False,
                 rescore: int = 0, rescore_seed: int | None = None, runner: ModelRunner | None = None) -> None:
        self.store = store
        self.artifacts = artifacts
        self.require_artifacts = require_artifacts
        self.rescore = rescore
        self.runner = runner
        self._seed = rescore_seed
        self._known = _Known()
        self._memo = Memo()
        self._states = StateCache()
        self._prefetched: set[str] = set()
        self._base: KindCheckContext | None = None  # see _context

    @property
    def rescore_seed(self) -> int:
        """The seed of the re-scoring samples: as given, else drawn once for this verifier."""
        if self._seed is None:
            import secrets

            self._seed = secrets.randbits(32)
        return self._seed

    def _context(self, receipt: Receipt, closure: dict[str, Receipt]) -> KindCheckContext:
        """The kind checks' context for ``receipt``: this verifier's ledger, artifacts and options, as they are at
        its first check (they are not changed afterwards), made once and copied per receipt."""
        if self._base is None:
            assert self.artifacts is not None  # kind checks run only with the artifacts (verify returns before)
            self._base = KindCheckContext(self.store, receipt, closure, self.artifacts, self.require_artifacts,
                                          self.rescore, self.rescore_seed, self.runner, self._memo)
            return self._base
        return self._base.for_receipt(receipt, closure)

    @property
    def chained(self) -> set[str]:
        """The receipts this verifier has verified (their rows, chain rules and checks held)."""
        return self._known.chained

    def prefetch(self, receipts: Iterable[Receipt], ancestry: Mapping[str, Receipt] | None = None) -> None:
        """Start the slow recomputation of these receipts' checks now, on a worker process, so that it is done by the
        time verification reaches them: the page of a format-1 ``report`` receipt (rendering it takes matplotlib
        about a second, verify/report_page.py; a format-2 page renders in-process in milliseconds). The receipts
        need not be verified yet (their parents are looked up in ``ancestry``, else in the ledger): the check
        computes its inputs again when it runs and uses a prefetched result only for exactly the same inputs."""
        if self.artifacts is None:
            return
        for r in receipts:
            if r.kind != "report" or r.id in self._prefetched:
                continue
            self._prefetched.add(r.id)
            for p in r.parents:
                try:
                    parent = ancestry[p] if ancestry is not None and p in ancestry else self.store.get(p).receipt
                except Exception:  # noqa: BLE001 - not verified yet: verification meets it in its turn
                    continue
                if parent.kind == "audit":
                    from verify.report_page import start_rendering  # imported only for a report receipt

                    start_rendering(self.store, self.artifacts, r, parent, self._memo)
                    break

    def verify(self, ref: str, *, progress: Callable[[str], None] | None = None) -> VerifyReport:
        """Verify the receipt ``ref`` (id or unique prefix) and every ancestor, as :func:`verify_receipt` does."""
        with _cycles_collected_after():
            return self._verify(ref, progress)

    def _verify(self, ref: str, progress: Callable[[str], None] | None) -> VerifyReport:
        known = self._known
        rid = self.store.resolve(ref)
        with self._states.active():  # each checkpoint state is read once, by whichever check needs it first
            closure = load_verified_closure(self.store, rid, known=known)
            self.prefetch((r for r in closure.values() if r.kind == "report" and r.id not in known.chained), closure)
            ordered = chain.topological(closure.values())
            for r in ordered:
                if r.id not in known.chained:
                    chain.check_receipt(r, closure)
                    known.chained.add(r.id)
                if r.id not in known.prepares:  # parents first: theirs are known
                    known.prepares[r.id] = _prepares(r, known)
            report = VerifyReport(receipt=rid, receipts_checked=len(ordered))
            if self.artifacts is None:
                return report
            prepares = [x for x in closure.values() if x.kind == "prepare"]
            for r in ordered:
                key = (r.id, tuple(x.id for x in prepares if x.prepared == r.prepared))
                lines = known.checked.get(key)
                if lines is None:
                    lines = known.checked[key] = run_checks(r, functools.partial(self._context, r, closure))
                report.checks.extend(lines)
            report.artifacts = check_artifacts(self.store, ordered, self.artifacts, progress=progress,
                                               _known=known, _memo=self._memo)
        if self.require_artifacts:
            _require_present(report.artifacts)
        return report

    def verify_many(self, ids: Iterable[str], *, progress: Callable[[str], None] | None = None) -> list[str]:
        """Verify each of the stored ``ids`` in turn, as :meth:`verify` would (the first failure raises), and return
        the lines of the kind checks that ran; receipts verified before are skipped.

        Made for many receipts (an audit verifies every receipt of an experiment): their rows are read a batch at a
        time, and a receipt whose parents are all verified is checked alone (row, chain rule, kind checks,
        artifacts), not through its whole ancestry again. Anything else (a parent not verified yet, edges that
        disagree with the body, an id that is not a digest) goes through :meth:`verify`."""
        known = self._known
        todo = [rid for rid in dict.fromkeys(ids) if rid not in known.chained]

        def read(batch: list[str]) -> RowBatch:  # when the batch is reached: ids verified by then are not read
            return self.store.raw_rows([rid for rid in batch if digests.is_digest(rid) and rid not in known.chained])

        chunks = (todo[start : start + _BATCH] for start in range(0, len(todo), _BATCH))
        return self._verify_batches(((batch, read(batch)) for batch in chunks), progress)

    def verify_experiment(self, prepared: str, *, progress: Callable[[str], None] | None = None) -> list[str]:
        """:meth:`verify_many` of every stored receipt with this prepared digest (the rows' column and ids, whatever
        their bodies say), read in append order as Store.experiment_rows reads them: one pass over the rows."""
        with closing(self.store.experiment_rows(prepared=prepared)) as read:  # closed on a failure too
            return self._verify_batches((([row.id for row in got.rows], got) for got in read), progress)

    def _verify_batches(self, batches: Iterable[tuple[list[str], RowBatch]],
                        progress: Callable[[str], None] | None) -> list[str]:
        """Each batch: the ids to verify, in order, and the rows read for them (a missing one is verify's to
        report)."""
        known = self._known
        lines: list[str] = []
        # A format-1 report page renders on a worker process (verify/report_page.py), started as its row is read;
        # report receipts are verified after every other one, so that the rest of the ledger is verified while such
        # a page renders instead of after. (A receipt citing a report verifies it on the way, as its ancestor.)
        pages: list[tuple[str, StoredRow | None, list[ParentEdge], list[ArtifactRef]]] = []

        def one(rid: str, row: StoredRow | None, edges: list[ParentEdge], arts: list[ArtifactRef]) -> None:
            if rid in known.chained:  # verified before, or meanwhile as an ancestor of an earlier one
                return
            if progress:
                progress(f"verifying {rid[:19]}")
            alone = self._alone(row, edges, arts) if row is not None else None
            lines.extend(self.verify(rid).checks if alone is None else alone)

        with _cycles_collected_after(), self._states.active():
            for batch, (rows, edges, arts) in batches:
                self.prefetch(_parsed_unverified(row) for row in rows if row.kind == "report")
                by_id = {row.id: row for row in rows}
                by_child, by_receipt = _index_rows(edges, arts)
                for rid in batch:
                    row = by_id.get(rid)
                    got = (rid, row, by_child.get(rid, []), by_receipt.get(rid, []))
                    if row is not None and row.kind == "report":
                        pages.append(got)
                    else:
                        one(*got)
            for got in pages:
                one(*got)
        return lines

    def _alone(self, row: StoredRow, edges: list[ParentEdge], arts: list[ArtifactRef]) -> list[str] | None:
        """Verify one stored receipt whose parents this verifier has all verified, as :meth:`verify` would (the
        rest of its ancestry held already); None, having checked nothing but its row, when that does not apply."""
        known = self._known
        receipt = check_row(row, edges, arts)  # a new row: no cache to look in, nor to fill (verify has its own)
        known.receipts[receipt.id] = receipt
        known.seqs[receipt.id] = row.seq
        # check_row matched the edges with the parents the body names, unless some edge's parent row is gone (its
        # marker is no receipt id, so never verified): every edge's parent verified means the body's are. A verifier
        # without artifacts records no artifact checks, for any receipt, so there it waits for none (waiting sent
        # every receipt after the first through verify and its whole ancestry: quadratic in a chain).
        artifacts_checked = known.artifacts if self.artifacts is not None else known.chained
        for e in edges:
            p = e.parent
            if p not in known.chained or p not in artifacts_checked or p not in known.prepares:
                return None
        chain.check_receipt(receipt, known.receipts)
        known.chained.add(receipt.id)
        prepares = known.prepares[receipt.id] = _prepares(receipt, known)
        if self.artifacts is None:
            return []

        def context() -> KindCheckContext:
            return self._context(receipt, _Ancestry(receipt, known))  # type: ignore[arg-type]

        if schema_alone(receipt.kind):  # its check reads the receipt alone: cheaper to run again than to key and keep
            lines = run_checks(receipt, context)
        else:  # a receipt is verified here only before it is chained, so before any check of it ran: none to reuse
            same = known.same_digest.get((prepares, receipt.prepared))
            if same is None:  # one tuple per (ancestry's prepares, digest): most receipts share it
                same = known.same_digest[(prepares, receipt.prepared)] = tuple(
                    x for x in prepares if known.receipts[x].prepared == receipt.prepared)
            lines = known.checked[(receipt.id, same)] = run_checks(receipt, context)
        if receipt.artifacts:
            found = check_artifacts(self.store, [receipt], self.artifacts, _known=known, _memo=self._memo)
            if self.require_artifacts:
                _require_present(found)
        else:
            known.artifacts[receipt.id] = []
        return lines


def _require_present(found: Iterable[ArtifactCheck]) -> None:
    """``--require-artifacts``: the first missing copy (in check order) fails the verification."""
    first = next((a for a in found if a.status == "missing"), None)
    if first is not None:
        raise MissingArtifact(first.digest, f"{first.name} of receipt {first.receipt}", first.location)


_BATCH = 2000  # rows read at a time by Verifier.verify_many


def _parsed_unverified(row: StoredRow) -> Receipt:
    """A row's receipt for :meth:`Verifier.prefetch`, before its row is checked; a body that does not parse is an
    ordinary note (prefetch skips it, and check_row reports it in its turn)."""
    try:
        return row.to_receipt()
    except Exception:  # noqa: BLE001 - check_row reports it in its turn
        return Receipt(kind="note")


@contextmanager
def _cycles_collected_after() -> Iterator[None]:
    """No cyclic garbage collection while verifying. A verification keeps what it established (receipts, digests:
    many long-lived objects) and makes few reference cycles; the collector's passes over the growing heap cost a
    sixth of an audit and half of verifying a receipt among 100,000 (benchmarks/README.md, audit_bench). Reference
    counting frees everything else as usual; cycles wait for the next collection after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            # What was made meanwhile goes to the oldest generation, where only the rare full collections look: left
            # young, the first allocation after gc.enable() traverses all of it (0.2 s after 100,000 receipts).
            # Not when the caller has frozen objects of its own: unfreezing would release those too.
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _prepares(r: Receipt, known: _Known) -> tuple[str, ...]:
    """The prepare receipts of ``r``'s ancestry (``r`` included), in append order, from its parents' (known)."""
    parents, prepares = r.parents, known.prepares
    if r.kind != "prepare" and parents:
        first = prepares[parents[0]]  # one parent, or parents of the same prepares: that tuple
        if len(parents) == 1 or all(prepares[p] == first for p in parents[1:]):
            return first
    found = {x for p in parents for x in prepares[p]}
    if r.kind == "prepare":
        found.add(r.id)
    return tuple(sorted(found, key=known.seqs.__getitem__))


class _Ancestry(Mapping[str, Receipt]):
    """A receipt's verified ancestry as its kind checks see it (``KindCheckContext.closure``), from what the
    verifier holds: its parents at once, the whole ancestry (in append order, as a loaded closure is) only when a
    check asks for more than a parent."""

    def __init__(self, receipt: Receipt, known: _Known) -> None:
        self._receipt = receipt
        self._known = known
        self._all: dict[str, Receipt] | None = None

    def _everything(self) -> dict[str, Receipt]:
        if self._all is None:
            seen = {self._receipt.id: self._receipt}
            todo = list(self._receipt.parents)
            while todo:
                pid = todo.pop()
                if pid not in seen:
                    seen[pid] = self._known.receipts[pid]
                    todo.extend(seen[pid].parents)
            self._all = {rid: seen[rid] for rid in sorted(seen, key=self._known.seqs.__getitem__)}
        return self._all

    def __getitem__(self, rid: str) -> Receipt:
        if rid == self._receipt.id:
            return self._receipt
        if rid in self._receipt.parents:
            return self._known.receipts[rid]
        return self._everything()[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._everything())

    def __len__(self) -> int:
        return len(self._everything())


def check_artifacts(
    store: Store,
    receipts: list[Receipt],
    artifacts: ArtifactStore,
    progress: Callable[[str], None] | None = None,
    *,
    _known: _Known | None = None,
    _memo: Memo | None = None,
) -> list[ArtifactCheck]:
    """Re-hash every copy of every cited artifact: its content-addressed path, every location recorded for its
    digest, and every location the citing receipt recorded for it (docs/receipts.md section 5.3).

    A copy whose bytes differ fails, named by its path, even when another copy is good; a recorded location that
    is gone is missing (one :class:`ArtifactCheck` per missing place). Each place is read once per call; a
    checkpoint directory answers for its state and for every component digest the same receipt names (optimizer,
    rng, outer, model), which have no locations of their own.
    """
    known = _known if _known is not None else _Known()
    memo = _memo if _memo is not None else Memo()
    done = memo.places  # (place, digest) already verified
    checkpoints = known.checkpoints  # directory -> recomputed CheckpointState
    found: dict[tuple[str, str], list[str]] = {}  # (receipt, name) -> places that verified
    gone: list[ArtifactCheck] = []
    state_dirs: dict[str, list[Path]] = {}  # receipt -> its verified state directories
    written_dirs: dict[str, list[Path]] = {}  # receipt -> those of them it recorded itself
    # Receipts whose artifacts an earlier call of the same Verifier checked keep their results: their places held.
    todo = [r for r in receipts if r.id not in known.artifacts]

    # The ledger is asked about every receipt and digest of this call at once, not one query each.
    asked = [r for r in todo if r.artifacts]
    by_receipt = store.receipt_locations_of([r.id for r in asked]) if len(asked) > 1 else {}
    by_digest = store.locations_of({d for r in asked for d in r.artifacts.values()}) if len(asked) > 1 else {}

    def locations(digest: str) -> list[str]:
        return memo.once(("locations", digest),
                         lambda: by_digest[digest] if digest in by_digest else store.locations(digest))

    def owners_of(path: str) -> list[str]:
        return memo.once(("location owners", path), lambda: store.location_owners(path))

    def recorded_by(rid: str) -> dict[str, list[str]]:
        return memo.once(("receipt locations", rid),
                         lambda: by_receipt[rid] if rid in by_receipt else store.receipt_locations(rid))

    def receipt_of(rid: str) -> Receipt:
        return memo.once(("receipt", rid), lambda: store.get(rid).receipt)

    own = {r.id: recorded_by(r.id) if r.artifacts else {} for r in todo}  # nothing to locate, nothing to ask
    # Two passes: first every receipt's own evidence (the content-addressed path and the places it recorded), then
    # the other recorded copies of each digest; so a bad copy is named by the receipt it belongs to.
    plan: list[tuple[bool, Receipt, str, str, list[tuple[Path, bool]]]] = []
    for own_pass in (True, False):
        for r in todo:
            # States first: a checkpoint directory's recomputation also answers for the components it names.
            for name, digest in sorted(r.artifacts.items(), key=lambda kv: (kv[0] not in _STATE_NAMES, kv[0])):
                mine = own[r.id].get(name, ())
                places = (_places(artifacts, digest, (), mine) if own_pass
                          else _places(artifacts, digest, locations(digest), ())[1:])
                plan.append((own_pass, r, name, digest, places))
    # Every checkpoint directory is hashed at once, ahead of the walk below (which meets any failure in its order).
    prefetch_states([path for *_, places in plan for path, _ in places
                     if path not in checkpoints and path.is_dir()], files=True)
    for own_pass, r, name, digest, places in plan:
        if progress and own_pass:
            progress(f"{name} {digest[:19]}")
        for path, recorded in places:
            if not os.path.lexists(path):
                if recorded:  # a place the ledger says holds the bytes, and it does not
                    gone.append(ArtifactCheck(r.id, name, digest, "missing", str(path)))
                continue
            if (path, digest) not in done:
                # Another receipt's copy (pass 2) fails in that receipt's name: it is its evidence.
                owners = [] if own_pass else owners_of(str(path))
                owner = r if not owners or r.id in owners else receipt_of(owners[0])
                _check_place(path, owner, name, digest, checkpoints)
                done.add((path, digest))
            found.setdefault((r.id, name), []).append(str(path))
            if name in _STATE_NAMES and path in checkpoints:
                state_dirs.setdefault(r.id, []).append(path)
                if own_pass and recorded:  # a directory the receipt itself recorded: its measurements.files
                    written_dirs.setdefault(r.id, []).append(path)
    for r in todo:
        _check_files(r, written_dirs.get(r.id, []), checkpoints)
        out: list[ArtifactCheck] = []
        for name, digest in sorted(r.artifacts.items()):
            verified_at = found.get((r.id, name), [])
            dirs = state_dirs.get(r.id, [])
            if not verified_at and name not in _STATE_NAMES and _component_of(r, name, digest, dirs, checkpoints):
                verified_at = [str(dirs[0])]
            missing = [g for g in gone if g.receipt == r.id and g.name == name]
            if verified_at:
                out.append(ArtifactCheck(r.id, name, digest, "verified", verified_at[0]))
            out.extend(missing or ([] if verified_at else [ArtifactCheck(r.id, name, digest, "missing", None)]))
        known.artifacts[r.id] = out
    return [check for r in receipts for check in known.artifacts[r.id]]


_STATE_NAMES = ("state", "seed_state")


def _places(artifacts: ArtifactStore, digest: str, by_digest: Iterable[str],
            by_receipt: Iterable[str]) -> list[tuple[Path, bool]]:
    """Every local place an artifact may be, each once: (path, whether the ledger recorded it). Relative
    locations are relative to the artifact root's parent, the ledger's directory."""
    out: dict[Path, bool] = {artifacts.path_for(digest): False}
    for uri in (*by_digest, *by_receipt):
        p = path_from_uri(uri)
        if p is None:
            continue
        if not p.is_absolute():
            p = artifacts.root.parent / p
        out[p] = True
    return list(out.items())


def _component_of(r: Receipt, name: str, digest: str, state_dirs: list[Path],
                  checkpoints: dict[Path, CheckpointState]) -> bool:
    """Whether ``digest`` (artifact ``name`` of ``r``) is a component of the verified state ``r`` names, in every
    copy of that state; raises naming the copy where it differs."""
    matched = False
    for path in state_dirs:
        state = checkpoints[path]
        if name not in state.components:
            return False
        actual = state.components[name].digest
        if actual != digest:
            raise DigestMismatch(f"component {name!r} of checkpoint {path}", expected=digest, actual=actual,
                                 receipt=r.id, field=f"artifacts.{name}")
        matched = True
    return matched


def _check_files(r: Receipt, dirs: list[Path], checkpoints: dict[Path, CheckpointState]) -> None:
    """A receipt naming its checkpoint's files (``measurements.files``: file name -> file digest, as the manifest
    it wrote) holds the same files, byte for byte, in every directory it recorded for its state: the state digest
    covers tensors and scalars only, so a file rewritten with the same state (other ``__metadata__``, re-sharded)
    and a manifest written again to match would otherwise pass."""
    claimed = r.measurements.get("files")
    if not isinstance(claimed, dict):
        return
    for path in dirs:
        actual = checkpoints[path].files or {}
        if actual == claimed:
            continue
        name = min(n for n in set(actual) | set(claimed) if actual.get(n) != claimed.get(n))
        raise DigestMismatch(f"file {name!r} of checkpoint {path}", expected=claimed.get(name, "absent"),
                             actual=actual.get(name, "absent"), receipt=r.id, field=f"measurements.files.{name}")


def _check_place(path: Path, r: Receipt, name: str, digest: str, checkpoints: dict[Path, CheckpointState]) -> None:
    if path.is_symlink():  # a recorded copy is the bytes at that place, never what a link points to (a file's or a
        # checkpoint directory's alike: a link could name anything, outside every recorded place)
        raise RecordInvalid.at(f"receipt {r.id}: artifact {name!r} at {path}: is a symbolic link, not a copy; "
                               "refusing to follow it", receipt=r.id, field=f"artifacts.{name}",
                               expected="a regular file or a checkpoint directory", actual="a symbolic link")
    if path.is_dir():
        _check_checkpoint(path, r, name, digest, checkpoints)
        return
    try:
        actual = recompute(path)
    except LedgerError as exc:  # not a regular file, unreadable...: this copy does not verify
        problem = exc.detail if isinstance(exc, UnsafeFile) and exc.path == str(path) else exc.one_line()
        raise RecordInvalid.at(f"receipt {r.id}: artifact {name!r} at {path}: {problem}", receipt=r.id,
                               field=f"artifacts.{name}", expected="a readable regular file",
                               actual=problem) from exc
    if actual != digest:
        raise DigestMismatch(f"artifact {name!r} at {path}", expected=digest, actual=actual,
                             receipt=r.id, field=f"artifacts.{name}")


def _check_checkpoint(path: Path, r: Receipt, name: str, digest: str,
                      checkpoints: dict[Path, CheckpointState]) -> None:
    """A checkpoint directory: recompute every digest against its manifest (once per directory), naming the
    tensor that fails, then compare the state or the named component with the receipt's digest."""
    from ledger.state import COMPONENTS, verify_checkpoint

    try:
        if path not in checkpoints:
            checkpoints[path] = verify_checkpoint(path, receipt=r.id)
    except VerificationError:
        raise
    except LedgerError as exc:  # unreadable, unsafe or incomplete: the artifact does not verify
        raise RecordInvalid.at(f"receipt {r.id}: artifact {name!r} at {path}: {exc.one_line()}", receipt=r.id,
                               field=f"artifacts.{name}", expected="a complete, safe checkpoint",
                               actual=exc.one_line()) from exc
    state = checkpoints[path]
    if name in COMPONENTS:  # e.g. artifacts["model"] located at the checkpoint directory
        actual = state.components[name].digest if name in state.components else "absent"
    else:
        actual = state.digest
    if actual != digest:
        what = f"component {name!r}" if name in COMPONENTS else "state digest"
        raise DigestMismatch(f"checkpoint {path}: {what}", expected=digest, actual=actual, receipt=r.id,
                             field=f"artifacts.{name}")
