"""The experiment configuration (ledger.experiment.config): strict loading that names the dotted key, the
canonical JSON form the config artifact is, and the arms' table."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ledger import digests
from ledger.errors import InputError
from ledger.experiment.config import (
    ARMS,
    CONFIG_FORMAT,
    MAX_CONFIG_BYTES,
    TINY_VOCAB_BOUND,
    Arm,
    ExperimentConfig,
    config_from_bytes,
    config_from_dict,
    config_from_json,
    load_config,
    tiny_parameters,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


# ----------------------------------------------------------------------------------------------- strictness


@pytest.mark.parametrize(("values", "message"), [
    ({"trian": {}},
     "config: unknown key 'trian' (known: contract, data, eval, launch, model, name, pretrain, seed, train)"),
    ({"train": {"stpes": 8}}, "config: unknown key 'train.stpes'"),
    ({"train": {"diloco": {"h": 2}}}, "config: unknown key 'train.diloco.h'"),
    ({"train": {"steps": "640"}}, "config: train.steps must be int, got str '640'"),
    ({"train": {"steps": 64.0}}, "config: train.steps must be int, got float 64.0"),
    ({"model": {"kind": 1}}, "config: model.kind must be str, got int 1"),
    ({"train": {"lr": True}}, "config: train.lr must be float, got bool True"),
    ({"seed": False}, "config: seed must be int, got bool False"),
    ({"model": {"tie_embeddings": 1}}, "config: model.tie_embeddings must be bool, got int 1"),
    ({"contract": {"serving": {"no_cache_hits": 0.0}}},
     "config: contract.serving.no_cache_hits must be bool, got float 0.0"),
    ({"train": 8}, "config train: expected a table, got int"),
    ({"train": {"diloco": []}}, "config train.diloco: expected a table, got list"),
])
def test_loading_is_strict_and_names_the_dotted_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as info:
        config_from_dict(values)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"model": {"kind": "gpt"}}, "model.kind must be 'tiny' or 'hf', got 'gpt'"),
    ({"model": {"kind": "hf"}}, "model.path is required when model.kind = 'hf'"),
    ({"model": {"d_model": 30}}, "model.d_model (30) must be a positive multiple of model.n_heads (4)"),
    ({"model": {"n_layers": 0}}, "model.n_layers and model.d_ff must be positive"),
    ({"model": {"dropout": 1.0}}, "model.dropout must be in [0, 1), got 1.0"),
    ({"model": {"init_std": 0}}, "model.init_std must be positive"),
    ({"pretrain": {"seq_len": 129}}, "pretrain.seq_len (129) must be in [1, model.max_len=128]"),
    ({"pretrain": {"threads": 0}}, "pretrain.steps >= 0, pretrain.batch_size > 0, pretrain.threads > 0"),
    ({"data": {"eval_per_variant": 0}}, "data.train_per_variant and data.eval_per_variant must be positive"),
    ({"data": {"retention_probes": -1}}, "data.retention_probes must be >= 0"),
    ({"train": {"global_batch": 30, "pretrain_mix": 0.0}},
     "train.global_batch (30) must be a positive multiple of train.world (4)"),
    ({"train": {"global_batch": 30}}, "train.pretrain_mix (0.5) x train.global_batch (30) must be a whole number of "
     "windows and a multiple of train.world (4)"),
    ({"train": {"checkpoint_every": 0}}, "train.checkpoint_every, threads_per_rank > 0"),
    ({"train": {"loss_on": "prompt"}}, "train.loss_on must be 'answer' or 'all', got 'prompt'"),
    ({"train": {"schedule": "linear"}}, "train.schedule must be 'cosine' or 'constant', got 'linear'"),
    ({"train": {"diloco": {"inner_steps": 0}}}, "train.diloco.inner_steps must be positive"),
    ({"contract": {"primary_arm": "diloco"}}, "contract.primary_arm and contract.baseline_arm must be among single, "
                                              "ddp-four, diloco-four"),
    ({"eval": {"batch_size": 0}}, "eval settings must be positive"),
    # beyond what can be allocated or held: refused here, not in an allocator's traceback or a prepare without end
    ({"model": {"max_len": 2**20 + 1}, "pretrain": {"seq_len": 64}}, "model.max_len (1048577) must be at most "
                                                                     "1,048,576"),
    ({"model": {"d_model": 4 * 10**17}}, "model.d_model, n_layers, d_ff and max_len describe "
     "1,280,000,000,000,001,288,000,000,000,000,000,512 parameters, more than the 4,294,967,296 a tiny model may "
     "have (a large model is kind = 'hf')"),
    ({"data": {"train_per_variant": 10**11}},
     "data.train_per_variant, eval_per_variant and retention_probes must be at most 1,048,576"),
    ({"eval": {"batch_size": 10**8}}, "pretrain.batch_size, train.global_batch and eval.batch_size must be at most "
                                      "65,536"),
    ({"eval": {"max_new_tokens": 2**21}}, "eval.max_new_tokens must be at most 1,048,576"),
])
def test_meaningless_values_are_rejected_by_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as info:
        config_from_dict(values)
    assert str(info.value) == f"config: {message}"


def test_load_config_reports_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = 8\nstpes = 8\n")
    with pytest.raises(InputError, match="unknown key 'train.stpes'"):
        load_config(bad)
    bad.write_text("[train\n")
    with pytest.raises(InputError, match=f"config file {bad} is not valid TOML"):
        load_config(bad)
    with pytest.raises(InputError, match=f"config file {tmp_path / 'absent.toml'} does not exist"):
        load_config(tmp_path / "absent.toml")


def test_a_config_file_that_is_not_text_or_not_a_file_is_refused_without_hanging(tmp_path: Path) -> None:
    """A binary file was a UnicodeDecodeError traceback; a FIFO blocked the open and /dev/zero was read without
    end. Each is one InputError now (exit 2), read no further than the bound."""
    import os

    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x80\x04\x95")
    os.mkfifo(tmp_path / "fifo.toml")
    big = tmp_path / "big.toml"
    big.write_text("# a comment\n" * (MAX_CONFIG_BYTES // 12 + 1))
    for path, message in ((binary, f"config file {binary} is not UTF-8 text (byte 0)"),
                          (tmp_path / "fifo.toml", "is a FIFO, not a regular file"),
                          (Path("/dev/zero"), "is a character device, not a regular file"),
                          (tmp_path, "is a directory, not a regular file"),
                          (big, f"is larger than {MAX_CONFIG_BYTES:,} bytes")):
        with pytest.raises(InputError) as info:
            load_config(path)
        assert message in info.value.one_line() and info.value.exit_code == 2


# ---------------------------------------------------------------------------------------- the canonical form


def test_json_round_trip() -> None:
    config = config_from_dict({"name": "other", "seed": 7, "model": {"kind": "hf", "path": "/models/llama"},
                               "train": {"lr": 0.0005, "diloco": {"nesterov": False}}})
    doc = config.to_json()
    # every setting but where it runs (the launch table is not part of the experiment)
    body = {k: v for k, v in dataclasses.asdict(config).items() if k != "launch"}
    assert doc == {"format": CONFIG_FORMAT, "version": 1, "config": body}
    assert config_from_json(doc) == config
    assert config_from_bytes(config.canonical_bytes()) == config
    assert config.digest() == digests.raw_digest(config.canonical_bytes())
    assert config.digest() != ExperimentConfig().digest()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(format="other"), f"not a {CONFIG_FORMAT} document"),
    (lambda d: d.update(version=2), "config version 2, this code reads 1"),
    (lambda d: d["config"]["train"].pop("lr"), "does not round-trip"),
    (lambda d: d["config"]["train"].update(speed=1), "unknown key 'train.speed'"),
])
def test_config_documents_must_round_trip_exactly(edit: Any, message: str) -> None:
    doc = ExperimentConfig().to_json()
    edit(doc)
    with pytest.raises(InputError, match=message):
        config_from_json(doc)


def test_an_integer_for_a_float_is_the_same_config(tmp_path: Path) -> None:
    one, one_float = config_from_dict({"train": {"lr": 1}}), config_from_dict({"train": {"lr": 1.0}})
    assert one == one_float and isinstance(one.train.lr, float)
    assert one.canonical_bytes() == one_float.canonical_bytes() and b'"lr":1.0' in one.canonical_bytes()
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nlr = 1\n")
    assert load_config(toml).digest() == one_float.digest()


def test_the_example_config_is_the_built_in_defaults() -> None:
    assert load_config(EXAMPLES / "experiment.toml") == load_config(None) == ExperimentConfig()
    assert load_config(EXAMPLES / "experiment.toml").digest() == ExperimentConfig().digest()


# -------------------------------------------------------------------------------------------------- the arms


def test_the_arms_table() -> None:
    assert list(ARMS) == ["single", "ddp-four", "diloco-four"]
    assert [(a.name, a.world, a.sync, a.identical_replicas) for a in ARMS.values()] == [
        ("single", 1, "none", True), ("ddp-four", 4, "every-step", True), ("diloco-four", 4, "diloco", False)]
    assert ARMS["ddp-four"] == Arm("ddp-four", 4, "every-step")
    defaults = ExperimentConfig()
    assert ARMS[defaults.contract.primary_arm].sync == "diloco" and ARMS[defaults.contract.baseline_arm].world == 4
    with pytest.raises(TypeError):
        ARMS["extra"] = Arm("extra", 2, "none")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ARMS["single"].world = 2  # type: ignore[misc]


def test_a_config_artifact_with_an_integer_for_a_float_is_refused() -> None:
    """``"lr":1`` is not ``"lr":1.0``: its bytes (and digest) differ from the config it would load as."""
    from ledger import digests
    from ledger.errors import InputError
    from ledger.experiment.config import ExperimentConfig, config_from_json

    doc = ExperimentConfig().to_json()
    config_from_json(doc)
    doc["config"]["train"]["lr"] = int(doc["config"]["train"]["lr"] * 0) + 1
    assert type(doc["config"]["train"]["lr"]) is int
    try:
        config_from_json(digests.parse_canonical(digests.canonical_bytes(doc)))
    except InputError as exc:
        assert "round-trip" in str(exc)
    else:
        raise AssertionError("an integer lr was accepted")


@pytest.mark.parametrize("model", [{}, {"tie_embeddings": True}, {"d_model": 128, "n_layers": 3, "d_ff": 96,
                                                                 "max_len": 200}])
def test_the_parameter_bound_counts_what_the_model_holds(model: dict[str, Any]) -> None:
    import torch  # the runners' model, counted for real (the config itself is torch-free)

    from runners.model import TinyLM

    cfg = config_from_dict({"model": model}).model
    with torch.device("meta"):  # shapes only: nothing allocated
        lm = TinyLM(cfg, TINY_VOCAB_BOUND)
    assert tiny_parameters(cfg) == sum(p.numel() for p in lm.parameters())
