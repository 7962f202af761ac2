"""Store.location_owners on SQLite and PostgreSQL: the receipts that recorded a place as their own evidence.

`ledger audit` and `ledger verify` of a checkpoint ask it (verify/receipts.py), so a query that one engine refuses
breaks the audit of a whole ledger on that engine (found by tests/runners/test_hosts.py's PostgreSQL run).
"""

from __future__ import annotations

from collections.abc import Callable

from ledger.store import Store
from tests.conftest import ReceiptChain


def test_location_owners_in_append_order(ledger_url: str, make_chain: Callable[..., ReceiptChain]) -> None:
    chain = make_chain()
    with Store.open(ledger_url) as store:
        store.append_many(chain.receipts())
        first, second = chain.checkpoints
        for receipt in (second, first, second):  # recorded out of order, and one twice
            store.add_receipt_locations(receipt.id, {"state": "/runs/a", "model": "/runs/a"})
        assert store.location_owners("/runs/a") == [first.id, second.id]  # once each, in append order
        assert store.location_owners("/runs/none") == []
