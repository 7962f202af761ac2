"""verify/context.py: the kind checks' context."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ledger.artifacts import ArtifactStore
from ledger.errors import RecordInvalid
from ledger.receipts import make_receipt
from ledger.store import Store
from verify.context import KindCheckContext, Memo, guarded


def test_a_context_for_another_receipt_is_the_same_context_with_that_receipt(tmp_path: Path) -> None:
    with Store.open(tmp_path / "ledger.db", create=True) as store:
        first, second = make_receipt("note", measurements={"i": 1}), make_receipt("note", measurements={"i": 2})
        base = KindCheckContext(store, first, {first.id: first}, ArtifactStore(tmp_path / "a"), True, 3, 7, None,
                                Memo())
        other = base.for_receipt(second, {second.id: second})
        assert other == KindCheckContext(store, second, {second.id: second}, base.artifacts, True, 3, 7, None,
                                         base.memo)
        for f in dataclasses.fields(KindCheckContext):
            if f.name not in ("receipt", "closure"):
                assert getattr(other, f.name) is getattr(base, f.name), f.name
        assert (base.receipt, other.receipt) == (first, second)  # the base is left as it was
        with pytest.raises(dataclasses.FrozenInstanceError):
            other.receipt = first  # type: ignore[misc]


@pytest.mark.parametrize("failure", [KeyError("documents"), TypeError("'str' object is not subscriptable"),
                                     ZeroDivisionError("division by zero"),
                                     OverflowError("int too large to convert to float")])
def test_a_check_failing_on_a_malformed_record_fails_its_receipt(tmp_path: Path, failure: Exception) -> None:
    r = make_receipt("note", measurements={"documents": 0})

    def check(ctx: KindCheckContext) -> list[str]:
        raise failure

    with Store.open(tmp_path / "ledger.db", create=True) as store:
        ctx = KindCheckContext(store, r, {r.id: r}, ArtifactStore(tmp_path / "a"), True, 0, 0, None, Memo())
        with pytest.raises(RecordInvalid) as info:
            guarded(check)(ctx)
    assert info.value.receipt == r.id and type(failure).__name__ in info.value.one_line()
