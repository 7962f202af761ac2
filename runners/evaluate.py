"""Evaluate the seed and every trained arm on the selection; compare them pairwise; judge the quality contract.

For each model (the seed: the prepare receipt's ``seed_state``; an arm: its rank 0 ``train-end`` checkpoint):

* greedy decoding after ``BOS + prompt`` for at most ``eval.max_new_tokens`` tokens, batched by prompt length
  (:func:`verify.evaluation.batch_plan`), with the intra-op thread count pinned and recorded; a document is correct
  when the model stops (EOS) and its tokens are exactly the answer's;
* the mean next-token NLL of each retention probe;
* an ``eval`` receipt citing the selection receipt and the model's source receipt, with the outcomes (one row per
  document, canonical JSONL) and the retention losses (exact floats) as artifacts.

Then paired ``comparison`` receipts (each arm against the seed, with retention; the primary arm against the
baseline arm and against single) and a ``quality`` receipt judging the pre-registered contract. Every record is
defined in :mod:`verify.evaluation` and every statistic in :mod:`verify.statistics`, the modules the verifier uses.

Receipts carry no timings, so evaluating the same models again gives the same receipt ids and appends nothing.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ledger.artifacts import ArtifactStore, put_jsonl, read_artifact, read_jsonl, workdir_root
from ledger.errors import InputError, UnknownExperiment
from ledger.experiment.config import ARMS, ExperimentConfig, config_from_bytes, single_rank_arm
from ledger.experiment.tokenizer import Tokenizer, tokenizer_from_bytes
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners import numerics
from runners.model import CausalLM, HFCausalLM, TinyLM, build_model, greedy_generate, sequence_nll
from runners.prepare import pinned_threads
from verify import evaluation as ev
from verify import statistics as st

Progress = Callable[[str], None]


# ------------------------------------------------------------------------------------------------ scoring


@dataclass
class Scored:
    outcomes: list[dict[str, Any]]
    retention: list[dict[str, Any]]
    seconds: float


def score(model: CausalLM, tokenizer: Tokenizer, documents: Sequence[Mapping[str, Any]],
          probes: Sequence[Mapping[str, Any]], *, max_new_tokens: int, batch_size: int) -> Scored:
    """Outcome rows of ``documents`` (selection records) and retention rows of ``probes``; deterministic.

    Each batch of :func:`verify.evaluation.batch_plan` is one call, so re-scoring a batch reproduces its bits.
    The caller pins the thread count.
    """
    started = time.perf_counter()
    if isinstance(model, torch.nn.Module):
        model.eval()
    prompts = [tokenizer.encode(d["prompt"], bos=True) for d in documents]
    outcomes: list[dict[str, Any] | None] = [None] * len(documents)
    with torch.inference_mode():
        for batch in ev.batch_plan([len(p) for p in prompts], batch_size):
            outs = greedy_generate(model, [prompts[i] for i in batch], eos_id=tokenizer.eos_id,
                                   max_new_tokens=max_new_tokens, batch_size=len(batch))
            for i, out in zip(batch, outs, strict=True):
                doc = documents[i]
                outcomes[i] = ev.outcome_row(doc, out, len(out) < max_new_tokens, tokenizer.decode(out),
                                             tokenizer.encode(doc["answer"]))
        ids = [tokenizer.encode(p["text"]) for p in probes]
        nll: list[float] = [0.0] * len(ids)
        for batch in ev.batch_plan([len(x) for x in ids], batch_size):
            values = sequence_nll(model, [ids[i] for i in batch], batch_size=len(batch))
            for i, value in zip(batch, values, strict=True):
                nll[i] = value
    retention = [ev.retention_row(i, p, len(ids[i]) - 1, nll[i]) for i, p in enumerate(probes)]
    return Scored([o for o in outcomes if o is not None], retention, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------- ledger inputs


@dataclass
class EvalInputs:
    """The prepared experiment as evaluation needs it, every artifact re-hashed on read."""

    prepare: Receipt
    selection: Receipt
    contract: Receipt | None
    config: ExperimentConfig
    tokenizer: Tokenizer
    documents: list[dict[str, Any]]
    probes: list[dict[str, Any]]
    artifacts: ArtifactStore

    @property
    def prepared(self) -> str:
        assert self.prepare.prepared is not None
        return self.prepare.prepared


def load_inputs(store: Store, artifacts: ArtifactStore, prepared: str | None = None) -> EvalInputs:
    """The latest prepare receipt (or the one with ``prepared``), its selection and contract, and their bytes."""
    found = store.find(kind="prepare", prepared=prepared)
    if not found:
        raise UnknownExperiment(prepared)
    prep = found[-1].receipt
    selections = store.find(kind="selection", prepared=prep.prepared)
    if not selections:
        raise InputError(f"no selection receipt for prepared digest {prep.prepared}")
    sel = selections[-1].receipt
    contracts = store.find(kind="contract", prepared=prep.prepared)
    config = config_from_bytes(read_artifact(artifacts, prep.artifacts["config"], name="config"))
    tokenizer = tokenizer_from_bytes(read_artifact(artifacts, prep.artifacts["tokenizer"], name="tokenizer"))
    documents = read_jsonl(artifacts, sel.artifacts["eval_selection"], name="eval_selection")
    probes = read_jsonl(artifacts, sel.artifacts["retention_probes"], name="retention_probes")
    return EvalInputs(prep, sel, contracts[-1].receipt if contracts else None, config, tokenizer, documents, probes,
                      artifacts)


def trained_arms(store: Store, prepared: str) -> dict[str, Receipt]:
    """Each arm's final model: the rank 0 ``train-end`` receipt of its run.

    An arm's run is the one its ``arm-summary`` names (``train/<arm>`` preferred when several, e.g. a recovered
    run of the same arm, which must hold the same state); without a summary, the latest rank 0 train-end whose
    measurements name the arm.
    """
    out: dict[str, Receipt] = {}
    summaries: dict[str, list[Receipt]] = {}
    for s in store.find(kind="arm-summary", prepared=prepared):
        summaries.setdefault(str(s.receipt.measurements.get("arm")), []).append(s.receipt)
    ends = [s.receipt for s in store.find(kind="train-end", prepared=prepared, rank=0)]
    for arm in ARMS:
        candidates = summaries.get(arm, [])
        preferred = [s for s in candidates if s.run == f"train/{arm}"] or candidates
        if preferred:
            summary = preferred[-1]
            end = next((e for e in reversed(ends) if e.id in summary.parents and e.run == summary.run), None)
        else:
            end = next((e for e in reversed(ends) if e.measurements.get("arm") == arm), None)
        if end is not None:
            out[arm] = end
    return out


def load_model(checkpoint: Path, config: ExperimentConfig, vocab_size: int, *, state: str, model: str,
               receipt: str | None = None) -> TinyLM | HFCausalLM:
    """The model of a checkpoint directory, after verifying every file against its manifest and the state and
    model digests against the receipt's (torch-free, by :func:`ledger.state.verify_checkpoint`); never unpickles."""
    from safetensors.torch import load_file

    from ledger.state import component_of_file, verify_checkpoint

    verify_checkpoint(checkpoint, expected_state=state, expected_components={"model": model}, receipt=receipt)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.iterdir()):
        if f.suffix == ".safetensors" and component_of_file(f) == "model":
            tensors.update(load_file(str(f)))
    net = build_model(config.model, vocab_size, 0)  # the initial weights are all replaced just below
    net.load_state_dict(tensors, strict=True)
    net.eval()
    return net


# ------------------------------------------------------------------------------------------------ receipts


def settings(config: ExperimentConfig, threads: int) -> dict[str, Any]:
    """How the evaluation ran: pre-registered decoding settings plus the pinned threads and software."""
    return {
        "decoding": "greedy",
        "match": "exact",
        "max_new_tokens": config.eval.max_new_tokens,
        "batch_size": config.eval.batch_size,
        "threads": threads,
        "cpu": numerics.describe(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def evaluate_model(store: Store, inputs: EvalInputs, arm: str, source: Receipt, *, threads: int = 1,
                   reuse: bool = True) -> tuple[Receipt, float | None]:
    """Score the model of ``source`` (a prepare or rank 0 train-end receipt) and append its eval receipt.

    With ``reuse``, an eval of the same source, selection and settings already in the ledger is returned instead
    (evaluation is deterministic). Returns (receipt, seconds spent scoring, None when reused).
    """
    want = settings(inputs.config, threads)
    if reuse:
        for s in reversed(store.find(kind="eval", prepared=inputs.prepared, selection=inputs.selection.selection)):
            r = s.receipt
            if source.id in r.parents and r.measurements.get("settings") == want and r.measurements.get("arm") == arm:
                return r, None
    state = source.artifacts["seed_state"] if source.kind == "prepare" else source.artifacts["state"]
    name = "seed_state" if source.kind == "prepare" else "state"
    checkpoint = inputs.artifacts.locate(state, store.evidence_locations(source.id, name, state), name=name,
                                         directory=True)
    model_digest = source.artifacts["model"]
    with pinned_threads(threads):
        model = load_model(checkpoint, inputs.config, inputs.tokenizer.vocab_size, state=state, model=model_digest,
                           receipt=source.id)
        scored = score(model, inputs.tokenizer, inputs.documents, inputs.probes,
                       max_new_tokens=inputs.config.eval.max_new_tokens, batch_size=inputs.config.eval.batch_size)
    # The model component's bytes live in the checkpoint directory: record it, so `ledger verify` re-hashes the
    # model an eval names (not only the whole state).
    store.add_location(model_digest, str(checkpoint.resolve()))
    arts = inputs.artifacts
    receipt = make_receipt(
        "eval",
        run=f"eval/{arm}",
        step=source.step,
        prepared=inputs.prepared,
        selection=inputs.selection.selection,
        parents=[inputs.selection, source],
        artifacts={"model": model_digest, "state": state, "outcomes": put_jsonl(arts, scored.outcomes),
                   "retention": put_jsonl(arts, scored.retention)},
        measurements=ev.eval_measurements(arm, scored.outcomes, scored.retention, want),
    )
    store.append(receipt)
    return receipt, scored.seconds


def _rows(inputs: EvalInputs, r: Receipt) -> tuple[Receipt, list[dict[str, Any]], list[dict[str, Any]]]:
    arts = inputs.artifacts
    return (r, read_jsonl(arts, r.artifacts["outcomes"], name="outcomes"),
            read_jsonl(arts, r.artifacts["retention"], name="retention"))


def compare(store: Store, inputs: EvalInputs, name: str, baseline: Receipt, candidate: Receipt) -> Receipt:
    """Append the paired comparison ``name`` of two eval receipts (retention too when the baseline is the seed)."""
    measurements = ev.comparison_measurements(name, _rows(inputs, baseline), _rows(inputs, candidate),
                                              with_retention=baseline.measurements["arm"] == st.SEED)
    receipt = make_receipt("comparison", run=f"compare/{name}", prepared=inputs.prepared,
                           selection=inputs.selection.selection, parents=[baseline, candidate],
                           measurements=measurements)
    store.append(receipt)
    return receipt


def judge_quality(store: Store, inputs: EvalInputs, comparisons: Sequence[Receipt],
                  evals: Mapping[str, Receipt]) -> Receipt:
    """Append the quality receipt: the contract's conditions judged from ``comparisons``."""
    assert inputs.contract is not None
    measurements = ev.quality_measurements(inputs.contract, comparisons, evals, prepared=inputs.prepared,
                                           selection=str(inputs.selection.selection))
    receipt = make_receipt("quality", run="quality", prepared=inputs.prepared, selection=inputs.selection.selection,
                           parents=[inputs.contract, *comparisons], measurements=measurements)
    store.append(receipt)
    return receipt


# ----------------------------------------------------------------------------------------------- workflow


@dataclass
class EvaluationResult:
    prepared: str
    selection: str
    evals: dict[str, Receipt]
    comparisons: dict[str, Receipt]
    quality: Receipt | None
    threads: int
    seconds: dict[str, float] = field(default_factory=dict)
    missing_arms: list[str] = field(default_factory=list)  # contract arms not trained yet (no quality receipt)
    reused: list[str] = field(default_factory=list)  # models whose eval receipt was already in the ledger

    def to_json(self) -> dict[str, Any]:
        return {
            "prepared": self.prepared,
            "selection": self.selection,
            "threads": self.threads,
            "evals": {a: {"receipt": r.id, "correct": r.measurements["correct"],
                          "documents": r.measurements["documents"],
                          "mean_retention_nll": r.measurements["retention"]["mean_nll"]}
                      for a, r in self.evals.items()},
            "comparisons": {n: {"receipt": r.id, **{k: r.measurements[k] for k in st.PAIRED_FIELDS},
                                **({"retention": r.measurements["retention"]} if "retention" in r.measurements
                                   else {})}
                            for n, r in self.comparisons.items()},
            "quality": None if self.quality is None else {
                "receipt": self.quality.id,
                "quality_contract_passed": self.quality.measurements["quality_contract_passed"],
                "conditions": self.quality.measurements["conditions"],
                "missing_arms": self.quality.measurements["missing_arms"],
            },
            "missing_arms": list(self.missing_arms),
            "reused": list(self.reused),
            "seconds": dict(self.seconds),
        }


def evaluate_experiment(store: Store, artifacts: ArtifactStore, *, prepared: str | None = None, threads: int = 1,
                        progress: Progress | None = None) -> EvaluationResult:
    """Evaluate the seed and every trained arm found in the ledger, compare them, and judge the quality contract
    (when the contract receipt exists)."""
    total = time.perf_counter()
    inputs = load_inputs(store, artifacts, prepared)
    sources: dict[str, Receipt] = {st.SEED: inputs.prepare, **trained_arms(store, inputs.prepared)}
    evals: dict[str, Receipt] = {}
    seconds: dict[str, float] = {}
    reused: list[str] = []
    for arm, source in sources.items():
        if progress:
            progress(f"evaluating {arm}")
        evals[arm], spent = evaluate_model(store, inputs, arm, source, threads=threads)
        if spent is None:
            reused.append(arm)
        else:
            seconds[f"eval/{arm}"] = spent
    comparisons: dict[str, Receipt] = {}
    pairs: list[tuple[str, str]] = [(st.SEED, arm) for arm in ARMS if arm in evals]
    primary = inputs.contract.measurements["primary_arm"] if inputs.contract else inputs.config.contract.primary_arm
    baseline = inputs.contract.measurements["baseline_arm"] if inputs.contract else inputs.config.contract.baseline_arm
    pairs += [(baseline, primary), (single_rank_arm(), primary)]
    for b, c in pairs:
        name = ev.comparison_name(b, c, primary, baseline)
        if name is None or b not in evals or c not in evals or name in comparisons:
            continue
        comparisons[name] = compare(store, inputs, name, evals[b], evals[c])
    # The contract is judged once every arm it names has been evaluated (a partial experiment cannot pass it).
    missing = [a for a in (inputs.contract.measurements["arms"] if inputs.contract else []) if a not in evals]
    quality = None
    if inputs.contract is not None and not missing:
        quality = judge_quality(store, inputs, list(comparisons.values()), evals)
    seconds["total"] = time.perf_counter() - total
    return EvaluationResult(inputs.prepared, str(inputs.selection.selection), evals, comparisons, quality, threads,
                            seconds, missing, reused)


def run_evaluation(workdir: Path, db: str, *, prepared: str | None = None, threads: int = 1,
                   progress: Progress | None = None) -> EvaluationResult:
    """The CLI's entry point: open the ledger and evaluate into ``<workdir>/artifacts``."""
    with Store.open(db) as store:
        return evaluate_experiment(store, ArtifactStore(workdir_root(workdir)), prepared=prepared,
                                   threads=threads, progress=progress)


__all__ = [
    "EvalInputs",
    "EvaluationResult",
    "Scored",
    "compare",
    "evaluate_experiment",
    "evaluate_model",
    "judge_quality",
    "load_inputs",
    "run_evaluation",
    "score",
    "settings",
    "trained_arms",
]
