"""The experiment config, and prepare end to end: artifacts, receipts that verify, determinism across processes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ledger import digests
from ledger.artifacts import ArtifactStore, parse_jsonl, read_jsonl
from ledger.errors import DigestMismatch, InputError
from ledger.experiment import corpus, tasks
from ledger.experiment.config import ExperimentConfig, config_from_bytes, config_from_dict, load_config
from ledger.experiment.tokenizer import CharTokenizer
from ledger.store import Store
from runners.model import build_model, param_count, sequence_nll
from runners.prepare import corpus_text, load_model_weights, load_prepared, load_selection, prepare, run_prepare
from verify.receipts import verify_receipt

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "experiment.toml"

TINY_TOML = """
name = "tiny"
seed = 7
[data]
train_per_variant = 16
eval_per_variant = 4
retention_probes = 8
[model]
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
max_len = 48
[pretrain]
steps = 6
batch_size = 4
seq_len = 32
task_documents = 24
[train]
pretrain_window = 32
[contract.quality]
minimum_accuracy_gain_vs_seed = 0.2
"""


@pytest.fixture
def tiny_toml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


# --------------------------------------------------------------------------------------------------- config


def test_example_config_equals_the_defaults() -> None:
    config = load_config(EXAMPLE)
    assert config == load_config(None) == ExperimentConfig()
    assert config.canonical_bytes() == ExperimentConfig().canonical_bytes()
    assert config.data.eval_per_variant * 16 == 1024 and config.data.retention_probes == 128


def test_config_loading_is_strict_and_round_trips(tiny_toml: Path, tmp_path: Path) -> None:
    config = load_config(tiny_toml)
    assert config.model.d_model == 32 and config.model.n_layers == 1
    assert config.train == replace(ExperimentConfig().train, pretrain_window=32)
    assert config.contract.quality.minimum_accuracy_gain_vs_seed == 0.2
    assert config_from_bytes(config.canonical_bytes()) == config
    assert config.digest() == digests.raw_digest(config.canonical_bytes())
    # an integer for a float setting is the same config as the float
    assert config_from_dict({"train": {"lr": 1}}).canonical_bytes() == \
        config_from_dict({"train": {"lr": 1.0}}).canonical_bytes()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"modle": {}}, "unknown key 'modle'"),
        ({"model": {"d_modle": 3}}, "unknown key 'model.d_modle'"),
        ({"model": {"d_model": "128"}}, "model.d_model must be int"),
        ({"model": {"tie_embeddings": 1}}, "must be bool"),
        ({"train": {"lr": True}}, "train.lr must be float"),
        ({"model": {"d_model": 30, "n_heads": 4}}, "multiple of model.n_heads"),
        ({"train": {"global_batch": 30}}, "multiple of train.world"),
        ({"contract": {"primary_arm": "nope"}}, "primary_arm"),
    ]
    for bad, match in cases:
        with pytest.raises(InputError, match=match):
            config_from_dict(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(InputError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(InputError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


# -------------------------------------------------------------------------------------------------- prepare


def test_prepare_end_to_end(tiny_toml: Path, tmp_path: Path) -> None:
    config = load_config(tiny_toml)
    workdir = tmp_path / "work"
    workdir.mkdir()
    with Store.open(workdir / "ledger.db", create=True) as store:
        result = prepare(config, workdir, store)
        arts = ArtifactStore(workdir / "artifacts")

        # receipts: prepare -> selection, contract; the digests are the chain's
        prep = store.get(result.receipts["prepare"]).receipt
        sel = store.get(result.receipts["selection"]).receipt
        contract = store.get(result.receipts["contract"]).receipt
        assert set(prep.artifacts) == {"config", "train_data", "tokenizer", "seed_state", "model", "pretrain_corpus"}
        assert prep.prepared == result.prepared == digests.prepared_digest(prep.artifacts)
        assert set(sel.artifacts) == {"eval_selection", "retention_probes"}
        assert sel.selection == result.selection == digests.selection_digest(sel.artifacts)
        assert sel.parents == (prep.id,) and contract.parents == (prep.id,)
        assert contract.measurements["quality"]["minimum_accuracy_gain_vs_seed"] == 0.2
        assert contract.measurements["efficiency"] == {"active_seconds_vs_ddp_max": 1.0, "sent_bytes_vs_ddp_max": 0.1}
        assert contract.measurements["serving"] == {"all_requests_completed": True,
                                                    "identical_successful_output_tokens": True, "no_cache_hits": True}
        assert contract.measurements["primary_arm"] == "diloco-four"
        assert sel.measurements["selection"]["documents"] == 64
        assert sel.measurements["selection"]["family_variant"]["sort"] == {str(v): 4 for v in range(4)}
        assert prep.measurements["pretrain"]["threads"] == 1
        assert prep.measurements["model"]["parameters"] == result.parameters

        # every receipt verifies, with every artifact found and re-hashed
        for rid in result.receipts.values():
            report = verify_receipt(store, rid, artifacts=arts, require_artifacts=True)
            assert not report.missing
            assert all(a.status == "verified" for a in report.artifacts)
        report = verify_receipt(store, result.receipts["selection"], artifacts=arts)
        assert {a.name for a in report.artifacts} == set(prep.artifacts) | set(sel.artifacts)

        # the artifacts say what the receipts claim: the corpus is every pydoc topic, then the first training
        # documents (never a held-out one), each framed by BOS and EOS in the stream
        loaded = load_prepared(store, arts, result.prepared)
        records = read_jsonl(arts, prep.artifacts["pretrain_corpus"])
        assert records == corpus.corpus_records(loaded.train, 24)
        assert "\n\n".join(r["text"] for r in records if r["source"] == "pydoc_data.topics") == corpus_text()
        assert [r["document"] for r in records if r["source"] == "train_data"] == [d.digest for d in loaded.train[:24]]
        assert prep.measurements["corpus"]["documents"] == {"pydoc_data.topics": len(records) - 24, "train_data": 24}
        stream = loaded.stream()
        assert stream.ids.count(loaded.tokenizer.eos_id) == len(records) == stream.ids.count(loaded.tokenizer.bos_id)
        assert prep.measurements["corpus"]["tokens"] == len(stream.ids)
        assert config_from_bytes(arts.get_bytes(prep.artifacts["config"]) or b"") == config
        assert loaded.config == config and loaded.seed_checkpoint == result.seed_checkpoint
        docs, probes = load_selection(store, arts, result.selection)
        assert len(loaded.train) == 256 and len(docs) == 64 and len(probes) == 8
        tasks.check_disjoint(loaded.train, docs)
        assert docs == tasks.eval_selection(config.seed, 4)
        for d in docs:
            assert loaded.tokenizer.decode(loaded.tokenizer.encode(d.text)) == d.text

        # probes are pydoc windows of the stream the seed was trained on, one window + its target each
        for p in probes:
            window = stream.window(p["offset"], config.pretrain.seq_len)
            assert stream.inside_pydoc(p["offset"], config.pretrain.seq_len) and len(window) == 33
            assert loaded.tokenizer.encode(p["text"]) == window and p["text"] in corpus_text()
            assert 0 <= p["step"] < config.pretrain.steps
            assert p["document"] == digests.digest_json(
                "document", {"format": "pydoc-window", "source": "pydoc_data.topics", "offset": p["offset"],
                             "text": p["text"]})
        assert len({p["offset"] for p in probes}) == len(probes)

        # the seed checkpoint loads into the architecture and is the pretrained model, not the initial one
        seed = build_model(config.model, loaded.tokenizer.vocab_size, seed=0)
        assert load_model_weights(loaded.seed_checkpoint, seed) == prep.artifacts["model"]
        assert param_count(seed) == result.parameters
        fresh = build_model(config.model, loaded.tokenizer.vocab_size, seed=0)
        ids = [loaded.tokenizer.encode(p["text"]) for p in probes]
        assert sum(sequence_nll(seed, ids)) < sum(sequence_nll(fresh, ids))

        # re-running in the same work directory appends nothing new and keeps one seed checkpoint
        count = store.count()
        again = prepare(config, workdir, store)
        assert again.receipts == result.receipts and store.count() == count == 3
        assert [p.name for p in (workdir / "checkpoints").iterdir()] == [result.seed_checkpoint.name]

        # a changed artifact no longer verifies
        path = arts.path_for(prep.artifacts["train_data"])
        lines = parse_jsonl(path.read_bytes())
        lines[0]["answer"] = "9"
        path.chmod(0o644)
        path.write_bytes(b"".join(digests.canonical_bytes(x) + b"\n" for x in lines))
        with pytest.raises(DigestMismatch):
            verify_receipt(store, result.receipts["prepare"], artifacts=arts)
        with pytest.raises(DigestMismatch):
            read_jsonl(arts, prep.artifacts["train_data"])


def test_another_config_gives_other_digests(tiny_toml: Path, tmp_path: Path) -> None:
    config = load_config(tiny_toml)
    other = replace(config, data=replace(config.data, retention_probes=6))
    with Store.open(tmp_path / "ledger.db", create=True) as store:
        a = prepare(config, tmp_path / "a", store)
        b = prepare(other, tmp_path / "b", store)
    assert a.prepared != b.prepared  # the config is committed by the prepared digest
    assert a.artifacts["train_data"] == b.artifacts["train_data"]
    assert a.artifacts["seed_state"] == b.artifacts["seed_state"]
    assert a.selection != b.selection


def test_prepare_refuses_too_many_probes(tiny_toml: Path, tmp_path: Path) -> None:
    config = load_config(tiny_toml)
    config = replace(config, data=replace(config.data, retention_probes=10_000))
    with Store.open(tmp_path / "ledger.db", create=True) as store, pytest.raises(InputError, match="distinct windows"):
        prepare(config, tmp_path / "w", store)


@pytest.mark.slow
def test_prepare_is_bit_identical_in_two_processes(tiny_toml: Path, tmp_path: Path) -> None:
    script = ("import json, sys; from pathlib import Path; from runners.prepare import run_prepare; "
              "print(json.dumps(run_prepare(Path(sys.argv[1]), Path(sys.argv[2]), None)))")
    summaries = []
    for name in ("one", "two"):
        done = subprocess.run([sys.executable, "-c", script, str(tiny_toml), str(tmp_path / name)], cwd=REPO,
                              capture_output=True, text=True, timeout=300, check=True)
        summaries.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, two = summaries
    for key in ("prepared", "selection", "receipts", "artifacts", "parameters", "pretrain_final_loss"):
        assert one[key] == two[key], key
    for name in ("train_data", "tokenizer", "config", "pretrain_corpus"):
        rel = ArtifactStore(tmp_path / "one" / "artifacts").path_for(one["artifacts"][name])
        twin = ArtifactStore(tmp_path / "two" / "artifacts").path_for(two["artifacts"][name])
        assert rel.read_bytes() == twin.read_bytes()
    ckpt_one, ckpt_two = Path(one["seed_checkpoint"]), Path(two["seed_checkpoint"])
    assert sorted(p.name for p in ckpt_one.iterdir()) == sorted(p.name for p in ckpt_two.iterdir())
    for f in ckpt_one.iterdir():  # even the files are byte-identical
        assert f.read_bytes() == (ckpt_two / f.name).read_bytes(), f.name


def test_cli_run_prepare(tiny_toml: Path, tmp_path: Path) -> None:
    from ledger.cli import app

    workdir = tmp_path / "exp"
    result = CliRunner().invoke(app, ["run", "prepare", "--workdir", str(workdir), "--config", str(tiny_toml),
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["documents"] == {"train": 256, "eval_selection": 64, "retention_probes": 8}
    assert (workdir / "ledger.db").exists()
    check = CliRunner().invoke(app, ["verify", "--db", str(workdir / "ledger.db"), summary["receipts"]["selection"],
                                     "--require-artifacts"])
    assert check.exit_code == 0, check.output
    assert "0 missing" in check.output


def test_tokenizer_covers_the_corpus_and_every_document(tiny_toml: Path, tmp_path: Path) -> None:
    summary = run_prepare(tiny_toml, tmp_path / "w", None)
    arts = ArtifactStore(tmp_path / "w" / "artifacts")
    tok = CharTokenizer.from_bytes(arts.get_bytes(summary["artifacts"]["tokenizer"]) or b"")
    assert tok.vocab_size == summary["vocab_size"]
    ids = tok.encode(corpus_text())  # strict: raises if any character were missing
    assert tok.decode(ids) == corpus_text()
    assert torch.tensor(ids).max().item() < tok.vocab_size



@pytest.mark.slow
@pytest.mark.distributed
def test_a_ledger_outside_the_workdir_leaves_the_artifacts_in_it(tiny_toml: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runner keeps a work directory's artifacts in ``<workdir>/artifacts`` (ledger.artifacts.workdir_root),
    wherever its ledger is: prepare writes them there and a rank worker started with ``--db elsewhere`` reads its
    prepared config from there too (it used to look beside the ledger file)."""
    from ledger.artifacts import ENV_ARTIFACTS
    from ledger.cli import app

    monkeypatch.delenv(ENV_ARTIFACTS, raising=False)
    workdir, db = tmp_path / "work", tmp_path / "elsewhere" / "ledger.db"
    db.parent.mkdir()
    runner = CliRunner()
    for args in (["run", "prepare", "--workdir", workdir, "--db", db, "--config", tiny_toml],
                 ["run", "train", "--workdir", workdir, "--db", db, "--arm", "single", "--steps", "2"]):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    assert (workdir / "artifacts").is_dir() and not (db.parent / "artifacts").exists()
    with Store.open(db) as store:
        end = store.find(kind="train-end")[-1].receipt
        report = verify_receipt(store, end.id, artifacts=ArtifactStore(workdir / "artifacts"), require_artifacts=True)
    assert report.missing == []
