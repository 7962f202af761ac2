"""The chain rules of each receipt kind: which receipts may follow which. Pure and I/O-free.

Each rule takes a receipt and the parents it cites and returns ``None`` or raises
:class:`~ledger.errors.ChainBroken` naming the receipt, the rule and both values. ledger/kinds.py maps each kind to
its rule; ledger/chain.py applies them. Rules are documented in docs/receipts.md ("Chain rules").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ledger import digests
from ledger.errors import ChainBroken
from ledger.experiment.arms import ARMS
from ledger.experiment.formats import RECOVERY_RANK_FORMAT, RECOVERY_SUMMARY_FORMAT
from ledger.receipts import Receipt, a_kind
from ledger.transparency_errors import MalformedKey

Rule = Callable[[Receipt, list[Receipt]], None]

# Kinds that hold a rank's training state, and so may precede a checkpoint or a train-end.
STATE_KINDS = frozenset({"train-start", "checkpoint", "restore"})
# Kinds whose receipt names a trained or seed model in artifacts["model"].
MODEL_KINDS = frozenset({"prepare", "checkpoint", "train-end"})


def broken(r: Receipt, rule: str, field: str | None = None, expected: object = None,
            actual: object = None) -> ChainBroken:
    return ChainBroken(r.id, rule, field=field, expected=expected, actual=actual)


def _require(r: Receipt, *names: str) -> None:
    for name in names:
        if getattr(r, name) is None:
            raise broken(r, f"{a_kind(r.kind)} receipt needs `{name}`", field=name, expected="a value", actual=None)


def _forbid(r: Receipt, *names: str) -> None:
    for name in names:
        if getattr(r, name) is not None:
            raise broken(r, f"{a_kind(r.kind)} receipt has no `{name}`", field=name, expected=None,
                          actual=getattr(r, name))


def _one_parent(r: Receipt, parents: list[Receipt], kinds: frozenset[str] | set[str], what: str) -> Receipt:
    found = [p for p in parents if p.kind in kinds]
    if len(found) != 1:
        raise broken(r, f"{a_kind(r.kind)} receipt cites exactly one {what} ({'/'.join(sorted(kinds))})",
                      field="parents", expected=1, actual=len(found))
    return found[0]


# --------------------------------------------------------------------------------------------- kind rules


def prepare(r: Receipt, parents: list[Receipt]) -> None:
    _forbid(r, "rank", "step", "selection")
    if parents:
        raise broken(r, "a prepare receipt has no parents", field="parents", expected=[], actual=list(r.parents))
    expected = digests.prepared_digest(r.artifacts)
    if r.prepared != expected:
        raise broken(r, "prepared must be the digest of the prepare artifacts", field="prepared",
                      expected=expected, actual=r.prepared)


def selection(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "selection")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")
    expected = digests.selection_digest(r.artifacts)
    if r.selection != expected:
        raise broken(r, "selection must be the digest of the selection artifacts", field="selection",
                      expected=expected, actual=r.selection)


def contract(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")


def train_start(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")


def _previous_state(r: Receipt, parents: list[Receipt], *, after_checkpoint: bool = True) -> Receipt:
    """The one state receipt ``r`` continues from. A checkpoint must be later than the checkpoint before it; a
    train-end may sit at its final checkpoint's step (``after_checkpoint=False``)."""
    prev = _one_parent(r, parents, STATE_KINDS, "previous state")
    if prev.rank != r.rank:
        raise broken(r, f"the previous state {prev.id} belongs to another rank", field="rank",
                      expected=prev.rank, actual=r.rank)
    if prev.run != r.run:
        raise broken(r, f"the previous state {prev.id} belongs to another run", field="run",
                      expected=prev.run, actual=r.run)
    assert prev.step is not None and r.step is not None
    strict = prev.kind == "checkpoint" and after_checkpoint
    if not (r.step > prev.step if strict else r.step >= prev.step):
        raise broken(r, f"steps must increase after {prev.kind} {prev.id}", field="step",
                      expected=f"> {prev.step}" if strict else f">= {prev.step}", actual=r.step)
    return prev


def checkpoint(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _previous_state(r, parents)
    if "state" not in r.artifacts:
        raise broken(r, "a checkpoint names its state digest in artifacts.state", field="artifacts.state")


def train_end(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _previous_state(r, parents, after_checkpoint=False)


def restore(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    ckpt = _one_parent(r, parents, {"checkpoint"}, "checkpoint to restore")
    if ckpt.step != r.step:
        raise broken(r, f"a restore resumes at its checkpoint's step ({ckpt.id})", field="step",
                      expected=ckpt.step, actual=r.step)
    if ckpt.rank != r.rank:
        raise broken(r, f"a rank restores its own rank's checkpoint ({ckpt.id})", field="rank",
                      expected=ckpt.rank, actual=r.rank)
    if ckpt.run != r.run:  # a restarted group continues its own run: no mixing in another run's state
        raise broken(r, f"a restore continues the run of its checkpoint {ckpt.id} (another lineage)",
                      field="run", expected=ckpt.run, actual=r.run)
    for name in ("state", "config"):
        if name in r.artifacts and r.artifacts.get(name) != ckpt.artifacts.get(name):
            raise broken(r, f"restored {name} differs from checkpoint {ckpt.id} (another lineage)",
                          field=f"artifacts.{name}", expected=ckpt.artifacts.get(name), actual=r.artifacts[name])


def _model_source(r: Receipt, parents: list[Receipt]) -> None:
    source = _one_parent(r, parents, MODEL_KINDS, "model source")
    if "model" not in r.artifacts:
        raise broken(r, f"{a_kind(r.kind)} receipt names its model in artifacts.model", field="artifacts.model")
    if source.artifacts.get("model") != r.artifacts["model"]:
        raise broken(r, f"the model differs from the one {source.kind} {source.id} produced",
                      field="artifacts.model", expected=source.artifacts.get("model"), actual=r.artifacts["model"])


def eval_(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "selection")
    _one_parent(r, parents, {"selection"}, "selection receipt")
    _model_source(r, parents)


def quality(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _one_parent(r, parents, {"contract"}, "contract receipt")
    others = sorted({p.kind for p in parents} - {"contract"})
    if others != ["comparison"]:
        raise broken(r, "a quality receipt cites its contract and the comparison receipts it judges, nothing else",
                      field="parents", expected=["comparison"], actual=others)


def replica(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _model_source(r, parents)


def arm_summary(r: Receipt, parents: list[Receipt]) -> None:
    """A data-parallel arm's ranks hold identical weights at the end: its train-end receipts name one model."""
    ends = [p for p in parents if p.kind == "train-end" and p.run == r.run]
    if not ends:
        raise broken(r, "an arm summary cites the train-end receipts of its run", field="parents")
    arm = ARMS.get(str(r.measurements.get("arm")))
    if arm is not None and arm.identical_replicas:
        models = sorted({p.artifacts.get("model", "") for p in ends})
        if len(models) != 1:
            raise broken(r, f"the ranks of {arm.name} (synchronized {arm.sync}) ended with different model digests",
                         field="artifacts.model",
                          expected=models[0], actual=models[1:])
    first = min(ends, key=lambda p: p.rank or 0)
    if "model" in r.artifacts and r.artifacts["model"] != first.artifacts.get("model"):
        raise broken(r, "the summary's model is not its rank 0's", field="artifacts.model",
                      expected=first.artifacts.get("model"), actual=r.artifacts["model"])


def recovery_rank_passed(m: Mapping[str, Any]) -> bool:
    """A rank's recovery comparison holds: exact state and files, same binding, same losses after the resume."""
    return bool(m["contents_exactly_equal"] and m["file_hashes_equal"] and m["binding_equal"]
                and m["trajectory_equal"])


def comparison(r: Receipt, parents: list[Receipt]) -> None:
    """A recovery rank comparison cites the two train-end receipts it compares, of its rank; a recovery summary
    restates its one fault and the verdicts of the rank comparisons it cites (paired evaluation comparisons are
    recomputed from their outcome files by verify)."""
    m = r.measurements
    if m.get("format") == RECOVERY_RANK_FORMAT:
        for name in ("uninterrupted_receipt", "recovered_receipt"):
            cited = next((p for p in parents if p.id == m.get(name)), None)
            if cited is None or cited.kind != "train-end" or cited.rank != m.get("rank"):
                raise broken(r, f"a recovery rank comparison cites its {name} (a train-end of rank {m.get('rank')})",
                             field=f"measurements.{name}", expected="a cited train-end receipt", actual=m.get(name))
    elif m.get("format") == RECOVERY_SUMMARY_FORMAT:
        faults = [p for p in parents if p.kind == "fault"]
        ranks = [p for p in parents if p.kind == "comparison" and p.measurements.get("format") == RECOVERY_RANK_FORMAT]
        if len(faults) != 1 or not ranks:
            raise broken(r, "a recovery summary cites one fault and the rank comparisons", field="parents",
                         expected="1 fault and >= 1 rank comparison", actual=f"{len(faults)} fault(s), {len(ranks)}")
        fault = faults[0].measurements
        claimed = {
            "killed_rank": fault.get("killed_rank"),
            "last_observed_step_before_kill": fault.get("last_observed_step"),
            "restore_step": fault.get("restore_step"),
            "failed_group_seconds": fault.get("failed_group_seconds"),
            "all_rank_state_and_trajectory_comparisons_passed": all(
                recovery_rank_passed(p.measurements) for p in ranks),
        }
        for name, value in claimed.items():
            if m.get(name) != value:
                raise broken(r, f"the summary's {name} is not what its parents say", field=f"measurements.{name}",
                             expected=value, actual=m.get(name))


def audit(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _one_parent(r, parents, {"contract"}, "contract receipt")


def settlement(r: Receipt, parents: list[Receipt]) -> None:
    """A settlement restates its audit's verdict: the same contracts and the same tokens issued."""
    _require(r, "prepared")
    audited = _one_parent(r, parents, {"audit"}, "audit receipt")
    for name in ("contracts", "tokens_issued"):
        if r.measurements.get(name) != audited.measurements.get(name):
            raise broken(r, f"the settlement's {name} differs from its audit {audited.id}",
                         field=f"measurements.{name}", expected=audited.measurements.get(name),
                         actual=r.measurements.get(name))


def serve_phase(r: Receipt, parents: list[Receipt]) -> None:
    """A serving phase cites the replicas it spread requests over (each endpoint it names, once) and names its
    request set and request log."""
    _require(r, "prepared")
    replicas = [p for p in parents if p.kind == "replica"]
    endpoints = sorted(str(p.measurements.get("endpoint")) for p in replicas)
    named = sorted(str(e) for e in r.measurements.get("endpoints", []))
    if not replicas or endpoints != named or len(replicas) != len(parents):
        raise broken(r, "a serve-phase cites exactly the replicas of the endpoints it names", field="parents",
                     expected=named, actual=endpoints)
    for name in ("request_log", "request_set"):
        if name not in r.artifacts:
            raise broken(r, f"a serve-phase names its {name} in artifacts.{name}", field=f"artifacts.{name}",
                         expected="a digest", actual=None)


def serve_summary(r: Receipt, parents: list[Receipt]) -> None:
    """The serving summary cites its contract and one serve-phase of each phase (single, four, failure)."""
    _require(r, "prepared")
    _one_parent(r, parents, {"contract"}, "contract receipt")
    phases = sorted(str(p.measurements.get("phase")) for p in parents if p.kind == "serve-phase")
    if phases != ["failure", "four", "single"]:
        raise broken(r, "a serve-summary cites one serve-phase per phase", field="parents",
                     expected=["failure", "four", "single"], actual=phases)


def report(r: Receipt, parents: list[Receipt]) -> None:
    """A rendered report names the page's digest, renders exactly one audit and cites that audit's settlement:
    it is the experiment's head, the one receipt whose verification covers everything the experiment recorded."""
    _require(r, "prepared")
    audited = _one_parent(r, parents, {"audit"}, "audit receipt")
    settled = _one_parent(r, parents, {"settlement"}, "settlement receipt")
    if audited.id not in settled.parents:
        raise broken(r, f"the settlement {settled.id} is not the one of audit {audited.id}", field="parents",
                     expected=audited.id, actual=list(settled.parents))
    if "html" not in r.artifacts:
        raise broken(r, "a report receipt names its page in artifacts.html", field="artifacts.html",
                     expected="a digest", actual=None)


KEY_FORMAT = "ledger-key/1"
# A `key` receipt of this format revokes the key it names (docs/transparency.md §2): signatures by that key on
# receipts at later leaves of the log fail verification.
KEY_REVOCATION_FORMAT = "ledger-key-revocation/1"


def key(r: Receipt, parents: list[Receipt]) -> None:
    """A key registration stands alone (no parents, no experiment, no step) and names one Ed25519 verifier key, so
    who may sign is itself evidence: signatures by the key count from this receipt's place in the log on.

    A revocation (``measurements.format`` = KEY_REVOCATION_FORMAT) cites exactly the registration of the key it
    names, so a key no receipt registers cannot be revoked: the store refuses the receipt, and so does verify."""
    _forbid(r, "step", "prepared", "selection")
    vkey = _verifier_key(r)
    if r.measurements.get("format") != KEY_REVOCATION_FORMAT:
        if parents:
            raise broken(r, "a key receipt has no parents", field="parents", expected=[], actual=list(r.parents))
        return
    if len(parents) != 1:
        raise broken(r, "a key revocation cites exactly one key receipt: the registration of the key it revokes",
                     field="parents", expected=1, actual=len(parents))
    (registration,) = parents
    if registration.kind != "key" or registration.measurements.get("format") == KEY_REVOCATION_FORMAT:
        raise broken(r, "a key revocation cites the key receipt registering the key it revokes",
                     field="parents", expected=f"a key receipt of format {KEY_FORMAT}",
                     actual=f"{registration.kind} receipt of format {registration.measurements.get('format')}")
    if registration.measurements.get("key") != vkey:
        raise broken(r, "a key revocation names the key its cited key receipt registers", field="measurements.key",
                     expected=registration.measurements.get("key"), actual=vkey)


def _verifier_key(r: Receipt) -> str:
    from ledger.signing import load_public_key  # the note format and Ed25519 for key receipts only

    vkey = r.measurements.get("key")
    try:
        if not isinstance(vkey, str):
            raise MalformedKey("a verifier key is a string", actual=type(vkey).__name__)
        load_public_key(vkey)
    except MalformedKey as exc:
        raise broken(r, f"measurements.key is not an Ed25519 verifier key: {exc.detail}", field="measurements.key",
                     expected="name+<8 hex>+base64(0x01 || public key)", actual=vkey) from None
    return vkey


def no_rule(r: Receipt, parents: list[Receipt]) -> None:
    """Only the rules common to every kind (parents exist, same prepared and selection digests)."""
    return None
