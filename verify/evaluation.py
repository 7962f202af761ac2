"""Evaluation records and their verification: ladder level 4 (statistics) and re-scoring (level 5 for evals).

This module defines what the eval runner writes (outcome and retention rows, eval/comparison/quality measurements)
and recomputes all of it from the stored artifacts. The formats are specified in docs/statistics.md.

* An ``eval`` receipt: every outcome row must agree with its selection document (digests of prompt and output,
  the decoded text, ``correct`` = the model stopped and its tokens are exactly the answer's); then the outcomes
  file must hash to the receipt's digest; then every measurement (counts, breakdowns, mean retention loss) must
  recompute. An inconsistent row fails naming its document.
* A paired ``comparison``: every field recomputes from the two cited evals' outcomes and retention losses.
* A ``quality`` receipt: every condition and the whole learning section recompute from the contract's thresholds,
  the cited comparisons and their evals.
* :func:`rescore` re-executes the model on a random sample of documents (and retention probes) from the checkpoint
  and fails naming the first document whose stored outcome differs: it proves the outcomes themselves, which a
  consistent forgery of outcomes and receipt would otherwise pass.

Nothing here imports torch: :func:`rescore` runs the model through a :class:`~verify.context.ModelRunner` that
the CLI hands in (runners/reexecute.py), so ``ledger verify`` stays fast and verify never imports a runner.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.errors import (
    DigestMismatch,
    InputError,
    MeasurementMismatch,
    MissingArtifact,
    RecordInvalid,
    ReexecutionMismatch,
    VerificationError,
)
from ledger.experiment.config import single_rank_arm
from ledger.experiment.formats import COMPARISON_METHOD, EVAL_FORMAT, QUALITY_FORMAT
from ledger.receipts import Receipt, a_kind
from ledger.store import Store
from verify import statistics as st
from verify.context import KindCheckContext, LoadedModel, Memo, ModelRunner

OUTCOME_KEYS: Final = frozenset({"document", "family", "variant", "prompt", "output", "output_text", "tokens",
                                 "stopped", "correct"})
RETENTION_KEYS: Final = frozenset({"probe", "document", "tokens", "nll"})
FLOAT_RTOL: Final = 1e-12  # recomputed floats must agree to this relative tolerance (libm may differ by an ulp)
NLL_TOLERANCE: Final = 1e-5  # re-executed retention losses (nats/token) may differ this much across CPUs/builds


# ------------------------------------------------------------------------------------------------- records


text_digest = digests.text_digest


def outcome_row(document: Mapping[str, Any], tokens: Sequence[int], stopped: bool, decoded: str,
                answer_tokens: Sequence[int]) -> dict[str, Any]:
    """One document's outcome. ``tokens``: the greedy continuation without EOS; ``stopped``: EOS came within the
    token budget; ``correct``: stopped and the tokens are exactly the answer's."""
    return {
        "document": document["document"],
        "family": document["family"],
        "variant": document["variant"],
        "prompt": text_digest(document["prompt"]),
        "output": text_digest(decoded),
        "output_text": decoded,
        "tokens": [int(t) for t in tokens],
        "stopped": bool(stopped),
        "correct": bool(stopped) and list(tokens) == list(answer_tokens),
    }


def retention_row(index: int, probe: Mapping[str, Any], scored_tokens: int, nll: float) -> dict[str, Any]:
    """One retention probe's mean next-token NLL (nats/token) over ``scored_tokens`` predictions, as an exact float."""
    return {"probe": index, "document": probe["document"], "tokens": scored_tokens, "nll": float(nll)}


def batch_plan(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The batches an evaluation runs: indices grouped by length (shortest first), then chunks of ``batch_size``
    in index order. Re-scoring re-runs exactly these batches, so its floats are those of the original run."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    return [group[s : s + batch_size] for n in sorted(by_len) for group in [by_len[n]]
            for s in range(0, len(group), batch_size)]


def eval_measurements(arm: str, rows: Sequence[Mapping[str, Any]], retention: Sequence[Mapping[str, Any]],
                      settings: Mapping[str, Any]) -> dict[str, Any]:
    """An eval receipt's measurements, all recomputable from its outcome and retention rows (plus the settings)."""
    return {
        "format": EVAL_FORMAT,
        "arm": arm,
        "documents": len(rows),
        "correct": sum(1 for r in rows if r["correct"]),
        "breakdowns": st.breakdowns(rows),
        "retention": {"probes": len(retention), "mean_nll": st.exact_mean([r["nll"] for r in retention])},
        "settings": dict(settings),
    }


Rows = Sequence[Mapping[str, Any]]


def comparison_measurements(name: str, baseline: tuple[Receipt, Rows, Rows], candidate: tuple[Receipt, Rows, Rows],
                            *, with_retention: bool) -> dict[str, Any]:
    """A paired comparison of two evals (receipt, outcome rows, retention rows) on the same documents."""
    (b_eval, b_rows, b_ret), (c_eval, c_rows, c_ret) = baseline, candidate
    if len(b_rows) != len(c_rows):
        raise InputError(f"paired evals have {len(b_rows)} and {len(c_rows)} outcome rows")
    for i, (b, c) in enumerate(zip(b_rows, c_rows, strict=True)):
        if b["document"] != c["document"]:
            raise InputError(f"paired evals differ at row {i}: document {b['document']} vs {c['document']}")
    out: dict[str, Any] = {
        "method": COMPARISON_METHOD,
        "comparison": name,
        "baseline": {"arm": b_eval.measurements["arm"], "eval": b_eval.id},
        "candidate": {"arm": c_eval.measurements["arm"], "eval": c_eval.id},
        **st.paired_comparison([bool(r["correct"]) for r in b_rows], [bool(r["correct"]) for r in c_rows]),
    }
    if with_retention:
        if [r["document"] for r in b_ret] != [r["document"] for r in c_ret]:
            raise InputError("paired evals scored different retention probes")
        out["retention"] = st.retention_statistics([r["nll"] for r in b_ret], [r["nll"] for r in c_ret])
    return out


def comparison_name(baseline_arm: str, candidate_arm: str, primary_arm: str, baseline_of_primary: str) -> str | None:
    """The reference report's name for a comparison, or None if the experiment makes no such comparison."""
    if baseline_arm == st.SEED and candidate_arm != st.SEED:
        return st.vs_seed(candidate_arm)
    if candidate_arm == primary_arm and baseline_arm == baseline_of_primary and primary_arm != baseline_arm:
        return st.LOCAL_VS_BASELINE
    single = single_rank_arm()
    if candidate_arm == primary_arm and baseline_arm == single and primary_arm != single:
        return st.LOCAL_VS_SINGLE
    return None


def quality_measurements(contract: Receipt, comparisons: Iterable[Receipt], evals: Mapping[str, Receipt],
                         *, prepared: str, selection: str) -> dict[str, Any]:
    """The quality receipt's measurements: each pre-registered condition {passed, figure, threshold, rule}, the
    verdict, and the reference report's learning section."""
    cm = contract.measurements
    arms = list(cm["arms"])
    by_name = {c.measurements["comparison"]: c.measurements for c in comparisons}
    conditions = st.quality_conditions(cm["quality"], arms, by_name)
    order = [st.SEED, *arms]
    learning = st.learning_section(
        prepared=prepared, selection=selection, primary_arm=cm["primary_arm"], arms=arms,
        eval_breakdowns={a: evals[a].measurements["breakdowns"] for a in order if a in evals},
        comparisons=by_name, conditions=conditions)
    return {
        "format": QUALITY_FORMAT,
        "primary_arm": cm["primary_arm"],
        "baseline_arm": cm["baseline_arm"],
        "arms": arms,
        "missing_arms": [a for a in arms if st.vs_seed(a) not in by_name],
        "conditions": conditions,
        "quality_contract_passed": learning["quality_contract_passed"],
        "learning": learning,
    }


# ------------------------------------------------------------------------------------------- reading bytes


def find_bytes(store: Store, artifacts: ArtifactStore, digest: str,
               memo: Memo | None = None) -> tuple[bytes, Path] | None:
    """The bytes of an artifact wherever they are found (content-addressed path, then recorded locations),
    without checking their digest yet; None if nowhere. With a ``memo``, the ledger is asked once per digest."""
    recorded = (memo.once(("locations", digest), lambda: store.locations(digest)) if memo is not None
                else store.locations(digest))
    try:
        path = artifacts.locate(digest, recorded, directory=False)
    except MissingArtifact:
        return None
    return path.read_bytes(), path


def _read(store: Store, artifacts: ArtifactStore, r: Receipt, name: str, require: bool,
          memo: Memo | None = None) -> bytes | None:
    """Artifact ``name`` of ``r``, digest-checked; None if absent and not required."""
    digest = r.artifacts.get(name)
    if digest is None:
        raise RecordInvalid.at(f"receipt {r.id}: {a_kind(r.kind)} receipt names its {name} in artifacts.{name}",
                                receipt=r.id, field=f"artifacts.{name}", expected="a digest", actual=None)
    found = find_bytes(store, artifacts, digest, memo)
    if found is None:
        if require:
            raise MissingArtifact(digest, f"{name} of receipt {r.id}", str(artifacts.root))
        return None
    data, path = found
    actual = digests.raw_digest(data)
    if actual != digest:
        raise DigestMismatch(f"artifact {name!r} at {path}", expected=digest, actual=actual, receipt=r.id,
                             field=f"artifacts.{name}")
    return data


def _jsonl(data: bytes, r: Receipt, name: str) -> list[Any]:
    from ledger.artifacts import parse_jsonl

    if data.endswith(b"\n"):  # every line at once; anything doubtful is parsed line by line, for its error
        values = digests.parse_canonical_lines(data.split(b"\n")[:-1])
        if values is not None:
            return values
    try:
        return parse_jsonl(data, source=f"artifact {name} of receipt {r.id}")
    except InputError as exc:
        raise RecordInvalid.at(f"receipt {r.id}: {exc.one_line()}", receipt=r.id, field=f"artifacts.{name}",
                               expected="canonical JSONL", actual=exc.one_line()) from exc


@dataclass
class EvalInputs:
    """What checking an eval needs from its ancestry: documents, probes, tokenizer and the pre-registered config."""

    selection: Receipt
    prepare: Receipt
    documents: list[dict[str, Any]]
    probes: list[dict[str, Any]]
    tokenizer: Any  # ledger.experiment.tokenizer.Tokenizer (character or Hugging Face)
    config: Any  # ledger.experiment.config.ExperimentConfig


def _ancestor(closure: Mapping[str, Receipt], r: Receipt, kind: str) -> Receipt:
    found = [closure[p] for p in r.parents if p in closure and closure[p].kind == kind]
    if len(found) != 1:
        raise RecordInvalid.at(f"receipt {r.id}: expected one {kind} parent, found {len(found)}", receipt=r.id,
                                field="parents", expected=1, actual=len(found))
    return found[0]


def _prepare_of(closure: Mapping[str, Receipt], r: Receipt) -> Receipt:
    found = [p for p in closure.values() if p.kind == "prepare" and p.prepared == r.prepared]
    if len(found) != 1:
        raise RecordInvalid.at(f"receipt {r.id}: its ancestry holds {len(found)} prepare receipts of its prepared "
                                "digest", receipt=r.id, field="prepared", expected=1, actual=len(found))
    return found[0]


def load_inputs(store: Store, artifacts: ArtifactStore, closure: Mapping[str, Receipt], r: Receipt,
                require: bool, memo: Memo | None = None) -> EvalInputs | None:
    """Selection documents, probes, tokenizer and config of eval ``r``, re-hashed; None if bytes are missing.
    With a ``memo``, the inputs of one selection and prepare receipt are read and checked once (every eval of an
    experiment shares them)."""
    selection = _ancestor(closure, r, "selection")
    prepare = _prepare_of(closure, r)
    if memo is None:
        return _load_inputs(store, artifacts, selection, prepare, require, None)
    return memo.once(("eval inputs", selection.id, prepare.id, require),
                     lambda: _load_inputs(store, artifacts, selection, prepare, require, memo))


def _load_inputs(store: Store, artifacts: ArtifactStore, selection: Receipt, prepare: Receipt, require: bool,
                 memo: Memo | None) -> EvalInputs | None:
    from ledger.experiment.config import config_from_bytes
    from ledger.experiment.tokenizer import tokenizer_from_bytes

    parts = {}
    for owner, name in ((selection, "eval_selection"), (selection, "retention_probes"), (prepare, "tokenizer"),
                        (prepare, "config")):
        data = _read(store, artifacts, owner, name, require, memo)
        if data is None:
            return None
        parts[name] = data
    documents = _jsonl(parts["eval_selection"], selection, "eval_selection")
    for i, d in enumerate(documents):
        if not isinstance(d, dict) or digests.document_digest({k: d.get(k) for k in digests.DOCUMENT_KEYS}) != d.get(
                "document"):
            raise RecordInvalid.at(f"receipt {selection.id}: selection document {i} does not recompute its digest",
                                    receipt=selection.id, field="artifacts.eval_selection",
                                    expected=d.get("document") if isinstance(d, dict) else "a document record",
                                    actual=digests.document_digest({k: d.get(k) for k in digests.DOCUMENT_KEYS})
                                    if isinstance(d, dict) else d)
    return EvalInputs(selection, prepare, documents, _jsonl(parts["retention_probes"], selection, "retention_probes"),
                      tokenizer_from_bytes(parts["tokenizer"]), config_from_bytes(parts["config"]))


# ---------------------------------------------------------------------------------------- comparing values


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= FLOAT_RTOL * max(abs(a), abs(b))


def first_difference(expected: Any, actual: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first path where ``actual`` differs from ``expected`` (floats within FLOAT_RTOL), or None."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            sub = f"{path}.{key}" if path else key
            if key not in expected or key not in actual:
                return sub, expected.get(key, "absent"), actual.get(key, "absent")
            found = first_difference(expected[key], actual[key], sub)
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return f"{path}.length", len(expected), len(actual)
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            found = first_difference(e, a, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(expected) is float and type(actual) is float:
        return None if _close(expected, actual) else (path, expected, actual)
    if type(expected) is not type(actual) or expected != actual:
        return path, expected, actual
    return None


def check_measurements(r: Receipt, expected: Mapping[str, Any], what: str) -> None:
    """Raise naming the first measurement of ``r`` that does not recompute."""
    found = first_difference(dict(expected), dict(r.measurements))
    if found is not None:
        where, exp, act = found
        raise MeasurementMismatch.at(f"receipt {r.id}: {what}: measurements.{where} recomputes to {exp!r}, the receipt "
                                f"says {act!r}", receipt=r.id, field=f"measurements.{where}", expected=exp, actual=act)


# ---------------------------------------------------------------------------------------------- eval check


Problem = tuple[str, Any, Any]  # (field, expected, actual)


def _row_problem(i: int, row: Any, doc: Mapping[str, Any], tok: Any, max_new_tokens: int) -> Problem | None:
    """(field, expected, actual) of the first inconsistency of outcome row ``i`` with its document, or None."""
    if not isinstance(row, dict) or set(row) != OUTCOME_KEYS:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        return "keys", sorted(OUTCOME_KEYS), keys
    for key in ("document", "family", "variant"):
        if row[key] != doc[key]:
            return key, doc[key], row[key]
    if row["prompt"] != text_digest(doc["prompt"]):
        return "prompt", text_digest(doc["prompt"]), row["prompt"]
    tokens = row["tokens"]
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < tok.vocab_size and t != tok.eos_id
                                               for t in tokens):
        return "tokens", f"token ids in [0, {tok.vocab_size}) other than EOS", tokens
    if len(tokens) > max_new_tokens:
        return "tokens", f"at most {max_new_tokens} tokens", len(tokens)
    if row["stopped"] is not (len(tokens) < max_new_tokens):
        return "stopped", len(tokens) < max_new_tokens, row["stopped"]
    if row["output_text"] != tok.decode(tokens):
        return "output_text", tok.decode(tokens), row["output_text"]
    if row["output"] != text_digest(row["output_text"]):
        return "output", text_digest(row["output_text"]), row["output"]
    correct = row["stopped"] and tokens == tok.encode(doc["answer"])
    if row["correct"] is not correct:
        return "correct", correct, row["correct"]
    return None


def _outcome_error(r: Receipt, i: int, doc: Mapping[str, Any], problem: tuple[str, Any, Any]) -> VerificationError:
    key, exp, act = problem
    return RecordInvalid.at(
        f"receipt {r.id}: outcome of document {doc['document']} ({doc['family']}/{doc['variant']}, row {i}): "
        f"{key} should be {exp!r}, the outcomes file says {act!r}",
        receipt=r.id, field=f"outcomes[{doc['document']}].{key}", expected=exp, actual=act)


@dataclass
class EvalRecord:
    """An eval receipt with its verified rows."""

    receipt: Receipt
    rows: list[dict[str, Any]]
    retention: list[dict[str, Any]]


def check_eval(store: Store, artifacts: ArtifactStore, closure: Mapping[str, Receipt], r: Receipt,
               require: bool = False, memo: Memo | None = None) -> EvalRecord | None:
    """Verify eval ``r`` from its outcome and retention artifacts (see the module docstring); None when bytes it
    needs are missing and not ``require``d. With a ``memo``, each eval is checked once (its own check and every
    comparison citing it share the result)."""
    if memo is None:
        return _check_eval(store, artifacts, closure, r, require, None)
    # What the check reads beyond the eval's ancestry: the prepare receipts of its digest in the closure.
    prepares = tuple(p.id for p in closure.values() if p.kind == "prepare" and p.prepared == r.prepared)
    return memo.once(("eval", r.id, prepares, require),
                     lambda: _check_eval(store, artifacts, closure, r, require, memo))


def _check_eval(store: Store, artifacts: ArtifactStore, closure: Mapping[str, Receipt], r: Receipt, require: bool,
                memo: Memo | None) -> EvalRecord | None:
    m = r.measurements
    if m.get("format") != EVAL_FORMAT:
        raise RecordInvalid.at(f"receipt {r.id}: eval measurements.format is {m.get('format')!r}, not "
                                f"{EVAL_FORMAT!r}", receipt=r.id, field="measurements.format", expected=EVAL_FORMAT,
                                actual=m.get("format"))
    _check_source(closure, r)
    inputs = load_inputs(store, artifacts, closure, r, require, memo)
    if inputs is None:
        return None
    settings = m.get("settings") or {}
    cfg = inputs.config.eval
    for key, value in (("max_new_tokens", cfg.max_new_tokens), ("batch_size", cfg.batch_size)):
        if settings.get(key) != value:
            raise RecordInvalid.at(f"receipt {r.id}: eval settings.{key} {settings.get(key)!r} is not the "
                                    f"pre-registered {value!r}", receipt=r.id, field=f"measurements.settings.{key}",
                                    expected=value, actual=settings.get(key))
    # Rows first, even from a file that no longer hashes to its digest, so that an edited outcome is named by its
    # document; then the digest; then the statistics.
    digest = r.artifacts.get("outcomes")
    found = find_bytes(store, artifacts, digest, memo) if digest else None
    if found is None:
        _read(store, artifacts, r, "outcomes", require, memo)  # raises if required (or the name is absent)
        return None
    data, path = found
    rows = _jsonl(data, r, "outcomes")
    docs = inputs.documents
    for i, doc in enumerate(docs):
        if i >= len(rows):
            raise RecordInvalid.at(f"receipt {r.id}: the outcomes file has no row for document {doc['document']} "
                                    f"(row {i})", receipt=r.id, field=f"outcomes[{doc['document']}]",
                                    expected=len(docs), actual=len(rows))
        problem = _row_problem(i, rows[i], doc, inputs.tokenizer, cfg.max_new_tokens)
        if problem is not None:
            raise _outcome_error(r, i, doc, problem)
    if len(rows) != len(docs):
        raise RecordInvalid.at(f"receipt {r.id}: the outcomes file has {len(rows)} rows for {len(docs)} documents",
                                receipt=r.id, field="artifacts.outcomes", expected=len(docs), actual=len(rows))
    actual = digests.raw_digest(data)
    if actual != digest:
        raise DigestMismatch(f"artifact 'outcomes' at {path}", expected=str(digest), actual=actual, receipt=r.id,
                             field="artifacts.outcomes")
    retention_bytes = _read(store, artifacts, r, "retention", require, memo)
    if retention_bytes is None:
        return None
    retention = _jsonl(retention_bytes, r, "retention")
    _check_retention_rows(r, retention, inputs.probes, inputs.tokenizer)
    check_measurements(r, eval_measurements(m.get("arm", ""), rows, retention, settings), "eval")
    return EvalRecord(r, rows, retention)


def _check_source(closure: Mapping[str, Receipt], r: Receipt) -> None:
    """The evaluated model is the seed (a prepare receipt) or an arm's final model (its rank 0 train-end)."""
    arm = r.measurements.get("arm")
    source = next((closure[p] for p in r.parents if p in closure and closure[p].kind in ("prepare", "train-end",
                                                                                          "checkpoint")), None)
    if source is None:
        return  # the chain rules already require one
    if arm == st.SEED:
        ok, expected = source.kind == "prepare", "the prepare receipt"
    else:
        ok = source.kind == "train-end" and source.rank == 0 and source.measurements.get("arm") == arm
        expected = f"the rank 0 train-end receipt of arm {arm!r}"
    if not ok:
        raise RecordInvalid.at(f"receipt {r.id}: an eval of {arm!r} must cite {expected}, it cites {source.kind} "
                                f"{source.id} (rank {source.rank}, arm {source.measurements.get('arm')!r})",
                                receipt=r.id, field="parents", expected=expected, actual=source.id)
    if r.artifacts.get("state") not in (source.artifacts.get("state"), source.artifacts.get("seed_state")):
        raise RecordInvalid.at(f"receipt {r.id}: artifacts.state is not the state of its model source {source.id}",
                                receipt=r.id, field="artifacts.state",
                                expected=source.artifacts.get("state") or source.artifacts.get("seed_state"),
                                actual=r.artifacts.get("state"))


def _check_retention_rows(r: Receipt, rows: list[Any], probes: list[Any], tok: Any) -> None:
    if len(rows) != len(probes):
        raise RecordInvalid.at(f"receipt {r.id}: the retention file has {len(rows)} rows for {len(probes)} probes",
                                receipt=r.id, field="artifacts.retention", expected=len(probes), actual=len(rows))
    for i, (row, probe) in enumerate(zip(rows, probes, strict=True)):
        expected_tokens = len(tok.encode(probe["text"])) - 1  # predictions scored: every token but the first
        bad: tuple[str, Any, Any] | None = None
        if not isinstance(row, dict) or set(row) != RETENTION_KEYS:
            bad = ("keys", sorted(RETENTION_KEYS), sorted(row) if isinstance(row, dict) else row)
        elif row["probe"] != i:
            bad = ("probe", i, row["probe"])
        elif row["document"] != probe["document"]:
            bad = ("document", probe["document"], row["document"])
        elif row["tokens"] != expected_tokens:
            bad = ("tokens", expected_tokens, row["tokens"])
        elif type(row["nll"]) is not float or not math.isfinite(row["nll"]) or row["nll"] < 0:
            bad = ("nll", "a finite non-negative float", row["nll"])
        if bad is not None:
            raise RecordInvalid.at(f"receipt {r.id}: retention of probe {probe['document']} (row {i}): {bad[0]} "
                                    f"should be {bad[1]!r}, the file says {bad[2]!r}", receipt=r.id,
                                    field=f"retention[{probe['document']}].{bad[0]}", expected=bad[1], actual=bad[2])


# ---------------------------------------------------------------------------------------- comparison check


def _cited_eval(closure: Mapping[str, Receipt], r: Receipt, role: str) -> Receipt:
    ref = r.measurements.get(role)
    rid = ref.get("eval") if isinstance(ref, dict) else None
    if rid not in r.parents or rid not in closure or closure[rid].kind != "eval":
        raise RecordInvalid.at(f"receipt {r.id}: measurements.{role}.eval must be one of its eval parents",
                                receipt=r.id, field=f"measurements.{role}.eval",
                                expected=sorted(p for p in r.parents if p in closure and closure[p].kind == "eval"),
                                actual=rid)
    return closure[rid]


def check_comparison(store: Store, artifacts: ArtifactStore, closure: Mapping[str, Receipt], r: Receipt,
                     require: bool = False, records: dict[str, EvalRecord | None] | None = None,
                     memo: Memo | None = None) -> bool:
    """Verify a paired comparison (True), or return False if its bytes are missing and not required.

    A comparison of another method (e.g. uninterrupted vs recovered state) is not this module's: True, unchecked.
    """
    if r.measurements.get("method") != COMPARISON_METHOD:
        return True
    base, cand = _cited_eval(closure, r, "baseline"), _cited_eval(closure, r, "candidate")
    if sorted({base.id, cand.id}) != list(r.parents) or base.id == cand.id:
        raise RecordInvalid.at(f"receipt {r.id}: a paired comparison cites exactly its two evals",
                                receipt=r.id, field="parents", expected=sorted({base.id, cand.id}),
                                actual=list(r.parents))
    records = {} if records is None else records
    pair = []
    for e in (base, cand):
        if e.id not in records:
            records[e.id] = check_eval(store, artifacts, closure, e, require, memo)
        rec = records[e.id]
        if rec is None:
            return False
        pair.append(rec)
    b, c = pair
    name = str(r.measurements.get("comparison"))
    expected = comparison_measurements(name, (b.receipt, b.rows, b.retention), (c.receipt, c.rows, c.retention),
                                       with_retention=b.receipt.measurements["arm"] == st.SEED)
    check_measurements(r, expected, "paired comparison")
    return True


# ------------------------------------------------------------------------------------------- quality check


def check_quality(store: Store, artifacts: ArtifactStore, closure: Mapping[str, Receipt], r: Receipt) -> None:
    """Recompute a quality receipt from its contract and comparisons (whose own figures are checked separately)."""
    contract = _ancestor(closure, r, "contract")
    comparisons = [closure[p] for p in r.parents if closure[p].kind == "comparison"]
    cm = contract.measurements
    evals: dict[str, Receipt] = {}
    names: set[str | None] = set()
    for c in comparisons:
        m = c.measurements
        if m.get("method") != COMPARISON_METHOD:
            raise RecordInvalid.at(f"receipt {r.id}: comparison {c.id} is not a paired evaluation comparison",
                                    receipt=r.id, field="parents", expected=COMPARISON_METHOD,
                                    actual=m.get("method"))
        b_arm, c_arm = m["baseline"]["arm"], m["candidate"]["arm"]
        expected_name = comparison_name(b_arm, c_arm, cm["primary_arm"], cm["baseline_arm"])
        if m.get("comparison") != expected_name:
            raise RecordInvalid.at(f"receipt {r.id}: comparison {c.id} of {c_arm} against {b_arm} is named "
                                    f"{m.get('comparison')!r}, expected {expected_name!r}", receipt=r.id,
                                    field="parents", expected=expected_name, actual=m.get("comparison"))
        if expected_name in names:
            raise RecordInvalid.at(f"receipt {r.id}: two comparisons named {expected_name!r}", receipt=r.id,
                                    field="parents", expected=f"one comparison named {expected_name!r}",
                                    actual=expected_name)
        names.add(expected_name)
        for role, arm in (("baseline", b_arm), ("candidate", c_arm)):
            e = _cited_eval(closure, c, role)
            if e.measurements.get("arm") != arm:
                raise RecordInvalid.at(f"receipt {c.id}: measurements.{role}.arm {arm!r} differs from its eval's "
                                        f"{e.measurements.get('arm')!r}", receipt=c.id,
                                        field=f"measurements.{role}.arm", expected=e.measurements.get("arm"),
                                        actual=arm)
            if evals.setdefault(arm, e).id != e.id:
                raise RecordInvalid.at(f"receipt {r.id}: its comparisons use two different evals of {arm!r}",
                                        receipt=r.id, field="parents", expected=evals[arm].id, actual=e.id)
    assert r.prepared is not None
    expected = quality_measurements(contract, comparisons, evals, prepared=r.prepared, selection=str(r.selection))
    check_measurements(r, expected, "quality contract")


# ------------------------------------------------------------------------------------------- verify hooks


def eval_check(ctx: KindCheckContext) -> list[str]:
    """An eval: rows against the selection, the outcome file's digest, every figure; re-scoring on request."""
    r = ctx.receipt  # its schema check (verify/checks.py) ran first: the format is EVAL_FORMAT
    rec = check_eval(ctx.store, ctx.artifacts, ctx.closure, r, ctx.require_artifacts, ctx.memo)
    lines = []
    if rec is None:
        lines.append(f"eval {r.id[:19]} {r.measurements.get('arm')}: outcome bytes missing, statistics not checked")
    else:
        lines.append(f"eval {r.id[:19]} {r.measurements['arm']}: {r.measurements['correct']}/"
                     f"{r.measurements['documents']} correct and every breakdown recomputed from the outcomes")
    if ctx.rescore > 0:
        if ctx.runner is None:
            raise InputError("re-scoring an eval needs a model runner (ledger verify --rescore provides one)")
        report = rescore(ctx.store, r, ctx.rescore, ctx.rescore_seed, runner=ctx.runner, artifacts=ctx.artifacts)
        lines.append(report.line())
    return lines


def comparison_check(ctx: KindCheckContext) -> list[str]:
    """A paired comparison: every statistic from the two evals' outcomes (other comparison formats: not ours)."""
    r = ctx.receipt
    if r.measurements.get("method") != COMPARISON_METHOD:
        return []
    if not check_comparison(ctx.store, ctx.artifacts, ctx.closure, r, ctx.require_artifacts, memo=ctx.memo):
        return [f"comparison {r.id[:19]} {r.measurements.get('comparison')}: outcome bytes missing, not recomputed"]
    return [f"comparison {r.id[:19]} {r.measurements['comparison']}: every statistic recomputed from the outcomes"]


def quality_check(ctx: KindCheckContext) -> list[str]:
    """A quality receipt: every condition and the learning section from the contract and the comparisons."""
    r = ctx.receipt
    check_quality(ctx.store, ctx.artifacts, ctx.closure, r)
    verdict = "passed" if r.measurements["quality_contract_passed"] else "failed"
    return [f"quality {r.id[:19]}: every condition recomputed; the quality contract {verdict}"]


# ---------------------------------------------------------------------------------------------- re-scoring


@dataclass
class RescoreReport:
    receipt: str
    arm: str
    seed: int
    sampled: list[str]  # documents drawn
    rescored: int  # documents re-executed (every document of the batches the sample fell in)
    probes: int  # retention probes re-executed
    max_nll_deviation: float
    seconds: float
    threads: int = 1
    documents: int = 0  # documents in the selection

    def line(self) -> str:
        return (f"rescored eval {self.receipt[:19]} {self.arm}: {len(self.sampled)} sampled documents "
                f"({self.rescored} re-executed) and {self.probes} retention probes match (seed {self.seed}, "
                f"max |NLL change| {self.max_nll_deviation:.1e}, {self.seconds:.1f}s)")

    def to_json(self) -> dict[str, Any]:
        return {"receipt": self.receipt, "arm": self.arm, "seed": self.seed, "sampled": self.sampled,
                "rescored": self.rescored, "probes": self.probes, "max_nll_deviation": self.max_nll_deviation,
                "seconds": self.seconds, "threads": self.threads, "documents": self.documents}


def sample_indices(count: int, n: int, seed: int) -> list[int]:
    """``n`` of ``range(count)`` drawn by a Fisher-Yates shuffle seeded with ``seed`` (randrange only), sorted."""
    rng = random.Random(seed)
    items = list(range(count))
    for i in range(count - 1, 0, -1):
        j = rng.randrange(i + 1)
        items[i], items[j] = items[j], items[i]
    return sorted(items[: max(0, min(n, count))])


def rescore(store: Store, eval_receipt: Receipt | str, n: int, seed: int, *, runner: ModelRunner,
            artifacts: ArtifactStore | None = None) -> RescoreReport:
    """Re-execute the model of an eval on ``n`` random documents (and as many retention probes) from its checkpoint.

    The sample is drawn with ``seed``; every batch a sampled document fell in is re-run exactly as the evaluation
    ran it (same batch, same threads), and every re-run outcome must equal the stored one, token for token; a
    retention loss may differ by at most NLL_TOLERANCE. Raises VerificationError naming the first document whose
    stored outcome differs.
    """
    from ledger.artifacts import default_root

    started = time.perf_counter()
    r = eval_receipt if isinstance(eval_receipt, Receipt) else store.get(eval_receipt).receipt
    if r.kind != "eval":
        raise InputError(f"receipt {r.id} is {a_kind(r.kind)} receipt; re-scoring applies to eval receipts")
    arts = artifacts if artifacts is not None else ArtifactStore(default_root(store.url))
    closure = {a.receipt.id: a.receipt for a in store.ancestors(r.id)}
    inputs = load_inputs(store, arts, closure, r, True)
    assert inputs is not None
    rows = _jsonl(_read(store, arts, r, "outcomes", True) or b"", r, "outcomes")
    retention = _jsonl(_read(store, arts, r, "retention", True) or b"", r, "retention")
    settings = r.measurements["settings"]
    tok, docs = inputs.tokenizer, inputs.documents
    if len(rows) != len(docs) or len(retention) != len(inputs.probes):
        raise RecordInvalid.at(f"receipt {r.id}: the outcome files do not cover the selection (run ledger verify)",
                                receipt=r.id, field="artifacts.outcomes",
                                expected=(len(docs), len(inputs.probes)), actual=(len(rows), len(retention)))
    checkpoint = arts.locate(r.artifacts["state"], store.locations(r.artifacts["state"]), name="checkpoint",
                             directory=True)
    threads = int(settings["threads"])
    batch_size = int(settings["batch_size"])
    max_new = int(settings["max_new_tokens"])
    prompts = [tok.encode(d["prompt"], bos=True) for d in docs]
    sampled = sample_indices(len(docs), n, seed)
    plan = batch_plan([len(p) for p in prompts], batch_size)
    wanted = set(sampled)
    batches = [b for b in plan if wanted.intersection(b)]
    rescored = 0
    max_dev = 0.0
    with runner.load(checkpoint, inputs.config, tok.vocab_size, state=r.artifacts["state"],
                     model=r.artifacts["model"], receipt=r.id, threads=threads) as model:
        for batch in batches:
            outs = model.generate([prompts[i] for i in batch], eos_id=tok.eos_id, max_new_tokens=max_new,
                                  batch_size=len(batch))
            for i, out in zip(batch, outs, strict=True):
                doc = docs[i]
                again = outcome_row(doc, out, len(out) < max_new, tok.decode(out), tok.encode(doc["answer"]))
                rescored += 1
                if again != rows[i]:
                    key = next(k for k in sorted(OUTCOME_KEYS) if again[k] != rows[i].get(k))
                    raise ReexecutionMismatch.at(
                        f"receipt {r.id}: re-scoring document {doc['document']} ({doc['family']}/{doc['variant']}) "
                        f"from checkpoint {checkpoint.name} gives {key} {again[key]!r}, the stored outcome says "
                        f"{rows[i].get(key)!r}{_paths_differ(settings, model)}", receipt=r.id,
                        field=f"outcomes[{doc['document']}].{key}",
                        expected=again[key], actual=rows[i].get(key))
        probe_ids = [tok.encode(p["text"]) for p in inputs.probes]
        probe_sample = set(sample_indices(len(probe_ids), n, seed + 1))
        probe_batches = [b for b in batch_plan([len(p) for p in probe_ids], batch_size) if probe_sample.intersection(b)]
        probes = 0
        for batch in probe_batches:
            values = model.nll([probe_ids[i] for i in batch], batch_size=len(batch))
            for i, value in zip(batch, values, strict=True):
                probes += 1
                stored = retention[i]["nll"]
                dev = abs(value - stored)
                max_dev = max(max_dev, dev)
                if not dev <= NLL_TOLERANCE:
                    probe = inputs.probes[i]
                    raise ReexecutionMismatch.at(
                        f"receipt {r.id}: re-scoring retention probe {probe['document']} (row {i}) gives NLL "
                        f"{value!r}, the stored value is {stored!r}{_paths_differ(settings, model)}", receipt=r.id,
                        field=f"retention[{probe['document']}].nll", expected=value, actual=stored)
    return RescoreReport(r.id, str(r.measurements.get("arm")), seed, [docs[i]["document"] for i in sampled], rescored,
                         probes, max_dev, time.perf_counter() - started, threads, len(docs))


def _paths_differ(settings: Mapping[str, Any], model: LoadedModel) -> str:
    """What a re-scoring mismatch owes to the CPU: other code paths give other float bits (runners/numerics.py)."""
    recorded = settings.get("cpu")
    if recorded is None or recorded == model.cpu:
        return ""
    return f" (the evaluation ran on CPU paths {recorded}, this re-scoring on {model.cpu}: their float bits differ)"


__all__ = [
    "COMPARISON_METHOD",
    "EVAL_FORMAT",
    "QUALITY_FORMAT",
    "EvalRecord",
    "RescoreReport",
    "batch_plan",
    "check_comparison",
    "check_eval",
    "check_quality",
    "comparison_measurements",
    "comparison_name",
    "eval_measurements",
    "first_difference",
    "outcome_row",
    "quality_measurements",
    "rescore",
    "retention_row",
    "sample_indices",
    "text_digest",
]
