"""The real-model path: ``model.kind = "hf"`` through prepare, the three arms, a killed-and-recovered run (bitwise),
evaluation and the audit, on a tiny Llama-architecture model made from a ``transformers.LlamaConfig`` (no
download) with a byte-level BPE tokenizer trained here with the ``tokenizers`` package.

The model directory looks like a real one (``config.json``, ``model.safetensors``, ``tokenizer.json``): prepare
loads its weights as the starting point, pretrains them briefly, and takes the tokenizer from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from ledger.artifacts import ArtifactStore, read_jsonl, workdir_root
from ledger.cli import app
from ledger.experiment import corpus, tasks
from ledger.experiment.tokenizer import HFTokenizer, tokenizer_from_bytes
from ledger.store import Store
from runners.evaluate import run_evaluation
from runners.model import HFCausalLM, build_model, param_count
from runners.prepare import load_model_weights, load_prepared, run_prepare
from runners.recover import run_recover
from runners.train import summarize_arm, train_arm
from verify.audit import audit

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
TOML = """
name = "hf-tiny"
seed = 11
[data]
train_per_variant = 32
eval_per_variant = 2
retention_probes = 8
[model]
kind = "hf"
path = "{path}"
max_len = 128
[pretrain]
steps = 6
batch_size = 4
seq_len = 32
task_documents = 32
[train]
steps = 8
global_batch = 8
checkpoint_every = 4
warmup_steps = 2
lr = 0.003
pretrain_mix = 0.5
[train.diloco]
inner_steps = 2
[eval]
max_new_tokens = 8
batch_size = 8
"""


def make_model_dir(root: Path) -> Path:
    """A tiny Llama with random weights and a BPE tokenizer trained on the corpus, saved like a hub model."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    held_out = tasks.eval_selection(0, 2)
    texts = [t for _, t in corpus.pydoc_topics()] + [d.text for d in tasks.training_documents(0, 8, held_out)]
    tok.train_from_iterator(texts, trainer)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    return root


@dataclass
class HFExperiment:
    workdir: Path
    model_dir: Path
    prepared: dict[str, Any]
    recovered: Any
    evaluation: Any
    audit: Any

    @property
    def db(self) -> str:
        return str(self.workdir / "ledger.db")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFExperiment:
    root = tmp_path_factory.mktemp("hf")
    model_dir = make_model_dir(root / "tiny-llama")
    config = root / "hf.toml"
    config.write_text(TOML.format(path=model_dir))
    workdir = root / "experiment"
    prepared = run_prepare(config, workdir, None)
    db = str(workdir / "ledger.db")
    for arm in ("single", "ddp-four", "diloco-four"):
        _, run = train_arm(workdir, db, arm, prepared=prepared["prepared"], timeout=60.0)
        with Store.open(db) as store:
            summarize_arm(store, prepared["prepared"], arm, run)
    recovered = run_recover(workdir, db, arm="diloco-four", prepared=prepared["prepared"])
    evaluation = run_evaluation(workdir, db, prepared=prepared["prepared"])
    with Store.open(db) as store:
        audited = audit(store, ArtifactStore(workdir_root(workdir)), prepared["prepared"])
    return HFExperiment(workdir, model_dir, prepared, recovered, evaluation, audited)


def test_the_tokenizer_is_the_model_directorys(hf: HFExperiment) -> None:
    with Store.open(hf.db) as store:
        prep = store.find(kind="prepare")[-1].receipt
    data = ArtifactStore(workdir_root(hf.workdir)).get_bytes(prep.artifacts["tokenizer"])
    assert data is not None
    tok = tokenizer_from_bytes(data)
    assert isinstance(tok, HFTokenizer) and tok == HFTokenizer.from_model_dir(hf.model_dir)
    assert tok.tokenizer_json == (hf.model_dir / "tokenizer.json").read_text()  # kept verbatim
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert prep.measurements["tokenizer"] == {"kind": "hf", "vocab_size": tok.vocab_size}
    text = "sorted([3,1,2]) = "
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == text


def test_prepare_starts_from_the_directorys_weights_and_pretrains_them(hf: HFExperiment) -> None:
    with Store.open(hf.db) as store:
        prep = load_prepared(store, ArtifactStore(workdir_root(hf.workdir)), hf.prepared["prepared"])
        receipt = prep.receipt
    base = transformers.AutoModelForCausalLM.from_pretrained(hf.model_dir, local_files_only=True)
    seed = build_model(prep.config.model, prep.tokenizer.vocab_size, 0)
    assert isinstance(seed, HFCausalLM)
    assert load_model_weights(prep.seed_checkpoint, seed) == receipt.artifacts["model"]
    assert receipt.measurements["model"]["kind"] == "hf"
    assert receipt.measurements["model"]["parameters"] == param_count(seed) == sum(p.numel() for p in base.parameters())
    # the seed is the directory's model after pretraining: same architecture, moved weights
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, seed.inner.get_parameter(n))]
    assert moved and receipt.measurements["pretrain"]["steps"] == 6
    # retention probes are pydoc windows of the seed's own token stream
    stream = prep.stream()
    with Store.open(hf.db) as store:
        sel = store.find(kind="selection")[-1].receipt
    probes = read_jsonl(ArtifactStore(workdir_root(hf.workdir)), sel.artifacts["retention_probes"])
    assert len(probes) == 8
    for p in probes:
        assert stream.inside_pydoc(p["offset"], 32) and 0 <= p["step"] < 6
        assert p["text"] == prep.tokenizer.decode(stream.window(p["offset"], 32))


def test_the_arms_train_and_the_recovered_run_is_bitwise_equal(hf: HFExperiment) -> None:
    assert hf.recovered.passed
    for m in (r.measurements for r in hf.recovered.comparisons):
        assert m["contents_exactly_equal"] and m["file_hashes_equal"] and m["trajectory_equal"]
    with Store.open(hf.db) as store:
        ddp = {s.receipt.artifacts["model"] for s in store.find(kind="train-end", run="train/ddp-four")}
        seed_model = store.find(kind="prepare")[-1].receipt.artifacts["model"]
        diloco = store.find(kind="arm-summary", run="train/diloco-four")[-1].receipt
    assert len(ddp) == 1 and seed_model not in ddp  # DDP ranks end identical, and not at the seed
    assert diloco.measurements["ratios"]["sent_bytes_vs_ddp"] == 0.5  # H = 2


def test_every_model_is_evaluated_and_the_audit_verifies(hf: HFExperiment) -> None:
    assert set(hf.evaluation.evals) == {"seed", "single", "ddp-four", "diloco-four"}
    assert hf.evaluation.quality is not None
    report = hf.audit.report
    assert report["contracts"]["recovery"] is True
    assert set(report["training"]["arms"]) == {"single", "ddp-four", "diloco-four"}
    result = CliRunner().invoke(app, ["verify", "--db", hf.db, hf.audit.receipt.id, "--require-artifacts"])
    assert result.exit_code == 0, result.output
    assert "report rebuilt from the ledger, every field equal" in result.stdout
    rescored = CliRunner().invoke(app, ["verify", "--db", hf.db, hf.evaluation.evals["diloco-four"].id,
                                        "--rescore", "4", "--json"])
    assert rescored.exit_code == 0, rescored.output
    assert json.loads(rescored.stdout)["ok"] is True
