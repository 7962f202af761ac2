"""Training figures recomputed from receipts (verify.training): an arm's per-rank, max-rank and total figures, the
ratios between arms, and the arm-summary check on the session's tiny experiment."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledger.artifacts import ArtifactStore, default_root
from ledger.errors import MeasurementMismatch
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import TinyExperiment, fake_digest
from verify.receipts import verify_receipt
from verify.training import RANK_FIELDS, arm_figures, ratios


def train_end(rank: int, *, active: float, loop: float, sent: int) -> Receipt:
    m = {"update_seconds": active / 2, "synchronization_seconds": active / 2, "active_seconds": active,
         "checkpoint_seconds": 0.25, "loop_seconds": loop, "sent_bytes": sent,
         "interface_bytes": {"lo": {"rx": sent, "tx": sent}}, "tokens": 81, "binding": {"rank": rank}}
    return make_receipt("train-end", run="train/diloco-four", rank=rank, step=8, prepared=fake_digest("prepared"),
                        artifacts={"model": fake_digest(f"model/{rank}")}, measurements=m)


# ---------------------------------------------------------------------------------------- figures and ratios


def test_arm_figures_take_the_max_over_ranks_and_totals() -> None:
    ends = [train_end(2, active=1.5, loop=2.0, sent=300), train_end(0, active=1.0, loop=4.0, sent=100),
            train_end(1, active=0.5, loop=3.0, sent=200)]
    figures = arm_figures(ends)
    assert figures["world"] == 3
    assert [r["rank"] for r in figures["ranks"]] == [0, 1, 2]
    assert figures["ranks"][2] == {k: ends[0].measurements[k] for k in RANK_FIELDS} | {"rank": 2}  # no tokens, binding
    assert figures["max_rank_active_seconds"] == 1.5  # rank 2's
    assert figures["max_rank_loop_seconds"] == 4.0  # rank 0's
    assert figures["total_sent_bytes"] == 600
    assert figures["parameter_digest"] == fake_digest("model/0")  # rank 0's model, wherever it is listed
    assert set(figures) == {"world", "ranks", "max_rank_active_seconds", "max_rank_loop_seconds", "total_sent_bytes",
                            "parameter_digest"}


def test_ratios_against_the_baselines_given() -> None:
    primary = {"max_rank_active_seconds": 3.0, "max_rank_loop_seconds": 6.0, "total_sent_bytes": 50}
    ddp = {"max_rank_active_seconds": 1.5, "max_rank_loop_seconds": 1.0, "total_sent_bytes": 200}
    single = {"max_rank_active_seconds": 0.75, "max_rank_loop_seconds": 4.0, "total_sent_bytes": 0}
    vs_ddp = {"active_seconds_vs_ddp": 2.0, "sent_bytes_vs_ddp": 0.25}
    vs_single = {"active_seconds_vs_single": 4.0, "loop_seconds_vs_single": 1.5}
    assert ratios(primary, ddp, single) == vs_ddp | vs_single
    assert ratios(primary, ddp, None) == vs_ddp
    assert ratios(primary, None, single) == vs_single
    assert ratios(primary, None, None) == {}


# ---------------------------------------------------------------------------------- on the tiny experiment


def _summary(store: Store, arm: str) -> Receipt:
    return store.find(kind="arm-summary", run=f"train/{arm}")[-1].receipt


@pytest.mark.slow
@pytest.mark.distributed
def test_a_real_arm_summary_recomputes(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        summary = _summary(store, "diloco-four")
        ends = [s.receipt for s in store.find(kind="train-end", run=summary.run)]
        ddp, single = _summary(store, "ddp-four"), _summary(store, "single")
        assert {ddp.id, single.id} <= set(summary.parents)
        expected = arm_figures(ends) | {"ratios": ratios(summary.measurements, ddp.measurements, single.measurements)}
        assert {"arm": "diloco-four", **expected} == summary.measurements
        assert summary.measurements["ratios"]["sent_bytes_vs_ddp"] == 0.5  # one all-reduce per two steps
        report = verify_receipt(store, summary.id, artifacts=ArtifactStore(default_root(store.url)))
    for arm, world in (("single", 1), ("ddp-four", 4), ("diloco-four", 4)):
        assert f"arm {arm}: figures of {world} rank(s) and ratios recompute" in report.checks


def _scaled(key: str, factor: float) -> Callable[[dict[str, Any]], Any]:
    return lambda m: m.update({key: m[key] * factor})


EDITS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("world", lambda m: m.update(world=3)),
    ("ranks", lambda m: m["ranks"][2].update(sent_bytes=m["ranks"][2]["sent_bytes"] + 1)),
    ("max_rank_active_seconds", _scaled("max_rank_active_seconds", 0.5)),
    ("max_rank_loop_seconds", _scaled("max_rank_loop_seconds", 2.0)),
    ("total_sent_bytes", lambda m: m.update(total_sent_bytes=m["total_sent_bytes"] // 10)),
    ("parameter_digest", lambda m: m.update(parameter_digest=fake_digest("another model"))),
    ("ratios", lambda m: m["ratios"].update(sent_bytes_vs_ddp=0.05)),
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("field", "edit"), EDITS, ids=[f for f, _ in EDITS])
def test_a_changed_figure_is_named(tiny_experiment: TinyExperiment, tmp_path: Path, field: str,
                                   edit: Callable[[dict[str, Any]], Any]) -> None:
    exp = tiny_experiment.copy(tmp_path / "x")
    with Store.open(exp.db) as store:
        real = _summary(store, "diloco-four")
        measurements = copy.deepcopy(dict(real.measurements))
        edit(measurements)
        forged = store.append(make_receipt("arm-summary", run=real.run, prepared=real.prepared, parents=real.parents,
                                           artifacts=real.artifacts, measurements=measurements)).receipt
        with pytest.raises(MeasurementMismatch) as info:
            verify_receipt(store, forged.id, artifacts=ArtifactStore(default_root(store.url)))
    assert (info.value.receipt, info.value.field) == (forged.id, f"measurements.{field}")
    assert info.value.expected == real.measurements[field] and info.value.actual == measurements[field]
    assert "from the train-end receipts it cites" in str(info.value)
