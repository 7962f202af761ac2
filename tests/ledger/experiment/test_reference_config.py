"""examples/reference-1.7b.toml: the reference run's setup parses, validates strictly, and agrees with the figures of
shared/reference/report-1.7b-four-hosts.json it was derived from (without running anything)."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from ledger.errors import InputError
from ledger.experiment.config import ExperimentConfig, config_from_bytes, config_from_dict, load_config

REFERENCE = Path(__file__).resolve().parents[3] / "examples" / "reference-1.7b.toml"


@pytest.fixture(scope="module")
def config() -> ExperimentConfig:
    return load_config(REFERENCE)


def _values() -> dict[str, Any]:
    with open(REFERENCE, "rb") as f:
        return tomllib.load(f)


def test_the_model_is_smollm2_from_a_local_directory_in_bf16(config: ExperimentConfig) -> None:
    m = config.model
    assert (m.kind, m.dtype) == ("hf", "bfloat16")
    assert Path(m.path).is_absolute() and "SmolLM2-1.7B" in m.path and "://" not in m.path
    assert config.pretrain.steps == 0  # the base model is the seed as it is


def test_the_schedule_is_the_reports(config: ExperimentConfig) -> None:
    t = config.train
    assert (t.steps, t.world, t.diloco.inner_steps, t.checkpoint_every) == (256, 4, 16, 64)
    # DiLoCo sent 0.062 of DDP's bytes: one pseudo-gradient all-reduce per 16 steps is 1/16 of the payload, the
    # rest of the reported ratio is wire overhead on the interface counters.
    assert (t.steps // t.diloco.inner_steps) / t.steps == 0.0625 and math.isclose(0.0625, 0.0622, abs_tol=5e-4)
    assert t.steps % t.diloco.inner_steps == 0  # the run ends on an outer step
    # Rank 1 was killed after step 75; the last checkpoint every rank had completed was at step 64.
    assert 75 // t.checkpoint_every * t.checkpoint_every == 64
    assert config.data.eval_per_variant * 16 == 1024 and config.data.retention_probes == 128
    q = config.contract.quality  # the thresholds under which the report's own figures give its conditions
    assert (q.maximum_one_sided_p_vs_seed, q.minimum_accuracy_gain_vs_seed, q.paired_99pct_lower_vs_ddp_min,
            q.retention_99pct_upper_max) == (0.01, 0.1, -0.05, 0.05)


def test_four_gpu_hosts_under_torchrun_with_nccl_and_a_postgresql_ledger(config: ExperimentConfig) -> None:
    la = config.launch
    assert (la.launcher, la.device, la.backend, la.nnodes, la.nproc_per_node) == ("torchrun", "cuda", "nccl", 4, 1)
    assert la.nnodes * la.nproc_per_node == config.train.world
    assert la.db.startswith("postgresql+psycopg://") and la.cublas_workspace_config == ":4096:8"
    commands = [la.torchrun_command(node, "diloco-four", "train/diloco-four") for node in range(la.nnodes)]
    for node, command in enumerate(commands):
        assert command.startswith("CUBLAS_WORKSPACE_CONFIG=:4096:8 LEDGER_DB=postgresql+psycopg://")
        assert f"--node-rank {node} " in command and "--nnodes 4 --nproc-per-node 1" in command
        assert "-m runners.train" in command and "--run-name train/diloco-four" in command
    with pytest.raises(InputError, match="node rank 4"):
        la.torchrun_command(4, "ddp-four", "train/ddp-four")


def test_where_it_runs_is_not_part_of_the_experiment(config: ExperimentConfig) -> None:
    assert "launch" not in config.to_json()["config"]
    elsewhere = dataclasses.replace(config, launch=dataclasses.replace(config.launch, db="sqlite:///x.db", nnodes=1,
                                                                       nproc_per_node=4))
    assert elsewhere.digest() == config.digest() and elsewhere == config
    again = config_from_bytes(config.canonical_bytes())  # the artifact a prepare would store
    assert again == config and again.launch == ExperimentConfig().launch


@pytest.mark.parametrize(("change", "message"), [
    ({"launch": {"nnodes": 2}}, "launch.nnodes x launch.nproc_per_node (2 x 1) must equal train.world (4)"),
    ({"launch": {"device": "tpu"}}, "launch.device must be one of cpu, cuda, got 'tpu'"),
    ({"launch": {"cublas_workspace_config": ""}}, "launch.cublas_workspace_config is required on cuda"),
    ({"launch": {"cublas_workspace_config": ":8:8"}}, "launch.cublas_workspace_config must be one of"),
    ({"launch": {"db": "sqlite:////data/ledger.db"}}, "launch.db is an SQLite file but launch.nnodes = 4"),
    ({"launch": {"db": "mysql://ledger@db-host/ledger"}}, "launch.db must be an sqlite or postgresql URL"),
    ({"launch": {"db": "not a url"}}, "launch.db is not a database URL"),
    ({"launch": {"launcher": "slurm"}}, "launch.launcher must be one of local, torchrun"),
    ({"launch": {"master_port": 0}}, "launch.master_port must be a TCP port"),
    ({"launch": {"nodes": 4}}, "unknown key 'launch.nodes'"),
    ({"model": {"dtype": "float16"}}, "model.dtype must be one of float32, bfloat16, got 'float16'"),
    ({"model": {"path": ""}}, "model.path is required when model.kind = 'hf'"),
])
def test_a_wrong_value_is_named(change: dict[str, Any], message: str) -> None:
    values = _values()
    for section, fields in change.items():
        values[section] = {**values[section], **fields}
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(values)
