"""The three training arms on real processes: single (world 1), ddp-four and diloco-four (4 gloo ranks each).

One tiny experiment is prepared per module; every arm trains twice under two run names in the same ledger, so
the tests can check that a rerun reproduces every digest bit for bit, that DDP ranks end identical, that DiLoCo
ranks agree exactly on outer-step boundaries and differ between them, that the sent bytes are exactly what the
gradient size predicts, and that every receipt verifies against the re-hashed artifacts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ledger import chain
from ledger.artifacts import ArtifactStore, workdir_root
from ledger.errors import ChainBroken, RunFailed
from ledger.experiment.config import ARMS, ExperimentConfig, config_from_dict
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners import numerics
from runners.arms import strategy_for
from runners.distributed import Comm, free_port
from runners.model import build_model
from runners.prepare import load_model_weights, load_prepared, pinned_threads, prepare
from runners.train import (
    documents_loss,
    encode_batch,
    lr_at,
    shard,
    step_indices,
    summarize_arm,
    train_arm,
    window_batch,
)
from tests.runners.test_numerics import pinned_binding
from verify.receipts import verify_receipt

H = 2  # DiLoCo inner steps
STEPS = 6
CHECKPOINT_EVERY = 3  # checkpoints at steps 3 (between outer steps) and 6 (an outer-step boundary)
TINY: dict[str, Any] = {
    "data": {"train_per_variant": 32, "eval_per_variant": 2, "retention_probes": 8},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 96},
    "pretrain": {"steps": 5, "batch_size": 4, "seq_len": 32, "task_documents": 16},
    "train": {"steps": STEPS, "global_batch": 8, "checkpoint_every": CHECKPOINT_EVERY, "warmup_steps": 2,
              "pretrain_mix": 0.5, "pretrain_window": 16, "diloco": {"inner_steps": H}},
}
RUNS = ("a", "b")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Arm:
    """One training run of one arm: its ranks' checkpoint and train-end receipts and its arm summary."""

    run: str
    ends: dict[int, Receipt]
    checkpoints: dict[tuple[int, int], Receipt]  # (rank, step) -> receipt
    summary: Receipt


@dataclass
class Experiment:
    workdir: Path
    db: Path
    config: ExperimentConfig
    prepared: str
    arms: dict[tuple[str, str], Arm] = field(default_factory=dict)  # (arm, run name) -> Arm
    torchrun: subprocess.CompletedProcess[str] | None = None  # the run ddp-four/b, launched by torchrun

    def store(self) -> Store:
        return Store.open(self.db)

    def n_params(self) -> int:
        with self.store() as store:
            prep = load_prepared(store, ArtifactStore(workdir_root(self.workdir)), self.prepared)
        model = build_model(self.config.model, prep.tokenizer.vocab_size, self.config.seed)
        return sum(p.numel() for p in model.parameters())


def _collect(store: Store, prepared: str, run: str, summary: Receipt) -> Arm:
    ends = {s.receipt.rank or 0: s.receipt for s in store.find(kind="train-end", run=run, prepared=prepared)}
    ckpts = {(s.receipt.rank or 0, s.receipt.step or 0): s.receipt
             for s in store.find(kind="checkpoint", run=run, prepared=prepared)}
    return Arm(run, ends, ckpts, summary)


def run_arm(exp: Experiment, arm: str, run: str, **kwargs: Any) -> Arm:
    try:
        _, name = train_arm(exp.workdir, str(exp.db), arm, run=run, timeout=60.0, **kwargs)
    except RunFailed as failed:  # show the ranks' last words, not only where their logs are
        pytest.fail(f"{failed}\n" + "\n".join(p.read_text()[-2000:] for p in sorted(Path(failed.logs).glob("*.log"))))
    with exp.store() as store:
        summary = summarize_arm(store, exp.prepared, arm, name)
        return _collect(store, exp.prepared, name, summary)


def torchrun_arm(exp: Experiment, arm: str, run: str) -> Arm:
    """``run`` of ``arm`` launched by torchrun on one node (its environment, not our launcher's), then summarized."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ARMS[arm].world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "runners.train", "--workdir", str(exp.workdir), "--db", str(exp.db), "--arm", arm, "--run-name", run]
    exp.torchrun = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                                  text=True, timeout=300)
    assert exp.torchrun.returncode == 0, exp.torchrun.stderr[-3000:]
    with exp.store() as store:
        return _collect(store, exp.prepared, run, summarize_arm(store, exp.prepared, arm, run))


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Experiment]:
    """A tiny prepared experiment with each arm trained twice (runs ``<arm>/a`` and ``<arm>/b``)."""
    root = tmp_path_factory.mktemp("train-arms")
    config = config_from_dict(TINY)
    db = root / "ledger.db"
    with Store.open(db, create=True) as store, pinned_threads(1):
        prepared = prepare(config, root, store).prepared
    exp = Experiment(root, db, config, prepared)
    for arm in ARMS:  # single and DDP first, so DiLoCo's summary has ratios against both
        for run in RUNS:
            # DDP's rerun is launched by torchrun instead of our launcher: the rerun test then also proves that the
            # two launchers' environments train to the same bits, without a third 4-rank run.
            launch = torchrun_arm if (arm, run) == ("ddp-four", "b") else run_arm
            exp.arms[arm, run] = launch(exp, arm, f"{arm}/{run}")
    yield exp


pytestmark = [pytest.mark.slow, pytest.mark.distributed]


# ------------------------------------------------------------------------------------------- receipts


@pytest.mark.parametrize("arm", list(ARMS))
def test_every_receipt_verifies_with_its_artifacts(experiment: Experiment, arm: str) -> None:
    a = experiment.arms[arm, "a"]
    world = ARMS[arm].world
    assert sorted(a.ends) == list(range(world))
    assert sorted(a.checkpoints) == [(r, s) for r in range(world) for s in (CHECKPOINT_EVERY, STEPS)]
    artifacts = ArtifactStore(workdir_root(experiment.workdir))
    with experiment.store() as store:
        report = verify_receipt(store, a.summary.id, artifacts=artifacts, require_artifacts=True)
        assert report.missing == []
        # The summary's ancestry: prepare, contract, per rank train-start + 2 checkpoints + train-end, summary;
        # DiLoCo's and DDP's summaries also cite the summaries of the arms trained before them.
        assert report.receipts_checked >= 2 + world * 4 + 1
        verified = {(c.receipt, c.name) for c in report.artifacts if c.status == "verified"}
        for r in [*a.checkpoints.values(), *a.ends.values()]:
            for name in ("state", "model", "optimizer", "rng", "config"):
                assert (r.id, name) in verified, (r.kind, r.rank, r.step, name)
            assert ((r.id, "outer") in verified) == (arm == "diloco-four")  # only DiLoCo has an outer state
        for r in [*a.checkpoints.values(), *a.ends.values()]:  # each verifies on its own too
            assert verify_receipt(store, r.id, artifacts=artifacts, require_artifacts=True).missing == []
    assert any("figures" in line for line in report.checks)  # the arm summary's figures were recomputed


def test_train_start_binds_the_rank_identity(experiment: Experiment) -> None:
    with experiment.store() as store:
        for arm in ARMS:
            run = experiment.arms[arm, "a"].run
            starts = {s.receipt.rank or 0: s.receipt for s in store.find(kind="train-start", run=run)}
            assert sorted(starts) == list(range(ARMS[arm].world))
            for rank, r in starts.items():
                b = r.measurements["binding"]
                assert (b["run"], b["arm"], b["rank"], b["world"], b["threads"]) == (run, arm, rank, ARMS[arm].world, 1)
                assert b["backend"] == ("gloo" if ARMS[arm].world > 1 else "none") and b["device"] == "cpu"
                # The CPU code paths the rank pinned before torch computed (runners/numerics.py).
                # Unpinned, MKL runs without CNR (or there is no MKL) and the binding says so.
                unpinned = b["cpu"].endswith((" mkl=OFF", " mkl=none"))
                assert (b["cpu"] == pinned_binding()) if numerics.can_pin() else unpinned
                assert r.prepared == experiment.prepared


# ------------------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("arm", list(ARMS))
def test_rerun_reproduces_every_digest_and_loss(experiment: Experiment, arm: str) -> None:
    a, b = experiment.arms[arm, "a"], experiment.arms[arm, "b"]
    assert a.run != b.run
    for rank in range(ARMS[arm].world):
        ea, eb = a.ends[rank], b.ends[rank]
        assert ea.id != eb.id  # different runs, different receipts...
        assert ea.artifacts == eb.artifacts  # ...and the same state, model, optimizer, outer and RNG digests
    assert a.checkpoints.keys() == b.checkpoints.keys()
    for key in a.checkpoints:
        ca, cb = a.checkpoints[key], b.checkpoints[key]
        assert ca.artifacts == cb.artifacts
        assert ca.measurements["losses"] == cb.measurements["losses"]  # exact float values, step by step
        assert ca.measurements["sent_bytes"] == cb.measurements["sent_bytes"]
    steps = [s for rank_step in sorted(a.checkpoints) if rank_step[0] == 0
             for s, _ in a.checkpoints[rank_step].measurements["losses"]]
    assert steps == list(range(1, STEPS + 1))  # every step's loss is recorded once, in order
    assert a.summary.artifacts == b.summary.artifacts


def test_torchrun_launches_the_same_worker_to_the_same_digests(experiment: Experiment) -> None:
    """``torchrun`` (torch.distributed.run) sets the environment our launcher sets: ddp-four/b was launched by it
    (the fixture), and its ranks end bit-identical to ddp-four/a's (test_rerun_reproduces_every_digest_and_loss
    compares every checkpoint)."""
    done = experiment.torchrun
    assert done is not None
    # Every rank prints its end line (the ranks share torchrun's stdout, so lines may interleave).
    assert done.stdout.count('"recorded": true') == 4, done.stdout
    a, b = experiment.arms["ddp-four", "a"], experiment.arms["ddp-four", "b"]
    assert sorted(b.ends) == [0, 1, 2, 3]
    for rank, end in b.ends.items():
        assert end.artifacts == a.ends[rank].artifacts
        assert end.measurements["sent_bytes"] == a.ends[rank].measurements["sent_bytes"]


# ----------------------------------------------------------------------------------------- DDP and DiLoCo


def test_ddp_ranks_end_identical_and_a_forged_summary_is_refused(experiment: Experiment) -> None:
    a = experiment.arms["ddp-four", "a"]
    assert len({e.artifacts["model"] for e in a.ends.values()}) == 1
    for step in (CHECKPOINT_EVERY, STEPS):  # identical after every step, not only at the end
        assert len({a.checkpoints[r, step].artifacts["model"] for r in range(4)}) == 1
    assert a.summary.artifacts["model"] == a.ends[0].artifacts["model"]
    # The optimizer state is per rank but must agree too: the ranks applied the same averaged gradients.
    assert len({e.artifacts["optimizer"] for e in a.ends.values()}) == 1

    # Forge rank 3's train-end with another model (DiLoCo's between outer steps) and summarise over it.
    other_model = experiment.arms["diloco-four", "a"].checkpoints[3, CHECKPOINT_EVERY].artifacts["model"]
    last3 = a.checkpoints[3, STEPS]
    forged_end = make_receipt("train-end", run=a.run, rank=3, step=STEPS, prepared=experiment.prepared,
                              parents=[last3], artifacts={**last3.artifacts, "model": other_model},
                              measurements=dict(a.ends[3].measurements))
    ends = [a.ends[0], a.ends[1], a.ends[2], forged_end]
    forged = make_receipt("arm-summary", run=a.run, prepared=experiment.prepared, parents=ends,
                          artifacts={"model": a.ends[0].artifacts["model"]},
                          measurements={"arm": "ddp-four", "world": 4})
    known = {r.id: r for r in ends}
    with pytest.raises(ChainBroken) as err:
        chain.check_receipt(forged, known)
    assert "different model digests" in str(err.value)
    with experiment.store() as store:
        before = store.count()
        with pytest.raises(ChainBroken):
            store.append_many([forged_end, forged])
        assert store.count() == before and not store.contains(forged.id)
    # The same summary over the true train-ends passes the rule.
    honest = make_receipt("arm-summary", run=a.run, prepared=experiment.prepared, parents=list(a.ends.values()),
                          artifacts={"model": a.ends[0].artifacts["model"]},
                          measurements={"arm": "ddp-four", "world": 4})
    chain.check_receipt(honest, {r.id: r for r in a.ends.values()})


def test_diloco_ranks_agree_on_outer_steps_and_differ_between(experiment: Experiment) -> None:
    a = experiment.arms["diloco-four", "a"]
    for step in (CHECKPOINT_EVERY, STEPS):
        models = {a.checkpoints[r, step].artifacts["model"] for r in range(4)}
        outers = {a.checkpoints[r, step].artifacts["outer"] for r in range(4)}
        assert len(outers) == 1  # the outer copy and momentum only change in the (shared) outer step
        if step % H == 0:
            assert len(models) == 1, f"ranks differ at outer-step boundary {step}"
        else:
            assert len(models) == 4, f"ranks agree at step {step}, between outer steps"
        assert all(a.checkpoints[r, step].measurements["outer_steps"] == step // H for r in range(4))
    assert len({e.artifacts["model"] for e in a.ends.values()}) == 1
    assert len({e.artifacts["optimizer"] for e in a.ends.values()}) == 4  # inner AdamW moments stay local


# ------------------------------------------------------------------------------------------------ bytes


def test_sent_bytes_are_exactly_what_the_gradient_size_predicts(experiment: Experiment) -> None:
    n = experiment.n_params()
    single = experiment.arms["single", "a"].summary.measurements
    ddp = experiment.arms["ddp-four", "a"].summary.measurements
    dil = experiment.arms["diloco-four", "a"].summary.measurements
    assert single["total_sent_bytes"] == 0
    assert ddp["total_sent_bytes"] == STEPS * 4 * n * 4  # one float32 gradient all-reduce per step per rank
    assert dil["total_sent_bytes"] == (STEPS // H) * 4 * n * 4  # one pseudo-gradient all-reduce per outer step
    assert dil["total_sent_bytes"] / ddp["total_sent_bytes"] == 1 / H
    assert dil["ratios"]["sent_bytes_vs_ddp"] == 1 / H
    for e in experiment.arms["ddp-four", "a"].ends.values():
        m = e.measurements
        assert m["sent_bytes_by_op"] == {"gradient": STEPS * n * 4} and m["collective_calls"] == STEPS
    for e in experiment.arms["diloco-four", "a"].ends.values():
        m = e.measurements
        assert m["sent_bytes_by_op"] == {"pseudo_gradient": (STEPS // H) * n * 4}
        assert m["collective_calls"] == STEPS // H
    # A checkpoint records the bytes sent so far: half way, half the bytes.
    ck = experiment.arms["ddp-four", "a"].checkpoints[0, CHECKPOINT_EVERY]
    assert ck.measurements["sent_bytes"] == CHECKPOINT_EVERY * n * 4
    # Each arm's strategy says what it sends; every rank sent exactly that.
    for arm in ARMS:
        with experiment.store() as store:
            prep = load_prepared(store, ArtifactStore(workdir_root(experiment.workdir)), experiment.prepared)
        model = build_model(experiment.config.model, prep.tokenizer.vocab_size, experiment.config.seed)
        strategy = strategy_for(ARMS[arm], model, experiment.config.train, Comm(ARMS[arm].world))
        a = experiment.arms[arm, "a"]
        for rank, end in a.ends.items():
            assert end.measurements["sent_bytes"] == strategy.planned_sent_bytes(1, STEPS)
            assert a.checkpoints[rank, CHECKPOINT_EVERY].measurements["sent_bytes"] == strategy.planned_sent_bytes(
                1, CHECKPOINT_EVERY)


# ---------------------------------------------------------------------------------------------- figures


@pytest.mark.parametrize("arm", list(ARMS))
def test_per_rank_figures_are_present_and_consistent(experiment: Experiment, arm: str) -> None:
    m = experiment.arms[arm, "a"].summary.measurements
    assert m["world"] == ARMS[arm].world and [r["rank"] for r in m["ranks"]] == list(range(ARMS[arm].world))
    for r in m["ranks"]:
        assert r["active_seconds"] == r["update_seconds"] + r["synchronization_seconds"]
        assert r["update_seconds"] > 0 and r["checkpoint_seconds"] > 0
        assert r["loop_seconds"] >= r["active_seconds"]
        assert r["loop_seconds"] >= r["active_seconds"] + r["checkpoint_seconds"] * 0.99
        assert (r["synchronization_seconds"] > 0) == (arm != "single")
        assert isinstance(r["interface_bytes"], dict) and "lo" in r["interface_bytes"]
        assert all(set(c) == {"rx", "tx"} for c in r["interface_bytes"].values())
        if arm != "single":  # the gloo traffic went over loopback: at least the payload this rank sent
            assert r["interface_bytes"]["lo"]["tx"] >= r["sent_bytes"]
    assert m["max_rank_active_seconds"] == max(r["active_seconds"] for r in m["ranks"])
    assert m["max_rank_loop_seconds"] == max(r["loop_seconds"] for r in m["ranks"])
    assert m["total_sent_bytes"] == sum(r["sent_bytes"] for r in m["ranks"])
    expected_ratios = {"single": set(), "ddp-four": {"active_seconds_vs_single", "loop_seconds_vs_single"},
                       "diloco-four": {"active_seconds_vs_ddp", "sent_bytes_vs_ddp", "active_seconds_vs_single",
                                       "loop_seconds_vs_single"}}[arm]
    assert set(m["ratios"]) == expected_ratios
    end0 = experiment.arms[arm, "a"].ends[0].measurements
    assert end0["steps"] == STEPS and end0["start_step"] == 0 and end0["tokens"] > 0


def test_pretraining_windows_are_a_function_of_the_step_split_by_rank(experiment: Experiment) -> None:
    with experiment.store() as store:
        prep = load_prepared(store, ArtifactStore(workdir_root(experiment.workdir)), experiment.prepared)
    cfg = prep.config
    stream = torch.tensor(prep.stream().ids)
    for step in (1, 2, STEPS):
        whole = window_batch(stream, cfg, step, 0, 1)
        assert whole is not None and whole.shape == (4, 17)  # 0.5 x a global batch of 8, 16 + 1 tokens each
        ranks = [window_batch(stream, cfg, step, r, 4) for r in range(4)]
        assert torch.equal(torch.cat([w for w in ranks if w is not None]), whole)  # DDP's shards are single's
        again = window_batch(stream, cfg, step, 0, 1)
        assert again is not None and torch.equal(again, whole)  # nothing consumed: a resume reads them too
    first, second = window_batch(stream, cfg, 1, 0, 1), window_batch(stream, cfg, 2, 0, 1)
    assert first is not None and second is not None and not torch.equal(first, second)
    assert window_batch(None, cfg, 1, 0, 1) is None


def test_learning_rate_schedule_warms_up_then_decays(experiment: Experiment) -> None:
    cfg = experiment.config
    t = cfg.train
    assert [lr_at(cfg, s) for s in range(1, t.warmup_steps)] == [t.lr * s / t.warmup_steps
                                                                   for s in range(1, t.warmup_steps)]
    assert lr_at(cfg, t.warmup_steps) == t.lr
    assert math.isclose(lr_at(cfg, t.steps), t.lr * t.min_lr_ratio)
    values = [lr_at(cfg, s) for s in range(t.warmup_steps, t.steps + 1)]
    assert values == sorted(values, reverse=True)


# -------------------------------------------------------------------------------------------------- CLI


def test_run_train_cli_json(experiment: Experiment) -> None:
    from ledger.cli import app

    runner = CliRunner()
    args = ["run", "train", "--arm", "single", "--workdir", str(experiment.workdir), "--db", str(experiment.db),
            "--steps", "3", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert isinstance(out, list) and len(out) == 1
    row = out[0]
    assert set(row) == {"arm", "run", "summary", "seconds", "max_rank_loop_seconds", "total_sent_bytes",
                        "parameter_digest", "ratios"}
    assert (row["arm"], row["run"], row["total_sent_bytes"]) == ("single", "train/single", 0)
    with experiment.store() as store:
        summary = store.get(row["summary"]).receipt
        assert summary.kind == "arm-summary" and summary.artifacts["model"] == row["parameter_digest"]
        end = store.find(kind="train-end", run="train/single")[-1].receipt
        assert end.step == 3 and end.artifacts["model"] == row["parameter_digest"]
        # Three steps of the same arm reproduce the first three steps of the six-step run exactly.
        ckpt = store.find(kind="checkpoint", run="train/single", step=3)[-1].receipt
        assert ckpt.measurements["losses"] == experiment.arms["single", "a"].checkpoints[0, 3].measurements["losses"]
        assert ckpt.artifacts["model"] == experiment.arms["single", "a"].checkpoints[0, 3].artifacts["model"]

    bad = runner.invoke(app, ["run", "train", "--arm", "quad", "--workdir", str(experiment.workdir),
                              "--db", str(experiment.db)])
    assert bad.exit_code == 2 and "quad" in bad.output


# ---------------------------------------------------------------------------------------------- learning

LEARN: dict[str, Any] = {
    "data": {"train_per_variant": 64, "eval_per_variant": 4, "retention_probes": 8},
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "max_len": 96},
    "pretrain": {"steps": 60, "batch_size": 8, "seq_len": 64, "task_documents": 64},
    "train": {"steps": 120, "global_batch": 16, "checkpoint_every": 40, "lr": 0.003, "warmup_steps": 10,
              "pretrain_mix": 0.25, "pretrain_window": 32, "diloco": {"inner_steps": 8}},
}


def _seed_losses(exp: Experiment, arm: str, ckpt_losses: dict[int, list[list[Any]]]) -> list[float]:
    """The seed model's loss on exactly the documents and pretraining windows each (rank, step) of ``ckpt_losses``
    trained on."""
    with exp.store() as store:
        prep = load_prepared(store, ArtifactStore(workdir_root(exp.workdir)), exp.prepared)
    cfg = prep.config
    model = build_model(cfg.model, prep.tokenizer.vocab_size, cfg.seed)
    load_model_weights(prep.seed_checkpoint, model)
    model.eval()
    stream = torch.tensor(prep.stream().ids)
    out = []
    with torch.no_grad(), pinned_threads(1):
        for rank, losses in ckpt_losses.items():
            for step, _ in losses:
                idx = step_indices(cfg.seed, step, len(prep.train), cfg.train.global_batch)
                mine = idx if ARMS[arm].world == 1 else shard(idx, rank, ARMS[arm].world)
                batch = encode_batch(prep.tokenizer, [prep.train[i] for i in mine], cfg.train.loss_on,
                                     cfg.model.max_len)
                windows = window_batch(stream, cfg, step, rank, ARMS[arm].world)
                assert windows is not None and windows.shape == (cfg.train.pretrain_windows // ARMS[arm].world, 33)
                out.append(float(documents_loss(model, batch, len(mine), windows, cfg.train.pretrain_weight)))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def learning(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    root = tmp_path_factory.mktemp("train-learning")
    config = config_from_dict(LEARN)
    db = root / "ledger.db"
    with Store.open(db, create=True) as store, pinned_threads(1):
        prepared = prepare(config, root, store).prepared
    exp = Experiment(root, db, config, prepared)
    for arm in ARMS:
        exp.arms[arm, "a"] = run_arm(exp, arm, f"learn/{arm}")
    return exp


@pytest.mark.parametrize("arm", list(ARMS))
def test_each_arm_learns_well_below_the_seed(learning: Experiment, arm: str) -> None:
    a = learning.arms[arm, "a"]
    t = learning.config.train
    world = ARMS[arm].world
    first = {r: a.checkpoints[r, t.checkpoint_every].measurements["losses"][:5] for r in range(world)}
    last = {r: a.checkpoints[r, t.steps].measurements["losses"] for r in range(world)}
    first_loss = _mean([v for losses in first.values() for _, v in losses])
    last_loss = _mean([v for losses in last.values() for _, v in losses])
    seed_last = _mean(_seed_losses(learning, arm, last))
    # Step 1 is computed before any update: the arm's first loss is the seed's loss on that step's documents.
    assert math.isclose(first[0][0][1], _seed_losses(learning, arm, {0: first[0][:1]})[0], rel_tol=1e-5)
    assert last_loss < 0.5 * first_loss, (arm, first_loss, last_loss)
    assert last_loss < 0.5 * seed_last, (arm, seed_last, last_loss)
