"""`ledger verify` on eval, comparison and quality receipts (verify/evaluation.py), and re-scoring.

The experiment is real (tests/runners/test_evaluate.py builds it: prepare, three arms trained in-process, the eval
runner). Each test works on a copy of its ledger and artifacts and tampers as an operator could: rewriting an
outcomes file, or appending a forged but self-consistent eval receipt that only re-execution can catch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from ledger import digests
from ledger.artifacts import jsonl_bytes, read_jsonl
from ledger.cli import app
from ledger.errors import DigestMismatch, MissingArtifact, RecordInvalid, VerificationError
from ledger.experiment.tokenizer import CharTokenizer
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners.reexecute import TorchModelRunner
from tests.runners.test_evaluate import Experiment, build_experiment
from verify import evaluation as ev
from verify import statistics as st
from verify.receipts import verify_receipt

runner = CliRunner()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    return build_experiment(tmp_path_factory.mktemp("verify-experiment"))


@pytest.fixture
def exp(built: Experiment, tmp_path: Path) -> Experiment:
    """A private copy to tamper with."""
    return built.copy(tmp_path)


def verify(exp: Experiment, ref: str, **kwargs: Any) -> Any:
    with Store.open(exp.db) as store:
        return verify_receipt(store, ref, artifacts=exp.artifacts, **kwargs)


def verify_error(exp: Experiment, ref: str, **kwargs: Any) -> VerificationError:
    with pytest.raises(VerificationError) as info:
        verify(exp, ref, **kwargs)
    return info.value


def cli(exp: Experiment, *args: str) -> Result:
    return runner.invoke(app, ["verify", *args, "--db", str(exp.db)])


def rows_of(exp: Experiment, r: Receipt, name: str = "outcomes") -> list[dict[str, Any]]:
    return read_jsonl(exp.artifacts, r.artifacts[name])


def tokenizer(exp: Experiment) -> CharTokenizer:
    with Store.open(exp.db) as store:
        prep = store.find(kind="prepare")[-1].receipt
    return CharTokenizer.from_bytes(exp.artifacts.get_bytes(prep.artifacts["tokenizer"]) or b"")


def forge_eval(exp: Experiment, arm: str, rows: list[dict[str, Any]], retention: list[dict[str, Any]]) -> Receipt:
    """A new eval receipt over rewritten outcome files, with every measurement recomputed: statistically valid."""
    real = exp.evals[arm]
    arts = exp.artifacts
    forged = make_receipt(
        "eval", run=real.run, step=real.step, prepared=real.prepared, selection=real.selection,
        parents=real.parents,
        artifacts={**real.artifacts, "outcomes": arts.put_bytes(jsonl_bytes(rows)),
                   "retention": arts.put_bytes(jsonl_bytes(retention))},
        measurements=ev.eval_measurements(arm, rows, retention, real.measurements["settings"]))
    with Store.open(exp.db) as store:
        store.append(forged)
    return forged


def selection_documents(exp: Experiment) -> dict[str, dict[str, Any]]:
    with Store.open(exp.db) as store:
        selection = store.find(kind="selection")[-1].receipt
    return {d["document"]: d for d in read_jsonl(exp.artifacts, selection.artifacts["eval_selection"])}


def flip_to_right(exp: Experiment, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rewrite the first wrong outcome as a right one, consistently (tokens, text, digests, flags)."""
    tok = tokenizer(exp)
    docs = selection_documents(exp)
    out = [dict(r) for r in rows]
    i = next(i for i, r in enumerate(out) if not r["correct"])
    doc = docs[out[i]["document"]]
    answer = tok.encode(doc["answer"])
    out[i] = ev.outcome_row(doc, answer, True, tok.decode(answer), answer)
    assert out[i]["correct"] is True
    return out, doc


# --------------------------------------------------------------------------------------------- the happy path


def test_verify_recomputes_every_statistic_of_the_quality_receipt(built: Experiment) -> None:
    report = verify(built, built.quality.id, require_artifacts=False)
    text = "\n".join(report.checks)
    for arm in ("seed", "single", "ddp-four", "diloco-four"):
        assert f"{arm}: " in text
    for name in built.comparisons:
        assert f"{name}: every statistic recomputed" in text
    assert "quality" in report.checks[-1] and "every condition recomputed" in report.checks[-1]
    # every eval's model component is re-hashed in its checkpoint directory (its location is recorded)
    verified = {a.digest for a in report.artifacts if a.status == "verified"}
    assert {r.artifacts["model"] for r in built.evals.values()} <= verified
    assert {r.artifacts["outcomes"] for r in built.evals.values()} <= verified
    result = cli(built, built.quality.id, "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["checks"]) == len(report.checks)


def test_rescore_of_genuine_evals_passes(built: Experiment) -> None:
    with Store.open(built.db) as store:
        for r in built.evals.values():
            rep = ev.rescore(store, r, 5, seed=7, runner=TorchModelRunner(), artifacts=built.artifacts)
            assert len(rep.sampled) == 5 and rep.rescored >= 5 and rep.probes >= 5
            assert rep.max_nll_deviation == 0.0  # the same batches on the same machine: the same bits
    result = cli(built, built.comparisons[st.LOCAL_VS_BASELINE].id, "--rescore", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("rescored eval") == 2  # the comparison's two evals


def test_sample_is_seeded_and_bounded() -> None:
    assert ev.sample_indices(32, 5, 1) == ev.sample_indices(32, 5, 1)
    assert ev.sample_indices(32, 5, 1) != ev.sample_indices(32, 5, 2)
    assert ev.sample_indices(32, 100, 3) == list(range(32)) and ev.sample_indices(32, 0, 3) == []


# -------------------------------------------------------------------------------------------- tampering


def test_flipping_one_stored_outcome_fails_naming_the_document(exp: Experiment) -> None:
    r = exp.evals["single"]
    rows = rows_of(exp, r)
    victim = rows[5]
    rows[5] = {**victim, "correct": not victim["correct"]}
    path = exp.artifacts.path_for(r.artifacts["outcomes"])
    path.write_bytes(jsonl_bytes(rows))
    err = verify_error(exp, exp.quality.id)
    assert victim["document"] in str(err) and err.field == f"outcomes[{victim['document']}].correct"
    assert err.receipt == r.id
    result = cli(exp, r.id)
    assert result.exit_code == 1
    assert victim["document"] in result.stderr and "correct" in result.stderr


def test_a_consistent_rewrite_of_the_file_fails_on_its_digest(exp: Experiment) -> None:
    r = exp.evals["ddp-four"]
    rows, doc = flip_to_right(exp, rows_of(exp, r))
    exp.artifacts.path_for(r.artifacts["outcomes"]).write_bytes(jsonl_bytes(rows))
    with pytest.raises(DigestMismatch) as info:
        verify(exp, r.id)
    assert info.value.field == "artifacts.outcomes"


def test_rescoring_catches_a_forged_but_consistent_eval(exp: Experiment) -> None:
    rows, doc = flip_to_right(exp, rows_of(exp, exp.evals["seed"]))
    forged = forge_eval(exp, "seed", rows, rows_of(exp, exp.evals["seed"], "retention"))
    # Statistics recompute, the chain holds: only re-execution can tell.
    report = verify(exp, forged.id)
    assert any("correct and every breakdown recomputed" in line for line in report.checks)
    n = len(rows)
    with Store.open(exp.db) as store, pytest.raises(VerificationError) as info:
        ev.rescore(store, forged, n, seed=0, runner=TorchModelRunner(), artifacts=exp.artifacts)
    assert doc["document"] in str(info.value) and str(info.value.field).startswith(f"outcomes[{doc['document']}]")
    assert "CPU paths" not in str(info.value)  # recorded and re-run on the same paths: nothing to explain
    result = cli(exp, forged.id, "--rescore", str(n))
    assert result.exit_code == 1 and doc["document"] in result.stderr


def test_a_rescoring_mismatch_names_cpu_paths_other_than_the_recorded_ones(exp: Experiment) -> None:
    real = exp.evals["seed"]
    rows, doc = flip_to_right(exp, rows_of(exp, real))
    settings = {**real.measurements["settings"], "cpu": "AVX512 mkl=AUTO"}
    forged = make_receipt(
        "eval", run=real.run, step=real.step, prepared=real.prepared, selection=real.selection, parents=real.parents,
        artifacts={**real.artifacts, "outcomes": exp.artifacts.put_bytes(jsonl_bytes(rows)),
                   "retention": exp.artifacts.put_bytes(jsonl_bytes(rows_of(exp, real, "retention")))},
        measurements=ev.eval_measurements("seed", rows, rows_of(exp, real, "retention"), settings))
    with Store.open(exp.db) as store:
        store.append(forged)
        with pytest.raises(VerificationError) as info:
            ev.rescore(store, forged, len(rows), seed=0, runner=TorchModelRunner(), artifacts=exp.artifacts)
    here = real.measurements["settings"]["cpu"]
    assert doc["document"] in str(info.value)
    assert f"the evaluation ran on CPU paths AVX512 mkl=AUTO, this re-scoring on {here}" in str(info.value)


def test_rescoring_catches_a_forged_retention_loss(exp: Experiment) -> None:
    retention = rows_of(exp, exp.evals["single"], "retention")
    retention[3] = {**retention[3], "nll": retention[3]["nll"] * 0.9}
    forged = forge_eval(exp, "single", rows_of(exp, exp.evals["single"]), retention)
    verify(exp, forged.id)
    with Store.open(exp.db) as store, pytest.raises(VerificationError) as info:
        ev.rescore(store, forged, len(retention), seed=0, runner=TorchModelRunner(), artifacts=exp.artifacts)
    assert retention[3]["document"] in str(info.value) and str(info.value.field).endswith(".nll")


def _comparison_with(exp: Experiment, name: str, **changes: Any) -> Receipt:
    real = exp.comparisons[name]
    m = json.loads(json.dumps(dict(real.measurements)))
    for path, value in changes.items():
        target = m
        *head, last = path.split("__")
        for key in head:
            target = target[key]
        target[last] = value(target[last]) if callable(value) else value
    forged = make_receipt("comparison", run=real.run, prepared=real.prepared, selection=real.selection,
                          parents=real.parents, measurements=m)
    with Store.open(exp.db) as store:
        store.append(forged)
    return forged


@pytest.mark.parametrize("change,field", [
    ({"standard_error": lambda v: v * (1 + 1e-9)}, "measurements.standard_error"),
    ({"gained": lambda v: v + 1}, "measurements.gained"),
    ({"exact_one_sided_p": lambda v: v / 2}, "measurements.exact_one_sided_p"),
    ({"retention__mean_change": lambda v: v - 1e-3}, "measurements.retention.mean_change"),
    ({"interval_scope": "exact"}, "measurements.interval_scope"),
])
def test_a_comparison_figure_that_does_not_recompute_is_named(exp: Experiment, change: dict[str, Any],
                                                              field: str) -> None:
    forged = _comparison_with(exp, st.vs_seed("diloco-four"), **change)
    err = verify_error(exp, forged.id)
    assert err.field == field and err.receipt == forged.id


def test_a_quality_verdict_that_does_not_recompute_is_named(exp: Experiment) -> None:
    real = exp.quality
    m = json.loads(json.dumps(dict(real.measurements)))
    cond = m["conditions"]["minimum_accuracy_gain_vs_seed"]
    cond["passed"] = not cond["passed"]
    forged = make_receipt("quality", run=real.run, prepared=real.prepared, selection=real.selection,
                          parents=real.parents, measurements=m)
    with Store.open(exp.db) as store:
        store.append(forged)
    err = verify_error(exp, forged.id)
    assert err.field == "measurements.conditions.minimum_accuracy_gain_vs_seed.passed"


def test_a_quality_receipt_must_judge_the_right_comparisons(exp: Experiment) -> None:
    # Judge the contract against the seed-vs-seed-like pairing: local_vs_ddp replaced by single_vs_seed twice.
    real = exp.quality
    parents = [p for p in real.parents if p != exp.comparisons[st.LOCAL_VS_BASELINE].id]
    renamed = _comparison_with(exp, st.vs_seed("single"), comparison=st.LOCAL_VS_BASELINE)
    forged = make_receipt("quality", run=real.run, prepared=real.prepared, selection=real.selection,
                          parents=[*parents, renamed.id], measurements=dict(real.measurements))
    with Store.open(exp.db) as store:
        store.append(forged)
    err = verify_error(exp, forged.id)
    assert "named" in str(err) or str(err.field).startswith("measurements.")


def test_an_eval_must_cite_its_arms_model(exp: Experiment) -> None:
    real = exp.evals["single"]
    with Store.open(exp.db) as store:
        ddp_end = next(s.receipt for s in store.find(kind="train-end", run="train/ddp-four", rank=0))
        selection = store.find(kind="selection")[-1].receipt
        # The DDP model's outcomes, claimed as the single arm's: the chain rules hold (the model digest matches
        # the cited train-end), the arm does not.
        forged = make_receipt("eval", run=real.run, step=real.step, prepared=real.prepared, selection=real.selection,
                              parents=[selection.id, ddp_end.id], artifacts=dict(exp.evals["ddp-four"].artifacts),
                              measurements={**exp.evals["ddp-four"].measurements, "arm": "single"})
        store.append(forged)
    err = verify_error(exp, forged.id)
    assert err.field == "parents" and "'single'" in str(err)


def test_an_eval_of_an_unknown_format_fails_its_schema_and_cannot_be_compared(exp: Experiment) -> None:
    real = exp.evals["single"]
    m = {k: v for k, v in real.measurements.items() if k != "format"}
    other = make_receipt("eval", run=real.run, step=real.step, prepared=real.prepared, selection=real.selection,
                         parents=real.parents, artifacts=dict(real.artifacts), measurements=m)
    with Store.open(exp.db) as store:
        store.append(other)
    unknown = verify_error(exp, other.id)  # stripping the format must not skip the recomputation
    assert isinstance(unknown, RecordInvalid) and unknown.field == "measurements" and unknown.receipt == other.id
    base = exp.evals["seed"]
    cmp = make_receipt("comparison", run="compare/x", prepared=real.prepared, selection=real.selection,
                       parents=[base.id, other.id],
                       measurements={**exp.comparisons[st.vs_seed("single")].measurements,
                                     "candidate": {"arm": "single", "eval": other.id}})
    with Store.open(exp.db) as store:
        store.append(cmp)
    err = verify_error(exp, cmp.id)
    assert err.receipt == other.id


def test_a_malformed_record_is_a_failed_verification_not_a_crash(exp: Experiment) -> None:
    real = exp.evals["ddp-four"]
    bad = make_receipt("eval", run=real.run, step=real.step, prepared=real.prepared, selection=real.selection,
                       parents=real.parents, artifacts=dict(real.artifacts),
                       measurements={**real.measurements, "settings": "fast"})
    with Store.open(exp.db) as store:
        store.append(bad)
    err = verify_error(exp, bad.id)
    assert err.receipt == bad.id and isinstance(err, RecordInvalid) and err.field == "measurements.settings"
    assert (err.expected, err.actual) == ("object", "fast")
    result = cli(exp, bad.id)
    assert result.exit_code == 1 and result.stderr.startswith("ledger: error: ")


def test_missing_outcomes_are_listed_and_fail_only_when_required(exp: Experiment) -> None:
    r = exp.evals["diloco-four"]
    exp.artifacts.path_for(r.artifacts["outcomes"]).unlink()
    report = verify(exp, r.id)
    assert any("statistics not checked" in line for line in report.checks)
    assert r.artifacts["outcomes"] in {a.digest for a in report.missing}
    with pytest.raises(MissingArtifact):
        verify(exp, r.id, require_artifacts=True)
    assert cli(exp, r.id, "--require-artifacts").exit_code == 3


def test_outcome_row_definition() -> None:
    doc = {"document": digests.raw_digest(b"d"), "family": "sort", "variant": 1, "prompt": "sort: 3 1 -> ",
           "answer": "1 3"}
    row = ev.outcome_row(doc, [5, 6, 7], True, "1 3", [5, 6, 7])
    assert row["correct"] is True and row["prompt"] == ev.text_digest("sort: 3 1 -> ")
    assert row["output"] == digests.raw_digest(b"1 3")
    assert ev.outcome_row(doc, [5, 6, 7], False, "1 3", [5, 6, 7])["correct"] is False  # no EOS: not a match
    assert ev.batch_plan([3, 2, 3, 2, 3], 2) == [[1, 3], [0, 2], [4]]
