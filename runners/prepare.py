"""Prepare: task data, tokenizer, the pretrained seed model, retention probes, and the receipts that commit to them.

``prepare(config, workdir, store)`` writes every artifact content-addressed under ``<workdir>/artifacts`` (and the
seed checkpoint directory under ``<workdir>/checkpoints``), then appends three receipts:

* ``prepare``: artifacts {config, train_data, tokenizer, seed_state, model, pretrain_corpus}; ``prepared`` is
  :func:`ledger.digests.prepared_digest` of them. ``pretrain_corpus`` is the JSONL of
  :func:`ledger.experiment.corpus.corpus_records`: every text the seed was pretrained on.
* ``selection`` (parent: prepare): artifacts {eval_selection, retention_probes}; ``selection`` is
  :func:`ledger.digests.selection_digest` of them; measurements count documents per family and variant.
* ``contract`` (parent: prepare): the pre-registered quality, efficiency and serving thresholds, before training.

Everything is a function of the config (and of the Python/torch build, which the receipt records): the same
config prepared twice, in two processes, gives the same artifacts, the same digests and the same receipt ids, so
re-running appends nothing new.

The seed model: :func:`runners.model.initial_model` (``tiny``: a seeded initialisation; ``hf``: the model
directory's own weights) pretrained for ``pretrain.steps`` on random windows of the pretraining stream
(:mod:`ledger.experiment.corpus`: the pydoc topics and a few task documents, each framed by BOS and EOS), with the
intra-op thread count pinned. Its retention probes are pydoc windows it was trained on, chosen by seed, each stored
with the step it was first seen at. The tokenizer is a character tokenizer built from the data (``tiny``) or the
model directory's ``tokenizer.json`` (``hf``).
"""

from __future__ import annotations

import math
import os
import platform
import secrets
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F

from ledger import digests
from ledger.artifacts import ArtifactStore, put_jsonl, read_artifact, read_json, read_jsonl, workdir_root
from ledger.errors import InputError, LedgerError, UnknownExperiment
from ledger.experiment import corpus, tasks
from ledger.experiment.config import ARMS, ExperimentConfig, PretrainConfig, config_from_bytes, load_config
from ledger.experiment.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, tokenizer_from_json
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners import numerics
from runners.model import initial_model, param_count

CORPUS_SOURCE: Final = corpus.PYDOC_SOURCE
PROBE_FORMAT: Final = corpus.PROBE_FORMAT
# Stream labels for tasks.derived_seed / derived_rng (the task generators use 1..3).
_STREAM_PRETRAIN: Final = 10
_STREAM_PROBES: Final = 11
_STREAM_INIT: Final = 12
_LOSS_POINTS: Final = 32  # how many points of the pretraining loss curve the prepare receipt keeps


# ------------------------------------------------------------------------------------------------- corpus


def corpus_text() -> str:
    """Every ``pydoc_data.topics`` entry in key order, separated by blank lines (the pydoc part of the corpus)."""
    return "\n\n".join(text for _, text in corpus.pydoc_topics())


def stream_tensor(stream: corpus.Stream) -> torch.Tensor:
    return torch.tensor(stream.ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- pretraining


@dataclass
class PretrainResult:
    losses: list[float]  # one per step
    windows: list[tuple[int, int]]  # (step, offset) of every window consumed, in order
    seconds: float
    optimizer: torch.optim.Optimizer
    rngs: Any  # runners.rng.Rngs after the last step (captured into the seed checkpoint)


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def pretrain(model: torch.nn.Module, ids: torch.Tensor, cfg: PretrainConfig, seed: int) -> PretrainResult:
    """LM training on random windows of the token stream ``ids``; every draw comes from ``Rngs(seed, 0)``.

    A window is ``seq_len + 1`` tokens starting at an offset drawn with the rank generators' Python stream; the
    model predicts tokens 1.. from tokens ..-1 of it. The caller pins the thread count.
    """
    from runners.rng import Rngs

    rngs = Rngs.from_seed(seed, 0)
    model.dropout_generator = rngs.torch  # type: ignore[assignment]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    span = len(ids) - cfg.seq_len - 1
    if span <= 0:
        raise InputError(f"the corpus has {len(ids)} tokens, fewer than pretrain.seq_len + 1")
    losses: list[float] = []
    windows: list[tuple[int, int]] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        offsets = [rngs.python.randrange(span + 1) for _ in range(cfg.batch_size)]
        windows.extend((step, o) for o in offsets)
        batch = torch.stack([ids[o : o + cfg.seq_len + 1] for o in offsets])
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    model.eval()
    model.dropout_generator = None  # type: ignore[assignment]
    return PretrainResult(losses, windows, seconds, opt, rngs)


def retention_probes(stream: corpus.Stream, tokenizer: Tokenizer, windows: Sequence[tuple[int, int]], seq_len: int,
                     count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` distinct pretraining windows inside pydoc text, chosen by seed (see
    :func:`ledger.experiment.corpus.retention_probes`)."""
    return corpus.retention_probes(stream, tokenizer, windows, seq_len, count, tasks.derived_rng(seed, _STREAM_PROBES))


# --------------------------------------------------------------------------------------------- checkpoint


def _save_seed(model: torch.nn.Module, result: PretrainResult, directory: Path,
               meta: dict[str, Any]) -> tuple[str, str, Path]:
    """Write the seed checkpoint as ``<directory>/seed-<state hex[:16]>``; returns (state, model digest, path).

    The checkpoint holds the full pretraining state (model, AdamW, generators, cursor = steps). An identical seed
    already there is kept (prepare is re-runnable); a different one under that name is an error.
    """
    from ledger import state as ledger_state
    from runners.checkpoint import save_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f"seed-pending-{os.getpid()}-{secrets.token_hex(4)}"
    saved = save_checkpoint(staging, model=model, optimizer=result.optimizer, rngs=result.rngs,
                            cursor=len(result.losses), meta=meta)
    final = directory / f"seed-{digests.digest_hex(saved.digest)[:16]}"
    if final.exists():
        shutil.rmtree(staging)
        existing = ledger_state.read_manifest(final).checkpoint
        if existing != saved.digest:
            raise LedgerError(f"{final} holds state {existing}, not {saved.digest}")
    else:
        os.rename(staging, final)
    return saved.digest, str(saved.manifest.components["model"]), final


def load_model_weights(checkpoint: Path, model: torch.nn.Module) -> str:
    """Verify ``checkpoint`` (torch-free, via ledger.state) and load only its model component into ``model``.

    Returns the model digest. Training arms start from the seed this way, with a fresh optimizer.
    """
    from safetensors.torch import load_file

    from ledger import state as ledger_state

    state = ledger_state.verify_checkpoint(checkpoint)
    if "model" not in state.components:
        raise InputError(f"checkpoint {checkpoint} has no model component")
    tensors: dict[str, torch.Tensor] = {}
    for name in state.components["model"].files:
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(Path(checkpoint) / name)))  # safetensors only: never unpickles
    model.load_state_dict(tensors, strict=True)
    return str(state.components["model"].digest)


# ------------------------------------------------------------------------------------------------ prepare


@dataclass
class PrepareResult:
    prepared: str
    selection: str
    receipts: dict[str, str]  # kind -> receipt id
    artifacts: dict[str, str]  # name -> digest (prepare and selection artifacts)
    seed_checkpoint: Path
    parameters: int
    vocab_size: int
    documents: dict[str, int]
    pretrain_losses: tuple[float | None, float | None]  # first step, mean of the last ten (None without steps)
    seconds: dict[str, float] = field(default_factory=dict)
    threads: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "prepared": self.prepared,
            "selection": self.selection,
            "receipts": dict(self.receipts),
            "artifacts": dict(self.artifacts),
            "seed_checkpoint": str(self.seed_checkpoint),
            "parameters": self.parameters,
            "vocab_size": self.vocab_size,
            "documents": dict(self.documents),
            "pretrain_first_loss": self.pretrain_losses[0],
            "pretrain_final_loss": self.pretrain_losses[1],
            "threads": self.threads,
            "seconds": dict(self.seconds),
        }


@contextmanager
def pinned_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads (float results depend on it), restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _loss_curve(losses: list[float]) -> dict[str, Any]:
    every = max(1, math.ceil(len(losses) / _LOSS_POINTS))
    return {"every": every, "values": losses[::every]}


def contract_measurements(config: ExperimentConfig) -> dict[str, Any]:
    """The pre-registered thresholds, shaped like the reference report's ``conditions``."""
    c = config.contract
    return {
        "arms": list(ARMS),
        "primary_arm": c.primary_arm,
        "baseline_arm": c.baseline_arm,
        "quality": {
            "minimum_accuracy_gain_vs_seed": c.quality.minimum_accuracy_gain_vs_seed,
            "maximum_one_sided_p_vs_seed": c.quality.maximum_one_sided_p_vs_seed,
            "paired_99pct_lower_vs_ddp_min": c.quality.paired_99pct_lower_vs_ddp_min,
            "retention_99pct_upper_max": c.quality.retention_99pct_upper_max,
        },
        "efficiency": {
            "active_seconds_vs_ddp_max": c.efficiency.active_seconds_vs_ddp_max,
            "sent_bytes_vs_ddp_max": c.efficiency.sent_bytes_vs_ddp_max,
        },
        "serving": {
            "all_requests_completed": c.serving.all_requests_completed,
            "identical_successful_output_tokens": c.serving.identical_successful_output_tokens,
            "no_cache_hits": c.serving.no_cache_hits,
        },
    }


def prepare(config: ExperimentConfig, workdir: Path, store: Store) -> PrepareResult:
    """Generate and store every prepare artifact, then append the prepare, selection and contract receipts."""
    from runners.rng import seed_global_rngs

    t_start = time.perf_counter()
    workdir = Path(workdir)
    arts = ArtifactStore(workdir_root(workdir))
    seed = config.seed
    # The checkpoint captures the process-global generators too: seed them so the seed state is reproducible.
    seed_global_rngs(tasks.derived_seed(seed, _STREAM_PRETRAIN), 0)

    held_out = tasks.eval_selection(seed, config.data.eval_per_variant)
    train = tasks.training_documents(seed, config.data.train_per_variant, held_out)
    train_digest = put_jsonl(arts, (d.to_json() for d in train))
    selection_docs_digest = put_jsonl(arts, (d.to_json() for d in held_out))
    records = corpus.corpus_records(train, config.pretrain.task_documents)
    corpus_digest = put_jsonl(arts, records)

    tokenizer: CharTokenizer | HFTokenizer
    if config.model.kind == "hf":  # a real model comes with its own tokenizer
        tokenizer = HFTokenizer.from_model_dir(config.model.path)
    else:
        tokenizer = CharTokenizer.build([*corpus.record_texts(records), *(d.text for d in train),
                                         *(d.text for d in held_out)])
    tokenizer_digest = arts.put_bytes(tokenizer.canonical_bytes())
    stream = corpus.build_stream(records, tokenizer)
    config_digest = arts.put_bytes(config.canonical_bytes())
    if config_digest != config.digest():  # the artifact store and the config must agree on the config's name
        raise LedgerError(f"config artifact {config_digest} differs from config.digest() {config.digest()}")

    with pinned_threads(config.pretrain.threads):
        model = initial_model(config.model, tokenizer.vocab_size, tasks.derived_seed(seed, _STREAM_INIT))
        result = pretrain(model, stream_tensor(stream), config.pretrain, tasks.derived_seed(seed, _STREAM_PRETRAIN))
        probes = retention_probes(stream, tokenizer, result.windows, config.pretrain.seq_len,
                                  config.data.retention_probes, seed)
        probes_digest = put_jsonl(arts, probes)
        meta = {"role": "seed", "step": config.pretrain.steps, "config": config_digest, "rank": 0, "world": 1}
        state_digest, model_digest, ckpt = _save_seed(model, result, workdir / "checkpoints", meta)

    prepare_artifacts = {
        "config": config_digest,
        "train_data": train_digest,
        "tokenizer": tokenizer_digest,
        "seed_state": state_digest,
        "model": model_digest,
        "pretrain_corpus": corpus_digest,
    }
    prepared = digests.prepared_digest(prepare_artifacts)
    last = result.losses[-10:]
    first_loss = result.losses[0] if result.losses else None
    final_loss = sum(last) / len(last) if last else None
    threads = config.pretrain.threads
    prepare_receipt = make_receipt(
        "prepare",
        prepared=prepared,
        artifacts=prepare_artifacts,
        measurements={
            "experiment": config.name,
            "documents": {"train": len(train), **{k: v for k, v in tasks.counts(train).items() if k != "documents"}},
            "corpus": {"source": CORPUS_SOURCE, "python": platform.python_version(),
                       "documents": {src: stream.sources.count(src) for src in (corpus.PYDOC_SOURCE,
                                                                                  corpus.TASK_SOURCE)},
                       "characters": sum(len(t) for t in corpus.record_texts(records)), "tokens": len(stream.ids)},
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size},
            "model": {"kind": config.model.kind, "dtype": config.model.dtype, "parameters": param_count(model),
                      "tensors": len(model.state_dict())},
            "pretrain": {"steps": config.pretrain.steps, "batch_size": config.pretrain.batch_size,
                         "seq_len": config.pretrain.seq_len, "task_documents": config.pretrain.task_documents,
                         "threads": threads,
                         "first_loss": first_loss, "final_loss": final_loss,
                         "losses": _loss_curve(result.losses)},
            "software": {"torch": torch.__version__, "python": sys.version.split()[0], "cpu": numerics.describe()},
        },
    )
    selection_artifacts = {"eval_selection": selection_docs_digest, "retention_probes": probes_digest}
    selection = digests.selection_digest(selection_artifacts)
    selection_receipt = make_receipt(
        "selection",
        prepared=prepared,
        selection=selection,
        parents=[prepare_receipt],
        artifacts=selection_artifacts,
        measurements={
            "selection": tasks.counts(held_out),
            "retention_probes": {"documents": len(probes), "tokens": config.pretrain.seq_len + 1,
                                 "source": CORPUS_SOURCE,
                                 "exposure": "windows the seed model was pretrained on" if result.windows else
                                 "public pydoc text, not pretrained on here (the seed is a base model as it is)"},
        },
    )
    contract_receipt = make_receipt("contract", prepared=prepared, parents=[prepare_receipt],
                                    measurements=contract_measurements(config))
    receipts: list[Receipt] = [prepare_receipt, selection_receipt, contract_receipt]

    # Where the bytes are: the content-addressed files are found by the verifier anyway; the checkpoint directory
    # is the location of the seed state and of its model component.
    store.append_many(receipts)
    store.add_receipt_locations(prepare_receipt.id, {"seed_state": str(ckpt.resolve()),
                                                     "model": str(ckpt.resolve())})
    return PrepareResult(
        prepared=prepared,
        selection=selection,
        receipts={r.kind: r.id for r in receipts},
        artifacts={**prepare_artifacts, **selection_artifacts},
        seed_checkpoint=ckpt,
        parameters=param_count(model),
        vocab_size=tokenizer.vocab_size,
        documents={"train": len(train), "eval_selection": len(held_out), "retention_probes": len(probes)},
        pretrain_losses=(first_loss, final_loss),
        seconds={"pretrain": result.seconds, "total": time.perf_counter() - t_start},
        threads=threads,
    )


def run_prepare(config_path: Path | None, workdir: Path, db: str | None) -> dict[str, Any]:
    """The CLI's entry point: load the config, open (or create) the ledger, prepare; a JSON-able summary.

    ``db`` defaults to ``<workdir>/ledger.db``, so ``ledger verify --db <workdir>/ledger.db`` finds the artifacts
    in ``<workdir>/artifacts`` by default.
    """
    config = load_config(config_path)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with Store.open(db if db is not None else workdir / "ledger.db", create=True) as store:
        result = prepare(config, workdir, store)
        summary = result.to_json()
        summary["db"] = store.url
    summary["artifacts_dir"] = str(workdir_root(workdir))
    return summary


# ----------------------------------------------------------------------------------------- reading back


@dataclass
class Prepared:
    """What a training arm or evaluator needs from a prepare receipt, loaded from re-hashed artifacts."""

    receipt: Receipt
    config: ExperimentConfig
    tokenizer: CharTokenizer | HFTokenizer
    train: list[tasks.Document]
    seed_checkpoint: Path
    pretrain_corpus: list[dict[str, Any]]  # its records (fine-tuning mixes in windows of their stream)

    def stream(self) -> corpus.Stream:
        """The seed's pretraining token stream, rebuilt from the corpus and the tokenizer."""
        return corpus.build_stream(self.pretrain_corpus, self.tokenizer)


def load_prepared(store: Store, arts: ArtifactStore, prepared: str) -> Prepared:
    """Load the prepare receipt with this ``prepared`` digest and its artifacts (each re-hashed on read)."""
    found = [s.receipt for s in store.find(kind="prepare", prepared=prepared)]
    if not found:
        raise UnknownExperiment(prepared)
    receipt = found[0]
    a = receipt.artifacts
    config = config_from_bytes(read_artifact(arts, a["config"], name="config"))
    tokenizer = tokenizer_from_json(read_json(arts, a["tokenizer"], name="tokenizer"))
    train = [tasks.Document.from_json(r) for r in read_jsonl(arts, a["train_data"], name="train_data")]
    records = read_jsonl(arts, a["pretrain_corpus"], name="pretrain_corpus")
    ckpt = arts.locate(a["seed_state"], store.evidence_locations(receipt.id, "seed_state", a["seed_state"]),
                       name="seed checkpoint", directory=True)
    return Prepared(receipt, config, tokenizer, train, ckpt, records)


def load_selection(store: Store, arts: ArtifactStore, selection: str) -> tuple[list[tasks.Document], list[Any]]:
    """The evaluation documents and retention probes of the selection receipt with this digest."""
    found = [s.receipt for s in store.find(kind="selection", selection=selection)]
    if not found:
        raise InputError(f"no selection receipt with selection digest {selection}")
    a = found[0].artifacts
    docs = [tasks.Document.from_json(r) for r in read_jsonl(arts, a["eval_selection"], name="eval_selection")]
    probes = read_jsonl(arts, a["retention_probes"], name="retention_probes")
    return docs, probes


__all__ = [
    "PrepareResult",
    "Prepared",
    "corpus_text",
    "load_model_weights",
    "load_prepared",
    "load_selection",
    "prepare",
    "pretrain",
    "retention_probes",
    "run_prepare",
]
