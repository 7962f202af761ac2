"""The eval runner on a real (tiny) experiment: prepare, three arms trained in-process, evaluation, receipts.

The arms are trained here for a few AdamW steps each (not by runners/train.py) and recorded with a real chain:
train-start -> checkpoint (a real checkpoint directory) -> train-end -> arm-summary. Everything else is the real
code path: the prepare step, greedy decoding, the receipts, the ledger and the CLI.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from ledger.artifacts import ArtifactStore, read_jsonl, workdir_root
from ledger.experiment.config import ARMS, ExperimentConfig, config_from_dict
from ledger.experiment.tasks import Document
from ledger.experiment.tokenizer import Tokenizer
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners.checkpoint import save_checkpoint
from runners.evaluate import evaluate_experiment, load_inputs, load_model, score, trained_arms
from runners.prepare import pinned_threads, prepare
from runners.rng import Rngs
from tests.conftest import schema_fill
from verify import statistics as st

TINY: dict[str, Any] = {
    "data": {"train_per_variant": 24, "eval_per_variant": 2, "retention_probes": 12},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 64},
    "pretrain": {"steps": 12, "batch_size": 4, "seq_len": 32, "task_documents": 24},
    "eval": {"max_new_tokens": 12, "batch_size": 8},
}
# Per arm: (steps, learning rate). The arms memorise the selection itself (a test of the evaluation machinery, not
# of learning): a few dozen steps give models that differ, so the comparisons have discordant pairs.
ARM_TRAINING = {"single": (80, 3e-3), "ddp-four": (50, 3e-3), "diloco-four": (40, 1e-2)}


@dataclass
class Experiment:
    workdir: Path
    db: Path
    config: ExperimentConfig
    prepared: str
    evals: dict[str, Receipt]
    comparisons: dict[str, Receipt]
    quality: Receipt

    @property
    def artifacts(self) -> ArtifactStore:
        return ArtifactStore(workdir_root(self.workdir))

    def copy(self, dest: Path) -> Experiment:
        """The same experiment in another directory (ledger and artifacts; checkpoints stay where recorded)."""
        shutil.copytree(self.workdir / "artifacts", dest / "artifacts")
        shutil.copy2(self.db, dest / "ledger.db")
        return Experiment(dest, dest / "ledger.db", self.config, self.prepared, self.evals, self.comparisons,
                          self.quality)


def train_arm_in_process(store: Store, workdir: Path, arm: str, steps: int, lr: float) -> Receipt:
    """A few AdamW steps from the seed on the selection's answers; a real checkpoint and a real receipt chain."""
    arts = ArtifactStore(workdir_root(workdir))
    inputs = load_inputs(store, arts)
    prep, cfg, tok = inputs.prepare, inputs.config, inputs.tokenizer
    seed_dir = Path(store.locations(prep.artifacts["seed_state"])[0])
    model = load_model(seed_dir, cfg, tok.vocab_size, state=prep.artifacts["seed_state"], model=prep.artifacts["model"])
    train = [Document.from_json(r) for r in inputs.documents]
    torch.manual_seed(list(ARMS).index(arm))
    rngs = Rngs.from_seed(cfg.seed, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        loss = _answer_loss(model, tok, [train[(step * 8 + i) % len(train)] for i in range(8)])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    run = f"train/{arm}"
    saved = save_checkpoint(workdir / "runs" / arm / f"step{steps:07d}", model=model, optimizer=optimizer, rngs=rngs,
                            cursor=steps, meta={"run": run, "arm": arm, "rank": 0, "world": 1, "step": steps})
    store.add_location(saved.digest, str(saved.path.resolve()))
    arts_of_state = {"state": saved.digest, "config": prep.artifacts["config"], **saved.manifest.components}
    start = make_receipt("train-start", run=run, rank=0, step=0, prepared=prep.prepared, parents=[prep],
                         artifacts={"config": prep.artifacts["config"], "model": prep.artifacts["model"]},
                         measurements=schema_fill("train-start"))
    ckpt = make_receipt("checkpoint", run=run, rank=0, step=steps, prepared=prep.prepared, parents=[start],
                        artifacts=arts_of_state, measurements=schema_fill("checkpoint", arm=arm))
    end = make_receipt("train-end", run=run, rank=0, step=steps, prepared=prep.prepared, parents=[ckpt],
                       artifacts=arts_of_state, measurements=schema_fill("train-end", arm=arm, world=1))
    summary = make_receipt("arm-summary", run=run, prepared=prep.prepared, parents=[end],
                           artifacts={"model": arts_of_state["model"]}, measurements={"arm": arm})
    store.append_many([start, ckpt, end, summary])
    return end


def _answer_loss(model: torch.nn.Module, tok: Tokenizer, docs: list[Document]) -> torch.Tensor:
    """Mean NLL of the answer and EOS tokens of a padded batch."""
    rows = [(tok.encode(d.prompt, bos=True), tok.encode(d.answer, eos=True)) for d in docs]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_id)
    mask = torch.zeros((len(rows), width - 1))
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
    logits = model(ids[:, :-1])
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * mask).sum() / mask.sum()


def build_experiment(root: Path) -> Experiment:
    """Prepare a tiny experiment, train the three arms in-process, evaluate everything."""
    config = config_from_dict(TINY)
    root.mkdir(parents=True, exist_ok=True)
    db = root / "ledger.db"
    with Store.open(db, create=True) as store, pinned_threads(1):
        result = prepare(config, root, store)
        for arm, (steps, lr) in ARM_TRAINING.items():
            train_arm_in_process(store, root, arm, steps, lr)
        ev = evaluate_experiment(store, ArtifactStore(workdir_root(root)))
    assert ev.quality is not None
    return Experiment(root, db, config, result.prepared, ev.evals, ev.comparisons, ev.quality)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    return build_experiment(tmp_path_factory.mktemp("eval-experiment"))


# ------------------------------------------------------------------------------------------------- tests


def test_every_model_is_evaluated_once_per_arm(experiment: Experiment) -> None:
    assert set(experiment.evals) == {"seed", *ARMS}
    with Store.open(experiment.db) as store:
        ends = trained_arms(store, experiment.prepared)
        prep = store.find(kind="prepare")[-1].receipt
    for arm, r in experiment.evals.items():
        source = prep if arm == "seed" else ends[arm]
        assert source.id in r.parents and r.artifacts["model"] == source.artifacts["model"]
        assert r.measurements["arm"] == arm and r.measurements["documents"] == 4 * 4 * 2
        assert r.measurements["settings"]["threads"] == 1
        assert r.measurements["settings"]["max_new_tokens"] == 12 and r.measurements["settings"]["batch_size"] == 8
    # four distinct models
    assert len({r.artifacts["model"] for r in experiment.evals.values()}) == 4


def test_outcome_rows_follow_the_selection_and_count_up(experiment: Experiment) -> None:
    arts = experiment.artifacts
    with Store.open(experiment.db) as store:
        inputs = load_inputs(store, arts)
    for r in experiment.evals.values():
        rows = read_jsonl(arts, r.artifacts["outcomes"])
        assert [row["document"] for row in rows] == [d["document"] for d in inputs.documents]
        for row, doc in zip(rows, inputs.documents, strict=True):
            assert row["correct"] == (row["stopped"] and row["output_text"] == doc["answer"])
        m = r.measurements
        assert m["correct"] == sum(row["correct"] for row in rows)
        for axis in ("family", "variant"):
            cells = m["breakdowns"][axis]
            assert sum(c["documents"] for c in cells.values()) == m["documents"]
            assert sum(c["correct"] for c in cells.values()) == m["correct"]
        assert set(m["breakdowns"]["family"]) == {"filter", "lookup", "sort", "total"}
        assert set(m["breakdowns"]["variant"]) == {"0", "1", "2", "3"}
        retention = read_jsonl(arts, r.artifacts["retention"])
        assert [x["document"] for x in retention] == [p["document"] for p in inputs.probes]
        assert all(isinstance(x["nll"], float) and x["nll"] > 0 for x in retention)
        assert m["retention"] == {"probes": 12, "mean_nll": st.exact_mean([x["nll"] for x in retention])}


def test_evaluating_again_appends_nothing_and_scoring_is_deterministic(experiment: Experiment,
                                                                       tmp_path: Path) -> None:
    exp = experiment.copy(tmp_path)
    with Store.open(exp.db) as store:
        before = store.count()
        again = evaluate_experiment(store, exp.artifacts)
        assert store.count() == before
        assert {a: r.id for a, r in again.evals.items()} == {a: r.id for a, r in exp.evals.items()}
        assert again.quality is not None and again.quality.id == exp.quality.id
        # Score the seed from scratch (no reuse): byte-identical outcome rows, thread count restored afterwards.
        inputs = load_inputs(store, exp.artifacts)
        prep = inputs.prepare
        seed_dir = Path(store.locations(prep.artifacts["seed_state"])[0])
    threads_before = torch.get_num_threads()
    model = load_model(seed_dir, inputs.config, inputs.tokenizer.vocab_size, state=prep.artifacts["seed_state"],
                       model=prep.artifacts["model"])
    with pinned_threads(1):  # as the runner does (and recorded in the receipt's settings)
        first = score(model, inputs.tokenizer, inputs.documents, inputs.probes, max_new_tokens=12, batch_size=8)
        second = score(model, inputs.tokenizer, inputs.documents, inputs.probes, max_new_tokens=12, batch_size=8)
    assert first.outcomes == second.outcomes and first.retention == second.retention
    assert first.outcomes == read_jsonl(exp.artifacts, exp.evals["seed"].artifacts["outcomes"])
    assert first.retention == read_jsonl(exp.artifacts, exp.evals["seed"].artifacts["retention"])
    assert torch.get_num_threads() == threads_before


def test_comparisons_have_exactly_the_reference_fields(experiment: Experiment) -> None:
    reference_file = Path(__file__).resolve().parents[3] / "shared" / "reference" / "report-1.7b-four-hosts.json"
    reference = json.loads(reference_file.read_text()) if reference_file.exists() else None
    names = {st.vs_seed(a) for a in ARMS} | {st.LOCAL_VS_BASELINE, st.LOCAL_VS_SINGLE}
    assert set(experiment.comparisons) == names
    meta = {"method", "comparison", "baseline", "candidate"}
    arts = experiment.artifacts
    for name, c in experiment.comparisons.items():
        m = c.measurements
        expected_keys = set(st.PAIRED_FIELDS) | meta | ({"retention"} if name.endswith("_vs_seed") else set())
        assert set(m) == expected_keys, name
        if reference is not None:
            ref = reference["learning"]["comparisons_to_seed"]["single"] if name.endswith("_vs_seed") \
                else reference["learning"][name]
            assert set(m) - meta == set(ref), name
        base = read_jsonl(arts, experiment.evals[m["baseline"]["arm"]].artifacts["outcomes"])
        cand = read_jsonl(arts, experiment.evals[m["candidate"]["arm"]].artifacts["outcomes"])
        # independent counting from the two outcome files
        gained = sum(1 for b, x in zip(base, cand, strict=True) if x["correct"] and not b["correct"])
        lost = sum(1 for b, x in zip(base, cand, strict=True) if b["correct"] and not x["correct"])
        assert (m["gained"], m["lost"], m["documents"]) == (gained, lost, len(base))
        assert m["accuracy_gain"] == (gained - lost) / len(base)
        assert set(c.parents) == {m["baseline"]["eval"], m["candidate"]["eval"]}
    assert experiment.comparisons[st.LOCAL_VS_BASELINE].measurements["baseline"]["arm"] == "ddp-four"
    assert experiment.comparisons[st.LOCAL_VS_SINGLE].measurements["candidate"]["arm"] == "diloco-four"
    ret = experiment.comparisons[st.vs_seed("single")].measurements["retention"]
    assert ret["documents"] == 12 and ret["improved"] + ret["worsened"] <= 12


def test_quality_receipt_records_each_condition_and_the_learning_section(experiment: Experiment) -> None:
    q = experiment.quality.measurements
    assert set(q["conditions"]) == set(st.CONDITIONS)
    thresholds = experiment.config.contract.quality
    for name, cond in q["conditions"].items():
        assert set(cond) == {"passed", "figure", "threshold", "rule"}
        assert cond["threshold"] == getattr(thresholds, name)
    gains = [experiment.comparisons[st.vs_seed(a)].measurements["accuracy_gain"] for a in ARMS]
    assert q["conditions"]["minimum_accuracy_gain_vs_seed"]["figure"] == min(gains)
    assert q["quality_contract_passed"] == all(c["passed"] for c in q["conditions"].values())
    learning = q["learning"]
    assert set(learning) == {"breakdowns", "comparisons_to_seed", "conditions", "local_vs_ddp",
                             "local_vs_single_descriptive", "prepared", "primary_arm", "quality_contract_passed",
                             "scope", "selection"}
    assert learning["prepared"] == experiment.prepared
    assert set(learning["breakdowns"]["family"]["sort"]) == {"seed", *ARMS, "documents"}
    assert set(learning["comparisons_to_seed"]) == set(ARMS)
    parents = set(experiment.quality.parents)
    assert {c.id for c in experiment.comparisons.values()} <= parents and len(parents) == 6


def test_run_eval_cli_and_show_render_tables(experiment: Experiment, tmp_path: Path) -> None:
    from ledger.cli import app

    exp = experiment.copy(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["run", "eval", "--workdir", str(exp.workdir), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["quality"]["receipt"] == exp.quality.id
    assert summary["evals"]["seed"]["receipt"] == exp.evals["seed"].id
    gained = exp.comparisons["single_vs_seed"].measurements["gained"]
    assert summary["comparisons"]["single_vs_seed"]["gained"] == gained > 0
    text = runner.invoke(app, ["run", "eval", "--workdir", str(exp.workdir)])
    assert text.exit_code == 0, text.output
    assert "local_vs_ddp" in text.stdout and "quality contract FAILED" in text.stdout
    bad = runner.invoke(app, ["run", "eval", "--workdir", str(tmp_path / "nothing-here")])
    assert bad.exit_code == 4 and "ledger: error:" in bad.stderr  # no ledger there
    for receipt, words in ((exp.evals["single"], ("family", "variant", "filter")),
                           (exp.comparisons[st.LOCAL_VS_BASELINE], ("exact_one_sided_p", "gained")),
                           (exp.quality, ("retention_99pct_upper_max", "threshold", "diloco-four"))):
        shown = runner.invoke(app, ["show", receipt.id, "--db", str(exp.db)])
        assert shown.exit_code == 0, shown.output
        for w in words:
            assert w in shown.stdout, (w, shown.stdout)
