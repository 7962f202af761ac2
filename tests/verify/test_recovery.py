"""Recovery recomputed from the ledger (verify.recovery): a rank's verdict, the first divergence it names, loss
trajectories, run-to-run comparison and the rank comparison check, on the session's tiny experiment (its
diloco-four arm was killed at rank 1 and recovered from the step-4 checkpoint as ``recover/diloco-four``)."""

from __future__ import annotations

from typing import Any

import pytest

from ledger.artifacts import ArtifactStore, default_root
from ledger.errors import InputError, LookupFailed, MeasurementMismatch, ResumeDivergence
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import TinyExperiment
from verify.context import KindCheckContext
from verify.receipts import load_verified_closure
from verify.recovery import (
    check_rank_comparison,
    check_recovery_summary,
    compare_rank,
    compare_runs,
    divergence,
    rank_passed,
    trajectory,
)

UNINTERRUPTED, RECOVERED = "train/diloco-four", "recover/diloco-four"
RESUME = 4  # the common checkpoint the recovered ranks restored

PASSED: dict[str, Any] = {
    "rank": 2, "uninterrupted_receipt": "blake3:" + "aa" * 32, "recovered_receipt": "blake3:" + "bb" * 32,
    "contents_exactly_equal": True, "file_hashes_equal": True, "binding_equal": True, "trajectory_equal": True,
    "first_trajectory_divergence": None, "first_state_difference": None,
}


# ----------------------------------------------------------------------------------- verdicts (no experiment)


@pytest.mark.parametrize("flag", ["contents_exactly_equal", "file_hashes_equal", "binding_equal", "trajectory_equal"])
def test_a_rank_passes_only_when_everything_is_equal(flag: str) -> None:
    assert rank_passed(PASSED)
    assert not rank_passed({**PASSED, flag: False})


def test_divergence_names_the_first_difference_in_order() -> None:
    failed: dict[str, Any] = {
        **PASSED, "contents_exactly_equal": False, "file_hashes_equal": False, "binding_equal": False,
        "trajectory_equal": False, "first_trajectory_divergence": 6,
        "first_state_difference": "model/head.weight: first difference at element 3 (F32)"}
    prefix = "rank 2: recovered run diverges from the uninterrupted run: "
    steps: list[tuple[dict[str, Any], str]] = [
        ({}, "loss at step 6"),  # the loss trajectory first,
        ({"first_trajectory_divergence": None}, failed["first_state_difference"]),  # then the state,
        ({"first_trajectory_divergence": None, "first_state_difference": None}, "rank binding differs"),
        ({"first_trajectory_divergence": None, "first_state_difference": None, "binding_equal": True},
         "file hashes differ"),  # then the files
    ]
    for edit, what in steps:
        error = divergence({**failed, **edit})
        assert isinstance(error, ResumeDivergence) and str(error) == prefix + what
        assert (error.receipt, error.field) == (PASSED["recovered_receipt"], "rank")
        assert (error.expected, error.actual) == (PASSED["uninterrupted_receipt"], PASSED["recovered_receipt"])


# --------------------------------------------------------------------------------- on the tiny experiment


def _end(store: Store, run: str, rank: int) -> Receipt:
    return store.find(kind="train-end", run=run, rank=rank)[-1].receipt


def _rank_comparisons(store: Store) -> dict[int, Receipt]:
    found = [s.receipt for s in store.find(kind="comparison", run=RECOVERED)]
    return {r.rank: r for r in found if r.rank is not None}


def _context(store: Store, receipt: Receipt, *cited: str) -> KindCheckContext:
    """What verify_receipt hands a check: ``receipt`` with the verified ancestry of ``cited`` (default: its own)."""
    closure: dict[str, Receipt] = {}
    for rid in cited or (receipt.id,):
        closure |= load_verified_closure(store, rid)
    return KindCheckContext(store, receipt, closure, ArtifactStore(default_root(store.url)), False)


@pytest.mark.slow
@pytest.mark.distributed
def test_trajectory_is_the_ranks_losses_after_a_step(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        for rank in range(4):
            end = _end(store, UNINTERRUPTED, rank)
            recorded = {int(step): loss for s in store.find(kind="checkpoint", run=UNINTERRUPTED, rank=rank)
                        for step, loss in s.receipt.measurements["losses"]}
            whole = trajectory(store, end, 0)
            assert list(whole) == list(range(1, 9)) and whole == recorded
            after = trajectory(store, end, RESUME)
            assert after == {s: loss for s, loss in whole.items() if s > RESUME}
            assert trajectory(store, _end(store, RECOVERED, rank), RESUME) == after  # what recovery claims
        rank0, rank1 = _end(store, UNINTERRUPTED, 0), _end(store, UNINTERRUPTED, 1)
        assert trajectory(store, rank0, 0) != trajectory(store, rank1, 0)  # each rank's own losses


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_runs_recomputes_the_recorded_recovery(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        rows = compare_runs(store, UNINTERRUPTED, RECOVERED)  # the resume step is read from the restore receipts
        recorded = _rank_comparisons(store)
        assert [r["rank"] for r in rows] == [0, 1, 2, 3]
        for row in rows:
            assert rank_passed(row) and row["resume_step"] == RESUME and row["trajectory_steps"] == 8 - RESUME
            assert row == {k: v for k, v in recorded[row["rank"]].measurements.items() if k != "seconds"}
        by_receipt = compare_runs(store, _end(store, UNINTERRUPTED, 2).id, _end(store, RECOVERED, 0).id)
        assert by_receipt == rows  # a train-end receipt stands for its run


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_runs_rejects_what_is_not_two_runs_of_one_world(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        with pytest.raises(InputError, match=r"the runs have different ranks: \[0\] vs \[0, 1, 2, 3\]"):
            compare_runs(store, "train/single", "train/ddp-four")
        with pytest.raises(LookupFailed, match="no train-end receipts for run 'train/absent'"):
            compare_runs(store, "train/absent", RECOVERED)
        checkpoint = store.find(kind="checkpoint", run=UNINTERRUPTED)[0].receipt
        with pytest.raises(InputError, match=f"receipt {checkpoint.id} is a checkpoint receipt"):
            compare_runs(store, checkpoint.id, RECOVERED)


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_runs_names_the_divergence_between_two_arms(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        rows = compare_runs(store, "train/ddp-four", UNINTERRUPTED)
        for row in rows:
            rank = row["rank"]
            ddp, diloco = _end(store, "train/ddp-four", rank), _end(store, UNINTERRUPTED, rank)
            assert row["resume_step"] == 0  # diloco-four never restored: the whole trajectory counts
            ua, ub = trajectory(store, ddp, 0), trajectory(store, diloco, 0)
            first = next(s for s in sorted(ua) if ua[s] != ub[s])
            assert row["first_trajectory_divergence"] == first and not row["trajectory_equal"]
            assert not row["contents_exactly_equal"] and not row["file_hashes_equal"] and not row["binding_equal"]
            assert row["first_state_difference"].startswith("model/")
            assert not rank_passed(row)
            error = divergence(row)
            assert str(error) == f"rank {rank}: recovered run diverges from the uninterrupted run: loss at step {first}"
            assert (error.expected, error.actual) == (ddp.id, diloco.id)


@pytest.mark.slow
@pytest.mark.distributed
def test_check_rank_comparison_recomputes_each_recorded_rank(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        for rank, r in _rank_comparisons(store).items():
            assert check_rank_comparison(_context(store, r)) == [
                f"recovery rank {rank}: state, files, RNG, binding and 4 losses after step {RESUME} equal the "
                "uninterrupted run"]
        summary = next(s.receipt for s in store.find(kind="comparison", run=RECOVERED) if s.receipt.rank is None)
        assert check_rank_comparison(_context(store, summary)) == []  # not a rank comparison: not this check's
        assert check_recovery_summary(_context(store, summary)) == [
            f"recovery: 4 rank comparison(s) passed after restoring step {RESUME}"]


# (the field edited, its value, the field named: a claimed resume step is where the recomputation starts from)
EDITS: list[tuple[str, Any, str]] = [
    ("trajectory_steps", 5, "trajectory_steps"),
    ("first_trajectory_divergence", 6, "first_trajectory_divergence"),
    ("contents_exactly_equal", False, "contents_exactly_equal"),
    ("binding", {"host": "elsewhere"}, "binding"),
    ("parameter_digest", "blake3:" + "00" * 32, "parameter_digest"),
    ("resume_step", RESUME - 1, "trajectory_steps"),
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("field", "value", "named"), EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_rank_comparison_names_the_field(tiny_experiment: TinyExperiment, field: str, value: Any,
                                                   named: str) -> None:
    with Store.open(tiny_experiment.db) as store:
        real = _rank_comparisons(store)[1]
        forged = make_receipt("comparison", run=real.run, rank=real.rank, prepared=real.prepared,
                              parents=real.parents, artifacts=real.artifacts,
                              measurements={**real.measurements, field: value})
        unint, recov = (store.get(real.measurements[k]).receipt for k in ("uninterrupted_receipt", "recovered_receipt"))
        again = compare_rank(store, unint, recov, forged.measurements["resume_step"])
        with pytest.raises(MeasurementMismatch) as info:
            check_rank_comparison(_context(store, forged, real.id))
    assert (info.value.receipt, info.value.field) == (forged.id, f"measurements.{named}")
    assert (info.value.expected, info.value.actual) == (again[named], forged.measurements[named])
    assert again[named] != forged.measurements[named]


@pytest.mark.slow
@pytest.mark.distributed
def test_an_honest_comparison_of_two_arms_fails_as_a_divergence(tiny_experiment: TinyExperiment) -> None:
    """A rank comparison whose figures are right but whose runs differ fails naming where they part."""
    with Store.open(tiny_experiment.db) as store:
        ddp, diloco = _end(store, "train/ddp-four", 0), _end(store, UNINTERRUPTED, 0)
        figures = compare_rank(store, ddp, diloco, 0)
        honest = make_receipt("comparison", run="compare/ddp-vs-diloco", rank=0, prepared=diloco.prepared,
                              parents=[ddp, diloco], measurements={**figures, "seconds": 0.0})
        with pytest.raises(ResumeDivergence, match=f"rank 0: .*loss at step {figures['first_trajectory_divergence']}"):
            check_rank_comparison(_context(store, honest, ddp.id, diloco.id))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_summary_claiming_a_failed_recovery_fails(tiny_experiment: TinyExperiment) -> None:
    with Store.open(tiny_experiment.db) as store:
        real = next(s.receipt for s in store.find(kind="comparison", run=RECOVERED) if s.receipt.rank is None)
        flag = "all_rank_state_and_trajectory_comparisons_passed"
        forged = make_receipt("comparison", run=real.run, prepared=real.prepared, parents=real.parents,
                              measurements={**real.measurements, flag: False})
        with pytest.raises(ResumeDivergence, match="not every rank's recovery comparison passed") as info:
            check_recovery_summary(_context(store, forged, real.id))
    assert (info.value.field, info.value.expected, info.value.actual) == (f"measurements.{flag}", True, False)
