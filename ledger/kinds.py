"""One row per receipt kind: its chain rule and its measurement schema.

This table and ``verify/checks.py`` (what verification recomputes per kind) are the only places that list kinds;
tests/ledger/test_kinds.py fails when a kind of :class:`~ledger.receipts.Kind` lacks a row in either. Adding a kind
is: a member of ``Kind``, its rule in ledger/rules.py, a row here, its check in verify/checks.py, and its section
in docs/receipts.md (docs/architecture.md walks through one).

A schema names the measurement fields a writer must fill, with their JSON types: the fields some reader (a
verification check, the report) relies on; purely descriptive measurements are not required. Some kinds hold
several record formats (a ``comparison`` is a recovery rank comparison, a recovery summary or a paired evaluation
comparison): each format is a :class:`Shape`, told apart by a discriminating field's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from ledger import rules
from ledger.errors import RecordInvalid
from ledger.experiment import formats as fmt
from ledger.receipts import Kind, Receipt
from ledger.rules import Rule

# JSON types of measurement fields. A number may be written as an integer where its value is whole (0 seconds).
NUMBER: Final = (int, float)
JSONType = type | tuple[type, ...]


@dataclass(frozen=True)
class Shape:
    """One record format: the fields it must have, and which field value selects it (empty: always)."""

    fields: Mapping[str, JSONType]
    when: Mapping[str, Any] = field(default_factory=dict)

    def matches(self, measurements: Mapping[str, Any]) -> bool:
        return all(measurements.get(k) == v for k, v in self.when.items())


@dataclass(frozen=True)
class Schema:
    """The measurement formats of a kind; a receipt's measurements must fit the first shape that matches."""

    shapes: tuple[Shape, ...] = ()

    def check(self, receipt: Receipt) -> None:
        """Raise RecordInvalid naming the first missing or mistyped field of ``receipt``'s measurements."""
        m = receipt.measurements
        if not self.shapes:
            return
        shape = next((s for s in self.shapes if s.matches(m)), None)
        if shape is None:
            wanted = [dict(s.when) for s in self.shapes]
            raise RecordInvalid(receipt.id, "measurements", expected=f"one of the formats {wanted}",
                                actual={k: m.get(k) for w in wanted for k in w}, what=f"{receipt.kind} receipt")
        for name, kind in shape.fields.items():
            value = m.get(name)
            if name not in m or not _fits(value, kind):
                raise RecordInvalid(receipt.id, f"measurements.{name}", expected=_type_name(kind),
                                    actual=value if name in m else "nothing", what=f"{receipt.kind} receipt")


def _fits(value: Any, kind: JSONType) -> bool:
    if isinstance(value, bool):  # a bool is an int in Python, never in a schema
        return kind is bool or (isinstance(kind, tuple) and bool in kind)
    return isinstance(value, kind)


def _type_name(kind: JSONType) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
             type(None): "null"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


@dataclass(frozen=True)
class KindSpec:
    """A kind's row: what it records, which receipts it may follow, and what its measurements hold."""

    summary: str
    rule: Rule
    schema: Schema


def _one(**fields: JSONType) -> Schema:
    return Schema((Shape(fields),))


_RANK_SECONDS = {name: NUMBER for name in ("update_seconds", "synchronization_seconds", "active_seconds",
                                           "checkpoint_seconds", "loop_seconds")}

KINDS: Final[Mapping[Kind, KindSpec]] = MappingProxyType({
    Kind.PREPARE: KindSpec(
        "data, tokenizer, seed model and config; its digests make the `prepared` digest", rules.prepare,
        Schema()),  # its measurements describe (counts, software); nothing reads them, its digests are the record
    Kind.SELECTION: KindSpec(
        "the evaluation selection and retention probes; their digests make the `selection` digest",
        rules.selection, Schema()),  # likewise descriptive: the selection's evidence is its artifacts
    Kind.CONTRACT: KindSpec(
        "pre-registered thresholds, recorded before training", rules.contract,
        _one(arms=list, primary_arm=str, baseline_arm=str, quality=dict, efficiency=dict, serving=dict)),
    Kind.TRAIN_START: KindSpec(
        "binds a rank's identity (host, device, software, threads) to a run", rules.train_start,
        _one(binding=dict, binding_digest=str)),
    Kind.CHECKPOINT: KindSpec(
        "a rank's state digests at a step, the losses since the previous checkpoint and the bytes sent",
        rules.checkpoint, _one(arm=str, world=int, files=dict, losses=list, outer_steps=int, sent_bytes=int)),
    Kind.TRAIN_END: KindSpec(
        "a rank's final digests and per-rank figures", rules.train_end,
        _one(arm=str, world=int, binding=dict, start_step=int, steps=int, tokens=int, sent_bytes=int,
             sent_bytes_by_op=dict, collective_calls=int, interface_bytes=dict, **_RANK_SECONDS)),
    Kind.ARM_SUMMARY: KindSpec(
        "an arm's max-rank and total figures and its ratios against the other arms", rules.arm_summary,
        _one(arm=str, world=int, ranks=list, max_rank_active_seconds=NUMBER, max_rank_loop_seconds=NUMBER,
             total_sent_bytes=int, parameter_digest=str, ratios=dict)),
    Kind.FAULT: KindSpec(
        "a killed rank and the failed group it took down", rules.no_rule,
        _one(killed_rank=int, signal=str, last_observed_step=int, restore_step=int, returncodes=list,
             detect_seconds=NUMBER, failed_group_seconds=NUMBER, restore=dict)),
    Kind.RESTORE: KindSpec(
        "which checkpoint a rank of a restarted group restored", rules.restore,
        _one(binding=dict, restored_from=str, restored_run=str)),
    Kind.COMPARISON: KindSpec(
        "uninterrupted vs recovered (per rank, and the summary), a replayed segment, or a paired comparison of two "
        "evaluations",
        rules.comparison, Schema((
            Shape({"rank": int, "resume_step": int, "uninterrupted_receipt": str, "recovered_receipt": str,
                   "comparisons": dict, "contents_exactly_equal": bool, "file_hashes_equal": bool,
                   "parameter_digest": str, "binding": dict, "binding_equal": bool, "trajectory_steps": int,
                   "trajectory_equal": bool, "scope": str, "seconds": NUMBER},
                  when={"format": fmt.RECOVERY_RANK_FORMAT}),
            Shape({"arm": str, "killed_rank": int, "last_observed_step_before_kill": int, "restore_step": int,
                   "failed_group_seconds": NUMBER, "restarted_group_seconds": NUMBER, "detect_seconds": NUMBER,
                   "all_rank_state_and_trajectory_comparisons_passed": bool, "uninterrupted_run": str,
                   "recovered_run": str, "scope": str},
                  when={"format": fmt.RECOVERY_SUMMARY_FORMAT}),
            Shape({"run": str, "arm": str, "from_step": int, "to_step": int, "passed": bool, "ranks": list,
                   "seconds": NUMBER}, when={"format": fmt.REPLAY_FORMAT}),
            Shape({"comparison": str, "documents": int, "baseline": dict, "candidate": dict, "baseline_correct": int,
                   "candidate_correct": int, "gained": int, "lost": int, "accuracy_gain": NUMBER,
                   "standard_error": NUMBER, "normal_99pct_lower": NUMBER, "normal_99pct_upper": NUMBER,
                   "exact_one_sided_p": NUMBER, "interval_scope": str},
                  when={"method": fmt.COMPARISON_METHOD}),
        ))),
    Kind.EVAL: KindSpec(
        "per-document outcomes of a model on the selection, with breakdowns and retention", rules.eval_,
        Schema((Shape({"arm": str, "documents": int, "correct": int, "breakdowns": dict, "retention": dict,
                       "settings": dict}, when={"format": fmt.EVAL_FORMAT}),))),
    Kind.QUALITY: KindSpec(
        "the pre-registered quality contract judged from paired comparisons", rules.quality,
        Schema((Shape({"primary_arm": str, "baseline_arm": str, "arms": list, "missing_arms": list,
                       "conditions": dict, "learning": dict, "quality_contract_passed": bool},
                      when={"format": fmt.QUALITY_FORMAT}),))),
    Kind.REPLICA: KindSpec(
        "a serving replica proving the model it loaded (the digest it computed from the bytes it loaded)",
        rules.replica, Schema((Shape({"endpoint": str, "model_digest": str, "checkpoint_receipt": str,
                                      "binding": dict}, when={"format": fmt.SERVE_REPLICA_FORMAT}),))),
    Kind.SERVE_PHASE: KindSpec(
        "one serving phase: its replicas, its request set and its per-request log", rules.serve_phase,
        Schema((Shape({"phase": str, "run_id": str, "concurrency": int, "endpoints": list, "request_set": str,
                       "requests": int, "successful": int, "retries": int, "seconds": NUMBER,
                       "requests_per_second": (int, float, type(None)), "unavailable": list, "metrics": list},
                      when={"format": fmt.SERVE_PHASE_FORMAT}),))),
    Kind.SERVE_SUMMARY: KindSpec(
        "the serving section: the three phases judged against the contract's serving conditions",
        rules.serve_summary,
        Schema((Shape({"arm": str, "conditions": dict, "failure_retries": int, "phases": dict,
                       "serving_fixture_passed": bool, "scope": str}, when={"format": fmt.SERVE_SUMMARY_FORMAT}),))),
    Kind.AUDIT: KindSpec(
        "the report recomputed from the ledger, with the contracts' verdicts", rules.audit,
        Schema((Shape({"contracts": dict, "tokens_issued": int}, when={"format": fmt.AUDIT_FORMAT}),))),
    Kind.SETTLEMENT: KindSpec(
        "the tokens issued for an audited experiment (only when every contract passes)", rules.settlement,
        Schema((Shape({"contracts": dict, "tokens_issued": int, "rule": str},
                      when={"format": fmt.SETTLEMENT_FORMAT}),))),
    Kind.REPORT: KindSpec(
        "the audit's report rendered as one self-contained HTML page (the page's digest)", rules.report,
        # Format 2 draws the figures without matplotlib (docs/report.md); format 1 pages still verify.
        Schema(tuple(Shape({"bytes": int, "log_head": (str, type(None))}, when={"format": f})
                     for f in fmt.REPORT_HTML_FORMATS))),
    Kind.NOTE: KindSpec(
        "free-form evidence (examples, operator remarks); no rule beyond the common ones", rules.no_rule, Schema()),
    Kind.KEY: KindSpec(
        "a public key allowed to sign receipts from its place in the log on, or that key's revocation (its signatures "
        "on receipts logged after the revocation fail)", rules.key,
        Schema((Shape({"key": str}, when={"format": rules.KEY_FORMAT}),
                Shape({"key": str}, when={"format": rules.KEY_REVOCATION_FORMAT})))),
})


_BY_NAME: Final[Mapping[str, KindSpec]] = {kind.value: row for kind, row in KINDS.items()}


def spec(kind: str) -> KindSpec:
    """The row of ``kind`` (a receipt's kind is validated at parse time, so this never misses for a receipt)."""
    found = _BY_NAME.get(kind)  # a plain dict of the kinds' names: Kind(kind) costs half a microsecond per receipt
    return found if found is not None else KINDS[Kind(kind)]
