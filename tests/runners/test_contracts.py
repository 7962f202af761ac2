"""The pre-registered quality contract tells a healthy run from a broken one.

At tiny scale (a 2-layer, 64-wide model, 160 steps, 128 held-out documents) the same experiment is trained twice
with the real launcher and evaluated with the real code: once healthy, once with DiLoCo's outer step sabotaged
(``train.diloco.outer_lr = 0``: every outer step puts the ranks back on the seed, so the primary arm ends exactly
where it started while single and DDP train normally). The healthy run passes every quality condition; the broken
one fails exactly the conditions a broken primary arm must fail.

A tiny model learns only a few held-out answers in a minute, so this experiment pre-registers thresholds for its
own scale (below); what is tested is that the contract discriminates, not the default experiment's figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ledger.artifacts import ArtifactStore, workdir_root
from ledger.experiment.config import ARMS, config_from_dict
from ledger.receipts import Receipt
from ledger.store import Store
from runners.evaluate import evaluate_experiment
from runners.prepare import pinned_threads, prepare
from runners.train import summarize_arm, train_arm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HEALTHY: dict[str, Any] = {
    "name": "contracts-tiny",
    "data": {"train_per_variant": 64, "eval_per_variant": 8, "retention_probes": 16},
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "max_len": 96},
    "pretrain": {"steps": 100, "batch_size": 16, "seq_len": 64, "task_documents": 256},
    "train": {"steps": 160, "global_batch": 16, "checkpoint_every": 80, "lr": 0.003, "warmup_steps": 8,
              "pretrain_mix": 0.25, "pretrain_window": 32, "diloco": {"inner_steps": 8}},
    "eval": {"max_new_tokens": 12, "batch_size": 32},
    # 128 documents: a gain of 4 is 0.031, five gained and none lost give p = 1/32; the intervals are wide.
    "contract": {"quality": {"minimum_accuracy_gain_vs_seed": 0.03, "maximum_one_sided_p_vs_seed": 0.05,
                             "paired_99pct_lower_vs_ddp_min": -0.2, "retention_99pct_upper_max": 0.5}},
}
SABOTAGED = {**HEALTHY, "train": {**HEALTHY["train"], "diloco": {"inner_steps": 8, "outer_lr": 0.0}}}


def run(root: Path, values: dict[str, Any]) -> tuple[Receipt, dict[str, Receipt]]:
    """Prepare, train the three arms, evaluate; the quality receipt and the eval receipts."""
    config = config_from_dict(values)
    root.mkdir(parents=True)
    db = root / "ledger.db"
    with Store.open(db, create=True) as store, pinned_threads(1):
        prepared = prepare(config, root, store).prepared
    for arm in ARMS:
        _, name = train_arm(root, str(db), arm, prepared=prepared, timeout=60.0)
        with Store.open(db) as store:
            summarize_arm(store, prepared, arm, name)
    with Store.open(db) as store:
        result = evaluate_experiment(store, ArtifactStore(workdir_root(root)), prepared=prepared)
    assert result.quality is not None
    return result.quality, result.evals


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Receipt, dict[str, Receipt]]]:
    root = tmp_path_factory.mktemp("contracts")
    return {"healthy": run(root / "healthy", HEALTHY), "sabotaged": run(root / "sabotaged", SABOTAGED)}


def _passed(quality: Receipt) -> dict[str, bool]:
    return {name: c["passed"] for name, c in quality.measurements["conditions"].items()}


def test_a_healthy_run_passes_every_quality_condition(runs: dict[str, Any]) -> None:
    quality, evals = runs["healthy"]
    assert quality.measurements["quality_contract_passed"] is True, quality.measurements["conditions"]
    assert all(_passed(quality).values())
    seed = evals["seed"].measurements["correct"]
    assert all(evals[arm].measurements["correct"] > seed for arm in ARMS)


def test_a_sabotaged_outer_step_fails_the_contract(runs: dict[str, Any]) -> None:
    quality, evals = runs["sabotaged"]
    assert quality.measurements["quality_contract_passed"] is False
    passed = _passed(quality)
    # the primary arm never left the seed: no gain at all, and nothing for a sign test to find
    assert passed["minimum_accuracy_gain_vs_seed"] is False and passed["maximum_one_sided_p_vs_seed"] is False
    conditions = quality.measurements["conditions"]
    assert conditions["minimum_accuracy_gain_vs_seed"]["figure"] == 0.0
    assert conditions["maximum_one_sided_p_vs_seed"]["figure"] == 1.0
    assert evals["diloco-four"].artifacts["model"] == evals["seed"].artifacts["model"]
    # the other arms trained as in the healthy run: same config but for the outer learning rate
    healthy = runs["healthy"][1]
    for arm in ("single", "ddp-four"):
        assert evals[arm].measurements["correct"] == healthy[arm].measurements["correct"]
