"""The serving receipts' checks: every phase figure from its request log, the summary from its phases and the
contract, the replicas' model against the primary arm's final model, and (with a model runner handed in by the
CLI, ``ledger verify --rescore K``) K sampled requests re-executed to the same tokens, bit for bit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledger.artifacts import parse_jsonl, read_artifact
from ledger.digests import parse_canonical
from ledger.errors import InputError, RecordInvalid, ReexecutionMismatch
from ledger.experiment.config import config_from_bytes
from ledger.experiment.tokenizer import CharTokenizer
from ledger.receipts import Receipt
from verify import serving as vs
from verify.context import KindCheckContext
from verify.evaluation import sample_indices


def phase_record(receipt: Receipt, rows: list[Any]) -> dict[str, Any]:
    """A phase record as the load client wrote it: its receipt's measurements and its request-log rows."""
    return {**{k: v for k, v in receipt.measurements.items() if k != "format"}, "rows": rows}


def _read(ctx: KindCheckContext, r: Receipt, name: str) -> bytes:
    digest = r.artifacts[name]
    return read_artifact(ctx.artifacts, digest, locations=ctx.store.locations(digest), name=f"{name} of {r.id}")


def _phase(ctx: KindCheckContext, r: Receipt) -> tuple[dict[str, Any], list[Any]]:
    rows = parse_jsonl(_read(ctx, r, "request_log"), source=f"request_log of {r.id}")
    return phase_record(r, rows), parse_canonical(_read(ctx, r, "request_set"))


def check_serve_phase(ctx: KindCheckContext) -> list[str]:
    """Every figure of a phase from its rows; each answered row's model is the model its replica proved."""
    r = ctx.receipt
    record, requests = _phase(ctx, r)
    vs.verify_phase(record, requests=requests, receipt=r.id)
    proved = {ctx.closure[p].measurements["endpoint"]: ctx.closure[p].measurements["model_digest"]
              for p in r.parents}
    for row in record["rows"]:
        if row.get("status") == 200 and row.get("model_digest") != proved.get(row.get("endpoint")):
            raise RecordInvalid(r.id, f"rows[{row.get('index')}].model_digest",
                                expected=proved.get(row.get("endpoint")), actual=row.get("model_digest"),
                                what="request log")
    return [f"serve-phase {r.id[:19]} {record['phase']}: {record['requests']} requests, every figure recomputed "
            f"from the request log"]


def _primary_source(ctx: KindCheckContext, summary: Receipt, contract: Receipt) -> Receipt:
    """The model every replica must serve: the contract's primary arm's final model (its rank 0 train-end)."""
    arm = contract.measurements["primary_arm"]
    if summary.measurements.get("arm") != arm:
        raise RecordInvalid(summary.id, "measurements.arm", expected=arm, actual=summary.measurements.get("arm"),
                            what="serve-summary")
    sources = set()
    for phase in (ctx.closure[p] for p in summary.parents if ctx.closure[p].kind == "serve-phase"):
        for rid in phase.parents:
            replica = ctx.closure[rid]
            source = next(ctx.closure[p] for p in replica.parents if ctx.closure[p].kind in ("train-end",
                                                                                            "checkpoint", "prepare"))
            if source.kind != "train-end" or source.run != f"train/{arm}" or source.rank != 0:
                raise RecordInvalid(replica.id, "parents", expected=f"the rank 0 train-end of train/{arm}",
                                    actual=f"{source.kind} {source.id} of run {source.run} rank {source.rank}",
                                    what="replica")
            sources.add(source.id)
    if len(sources) != 1:
        raise RecordInvalid(summary.id, "parents", expected="replicas of one model", actual=sorted(sources),
                            what="serve-summary")
    return ctx.closure[sources.pop()]


def check_serve_summary(ctx: KindCheckContext) -> list[str]:
    """The summary recomputed from its phases and the contract's serving conditions, every field."""
    r = ctx.receipt
    contract = next(ctx.closure[p] for p in r.parents if ctx.closure[p].kind == "contract")
    source = _primary_source(ctx, r, contract)
    phases: dict[str, Any] = {}
    requests: list[Any] = []
    for p in r.parents:
        if ctx.closure[p].kind == "serve-phase":
            record, requests = _phase(ctx, ctx.closure[p])
            phases[record["phase"]] = record
    recorded = {k: v for k, v in r.measurements.items() if k not in ("format", "arm", "scope")}
    vs.verify_serving(phases, requests=requests, summary=recorded, required=contract.measurements["serving"],
                      expected_model_digest=source.artifacts["model"], receipt=r.id)
    lines = [f"serve-summary {r.id[:19]}: conditions, retries and the four/single ratio recomputed; fixture "
             f"{'passed' if r.measurements['serving_fixture_passed'] else 'failed'}"]
    if ctx.rescore > 0:
        lines.append(_reexecute(ctx, r, source, phases["four"], requests))
    return lines


def _reexecute(ctx: KindCheckContext, summary: Receipt, source: Receipt, phase: Mapping[str, Any],
               requests: list[Any]) -> str:
    """Re-run ``ctx.rescore`` sampled answered requests on the primary arm's model; every token must match."""
    if ctx.runner is None:
        raise InputError("re-executing served requests needs a model runner (ledger verify --rescore provides one)")
    prepare = next(x for x in ctx.closure.values() if x.kind == "prepare" and x.prepared == summary.prepared)
    tok = CharTokenizer.from_bytes(_read(ctx, prepare, "tokenizer"))
    config = config_from_bytes(_read(ctx, prepare, "config"))
    state = source.artifacts["state"]
    checkpoint = ctx.artifacts.locate(state, ctx.store.evidence_locations(source.id, "state", state),
                                      name="state", directory=True)
    answered = [row for row in phase["rows"] if row.get("status") == 200]
    sampled = [answered[i] for i in sample_indices(len(answered), ctx.rescore, ctx.rescore_seed)]
    with ctx.runner.load(checkpoint, config, tok.vocab_size, state=state, model=source.artifacts["model"],
                         receipt=source.id, threads=1) as model:
        for row in sampled:
            request = requests[row["index"]]
            out = model.generate([tok.encode(request["prompt"], bos=True)], eos_id=tok.eos_id,
                                 max_new_tokens=int(request["max_tokens"]), batch_size=1)[0]
            if out != row["output_token_ids"]:
                raise ReexecutionMismatch.at(
                    f"receipt {summary.id}: re-executing request {row['index']} gives other tokens than replica "
                    f"{row['endpoint']} answered", receipt=summary.id,
                    field=f"phases.four.rows[{row['index']}].output_token_ids", expected=out,
                    actual=row["output_token_ids"])
    return (f"serve-summary {summary.id[:19]}: {len(sampled)} sampled requests re-executed on the primary model, "
            f"identical tokens (seed {ctx.rescore_seed})")
