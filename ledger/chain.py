"""Applying the chain rules: a receipt against its parents, and a closed set of receipts in topological order.
Pure and I/O-free: the store (or anyone holding receipts) feeds receipts in and gets ``None`` or a
:class:`~ledger.errors.ChainBroken`. Each kind's rule is its row in ledger/kinds.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ledger.errors import ChainBroken
from ledger.kinds import spec
from ledger.receipts import Kind, Receipt
from ledger.rules import broken

Parents = Mapping[str, Receipt]




def check_receipt(receipt: Receipt, parents: Parents) -> None:
    """Check one receipt against its parents (every parent id must be a key of ``parents``)."""
    cited: list[Receipt] = []
    for pid in receipt.parents:
        parent = parents.get(pid)
        if parent is None:
            raise broken(receipt, f"parent {pid} is missing", field="parents", expected=pid, actual=None)
        if parent.id != pid:
            raise broken(receipt, f"parent {pid} recomputes to {parent.id}", field="parents",
                          expected=pid, actual=parent.id)
        cited.append(parent)
    if receipt.kind != Kind.PREPARE:
        for p in cited:
            if p.prepared != receipt.prepared:
                raise broken(receipt, f"parent {p.id} has another prepared digest", field="prepared",
                              expected=p.prepared, actual=receipt.prepared)
            if p.selection is not None and receipt.selection is not None and p.selection != receipt.selection:
                raise broken(receipt, f"parent {p.id} has another selection digest", field="selection",
                              expected=p.selection, actual=receipt.selection)
    spec(receipt.kind).rule(receipt, cited)


def topological(receipts: Iterable[Receipt]) -> list[Receipt]:
    """Order receipts so that every parent inside the set comes before its children (Kahn's algorithm)."""
    pending = {r.id: r for r in receipts}
    children: dict[str, list[str]] = {}
    waiting: dict[str, int] = {}
    for rid, r in pending.items():
        inside = [p for p in r.parents if p in pending]
        waiting[rid] = len(inside)
        for p in inside:
            children.setdefault(p, []).append(rid)
    ready = sorted(rid for rid, n in waiting.items() if n == 0)
    order: list[Receipt] = []
    while ready:
        rid = ready.pop()
        order.append(pending[rid])
        for child in children.get(rid, ()):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if len(order) != len(pending):  # impossible with content addressing; guard against forged input anyway
        raise ChainBroken(min(set(pending) - {r.id for r in order}), "receipts form a cycle")
    return order


def check_chain(receipts: Iterable[Receipt], known: Parents | None = None) -> int:
    """Check every receipt of a closed set (plus ``known`` receipts already checked); return how many."""
    table: dict[str, Receipt] = dict(known or {})
    ordered = topological(receipts)
    table.update((r.id, r) for r in ordered)
    for r in ordered:
        check_receipt(r, table)
    return len(ordered)
