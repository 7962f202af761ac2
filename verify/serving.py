"""Serving records and their verification: the phase record, its request log, replica metrics, the conditions.

Pure and torch-free (it imports no runner): the load client (runners/loadgen.py) builds its phase records with
:func:`phase_record`, and the verifier recomputes every figure from the same rows with the same functions.

A **request-log row** (one per request of the fixed request set, canonical-JSON-safe)::

    index             position in the request set (0..n-1, each exactly once)
    request_digest    ledger.serving_digests.request_digest of the request the client sent
    endpoint          the replica that answered (null when none did)
    attempts          requests sent for it (1 + retries)
    errors            one {endpoint, error, at} per failed attempt: the error class name (ConnectError,
                      RemoteProtocolError, ReadTimeout, HTTPStatusError for a 5xx, InvalidResponse), and the phase
                      clock when it failed
    status            HTTP status of the answer (null when no replica answered)
    started_at        phase clock (seconds; 0 = just before the first request) when its first attempt began
    finished_at       phase clock when the answer arrived (or the last attempt failed)
    latency_seconds   finished_at - started_at (client-side, retries included)
    response_digest, output_token_ids, text, finish_reason, model_digest
                      the replica's answer (null unless status is 200)

**Phase figures**, all recomputed from the rows (:func:`phase_figures`):

* ``requests`` = rows; ``successful`` = rows with status 200; ``retries`` = sum of (attempts - 1);
* ``seconds`` = max(finished_at) - min(started_at); ``requests_per_second`` = requests / seconds;
* ``median_latency_seconds`` / ``p95_latency_seconds``: :func:`percentile` 50 / 95 of the successful rows'
  latencies (null when none succeeded);
* ``unavailable``: each endpoint (in the phase's order) that had a failed attempt, with the error class of its
  earliest one (smallest ``at``; ties by request index);
* ``model_digest``: the one model digest every successful answer names (null if none, or if they disagree).

**Replica metrics**: each phase record keeps, per endpoint, a summary of ``GET /metrics`` scraped before and after
the phase (:func:`metrics_summary`; null when the scrape failed, e.g. for the killed replica).

**Conditions** (over the phases ``single``, ``four``, ``failure``):

* ``all_requests_completed``: every phase answered every request with status 200;
* ``identical_successful_output_tokens``: for each request index, every successful answer in every phase, from
  whichever replica, has the same output token ids (and there is at least one);
* ``no_cache_hits``: every scrape reports ``cache_hits_total`` 0; in every phase each scraped replica's
  ``cache_lookups_total`` grew by at least the number of requests it answered (so the zero is measured: replicas
  count each place a cache could be consulted as a lookup that misses); a replica that answered requests was
  scraped after the phase unless the phase lists it unavailable.

``serving_fixture_passed``: every condition the contract requires holds, all three phases are present with the same
request set and one common model digest (the expected one, when given), and the failure phase lost at least one
endpoint (a failure phase without a failure proves no fail-over).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ledger import serving_digests as sd
from ledger.errors import VerificationError

PHASES: Final = ("single", "four", "failure")
CONDITIONS: Final = ("all_requests_completed", "identical_successful_output_tokens", "no_cache_hits")
ROW_KEYS: Final = frozenset({"index", "request_digest", "endpoint", "attempts", "errors", "status", "started_at",
                             "finished_at", "latency_seconds", "response_digest", "output_token_ids", "text",
                             "finish_reason", "model_digest"})
ANSWER_KEYS: Final = ("response_digest", "output_token_ids", "text", "finish_reason", "model_digest")
FIGURES: Final = ("requests", "successful", "retries", "seconds", "requests_per_second", "median_latency_seconds",
                  "p95_latency_seconds", "unavailable", "model_digest")
# The phase fields the report shows (the reference report's phase shape plus retries); rows and metrics stay in the
# phase record / request log.
REPORT_PHASE_FIELDS: Final = ("concurrency", "endpoints", "median_latency_seconds", "model_digest",
                              "p95_latency_seconds", "requests", "requests_per_second", "retries", "run_id",
                              "seconds", "successful", "unavailable")
METRIC_COUNTERS: Final = ("requests_total", "errors_total", "completions_total", "cache_lookups_total",
                          "cache_hits_total")


# -------------------------------------------------------------------------------------------------- errors


class ServingMismatch(VerificationError):
    """A serving record does not recompute; names the phase, the request index and the field."""

    def __init__(self, what: str, *, phase: str | None = None, index: int | None = None, field: str | None = None,
                 expected: Any = None, actual: Any = None, receipt: str | None = None) -> None:
        where = "".join([f"receipt {receipt}: " if receipt else "", f"phase {phase}: " if phase else "",
                         f"request {index}: " if index is not None else ""])
        super().__init__(f"{where}{what}: expected {expected!r}, recomputed {actual!r}", receipt=receipt,
                         field=field, expected=expected, actual=actual)
        self.phase = phase
        self.index = index

    def diagnostics(self) -> dict[str, Any]:
        return {**super().diagnostics(), "phase": self.phase, "index": self.index}


class MalformedServingLog(ServingMismatch):
    """A request-log row or phase record lacks a field, has a wrong type, or is inconsistent with itself."""


class RequestDigestMismatch(ServingMismatch):
    """A row's request digest is not the digest of the request-set entry with its index."""


class ResponseDigestMismatch(ServingMismatch):
    """A row's response digest does not recompute from its request digest, output token ids and text."""


class PhaseFigureMismatch(ServingMismatch):
    """A recorded phase figure (latency, throughput, counts, unavailable endpoints...) does not recompute."""


class SummaryMismatch(ServingMismatch):
    """A recorded serving summary (conditions, ratio, retries, passed) does not recompute."""


# --------------------------------------------------------------------------------------------- statistics


def percentile(values: Iterable[float], percent: int) -> float | None:
    """The ``percent``-th percentile by linear interpolation between closest ranks (Hyndman & Fan type 7, numpy's
    default ``linear`` method): sort the n values, h = (n - 1) * percent / 100, result x[floor h] + (h - floor h) *
    (x[floor h + 1] - x[floor h]). The rank position is computed exactly in integers, so the result is one float
    expression of two sample values. ``None`` for no values. The median is ``percentile(values, 50)``."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise ValueError(f"percent must be an integer 0..100, not {percent!r}")
    xs = sorted(values)
    if not xs:
        return None
    position = (len(xs) - 1) * percent
    lo, rest = divmod(position, 100)
    if rest == 0:
        return xs[lo]
    return xs[lo] + (rest / 100) * (xs[lo + 1] - xs[lo])


def _successful(row: Mapping[str, Any]) -> bool:
    return row.get("status") == 200


def phase_figures(rows: Sequence[Mapping[str, Any]], endpoints: Sequence[str]) -> dict[str, Any]:
    """Every phase figure, from the request-log rows (definitions in the module docstring)."""
    ok = [r for r in rows if _successful(r)]
    if rows:
        seconds = max(r["finished_at"] for r in rows) - min(r["started_at"] for r in rows)
    else:
        seconds = 0.0
    first_error: dict[str, tuple[float, int, str]] = {}
    for r in rows:
        for e in r["errors"]:
            key = (e["at"], r["index"], e["error"])
            if e["endpoint"] not in first_error or key < first_error[e["endpoint"]]:
                first_error[e["endpoint"]] = key
    order = list(endpoints) + sorted(set(first_error) - set(endpoints))
    model_digests = {r["model_digest"] for r in ok}
    latencies = [r["latency_seconds"] for r in ok]
    return {
        "requests": len(rows),
        "successful": len(ok),
        "retries": sum(max(r["attempts"] - 1, 0) for r in rows),
        "seconds": seconds,
        "requests_per_second": len(rows) / seconds if seconds > 0 else None,
        "median_latency_seconds": percentile(latencies, 50),
        "p95_latency_seconds": percentile(latencies, 95),
        "unavailable": [{"endpoint": ep, "error": first_error[ep][2]} for ep in order if ep in first_error],
        "model_digest": model_digests.pop() if len(model_digests) == 1 else None,
    }


def phase_record(name: str, *, run_id: str, endpoints: Sequence[str], concurrency: int, request_set: str,
                 rows: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]],
                 killed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A phase record: its settings, the figures of :func:`phase_figures`, the replica metrics and the rows."""
    return {
        "phase": name,
        "run_id": run_id,
        "concurrency": concurrency,
        "endpoints": list(endpoints),
        "request_set": request_set,
        **phase_figures(rows, endpoints),
        "killed": dict(killed) if killed is not None else None,
        "metrics": [dict(m) for m in metrics],
        "rows": [dict(r) for r in sorted(rows, key=lambda r: r["index"])],
    }


def report_phase(record: Mapping[str, Any]) -> dict[str, Any]:
    """The phase as the report shows it (no rows, no metrics)."""
    return {k: record[k] for k in REPORT_PHASE_FIELDS}


# ------------------------------------------------------------------------------------------------ metrics

_SAMPLE_RE: Final = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL_RE: Final = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples (name, labels, value) of a Prometheus text exposition; comments and blank lines are skipped."""
    samples: list[tuple[str, dict[str, str], float]] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            raise ValueError(f"metrics line {n} is not a sample: {line[:80]!r}")
        labels: dict[str, str] = {}
        body = m.group(2) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL_RE.match(body, pos)
            if lm is None:
                raise ValueError(f"metrics line {n}: bad labels {body[:80]!r}")
            labels[lm.group(1)] = re.sub(r"\\(.)", lambda x: "\n" if x.group(1) == "n" else x.group(1), lm.group(2))
            pos = lm.end()
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def metrics_summary(text: str) -> dict[str, int]:
    """The counters the serving conditions use, each summed over its labels (0 when absent)."""
    totals = dict.fromkeys(METRIC_COUNTERS, 0.0)
    for name, _, value in parse_metrics(text):
        if name in totals:
            totals[name] += value
    out: dict[str, int] = {}
    for name, value in totals.items():
        if not math.isfinite(value) or value != int(value) or value < 0:
            raise ValueError(f"counter {name} = {value!r} is not a non-negative integer")
        out[name] = int(value)
    return out


# --------------------------------------------------------------------------------------------- rows/phases


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, float) and math.isfinite(v)) or _is_int(v)


def _check_row(row: Any, phase: str | None, pos: int) -> None:
    def bad(field: str, expected: Any, actual: Any) -> MalformedServingLog:
        index = row.get("index") if isinstance(row, Mapping) else pos
        return MalformedServingLog(f"row field {field}", phase=phase, index=index, field=field, expected=expected,
                                   actual=actual)

    if not isinstance(row, Mapping):
        raise MalformedServingLog("row", phase=phase, index=pos, field="row", expected="object",
                                  actual=type(row).__name__)
    if set(row) != ROW_KEYS:
        raise bad("keys", sorted(ROW_KEYS), sorted(row))
    for f in ("index", "attempts"):
        if not _is_int(row[f]) or row[f] < 0:
            raise bad(f, "non-negative integer", row[f])
    for f in ("started_at", "finished_at", "latency_seconds"):
        if not _is_number(row[f]):
            raise bad(f, "finite number", row[f])
    if not isinstance(row["errors"], list) or not all(
            isinstance(e, Mapping) and set(e) == {"endpoint", "error", "at"} and isinstance(e["endpoint"], str)
            and isinstance(e["error"], str) and _is_number(e["at"]) for e in row["errors"]):
        raise bad("errors", "list of {endpoint, error, at}", row["errors"])
    if row["status"] is not None and not _is_int(row["status"]):
        raise bad("status", "integer or null", row["status"])
    answered = 1 if row["status"] is not None else 0
    if row["attempts"] != len(row["errors"]) + answered:
        raise bad("attempts", len(row["errors"]) + answered, row["attempts"])
    if answered and not isinstance(row["endpoint"], str):
        raise bad("endpoint", "the answering endpoint", row["endpoint"])
    if _successful(row):
        ids = row["output_token_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("output_token_ids", "list of token ids", ids)
        for f in ("response_digest", "text", "finish_reason", "model_digest"):
            if not isinstance(row[f], str):
                raise bad(f, "string", row[f])
    else:
        for f in ANSWER_KEYS:
            if row[f] is not None:
                raise bad(f, None, row[f])


def verify_rows(rows: Sequence[Any], *, phase: str | None = None, requests: Sequence[Mapping[str, Any]] | None = None,
                endpoints: Sequence[str] | None = None, receipt: str | None = None) -> None:
    """Check every row: its shape, its index (0..n-1 once each; n = the request set's size when given), its request
    digest against the request set, its latency, its endpoint, and its response digest. Raises naming the row."""
    for pos, row in enumerate(rows):
        _check_row(row, phase, pos)
    indices = sorted(r["index"] for r in rows)
    n = len(requests) if requests is not None else len(rows)
    if indices != list(range(n)):
        raise MalformedServingLog("request indices", phase=phase, field="index", expected=f"0..{n - 1} once each",
                                  actual=indices[:8] + (["..."] if len(indices) > 8 else []), receipt=receipt)
    for row in sorted(rows, key=lambda r: r["index"]):
        i = row["index"]
        if requests is not None:
            want = sd.request_digest(requests[i])
            if row["request_digest"] != want:
                raise RequestDigestMismatch("request digest", phase=phase, index=i, field="request_digest",
                                            expected=row["request_digest"], actual=want, receipt=receipt)
        latency = row["finished_at"] - row["started_at"]
        if row["latency_seconds"] != latency:
            raise PhaseFigureMismatch("latency (finished_at - started_at)", phase=phase, index=i,
                                      field="latency_seconds", expected=row["latency_seconds"], actual=latency,
                                      receipt=receipt)
        seen = [e["endpoint"] for e in row["errors"]] + ([row["endpoint"]] if row["status"] is not None else [])
        if endpoints is not None and any(ep not in endpoints for ep in seen):
            raise MalformedServingLog("endpoint outside the phase", phase=phase, index=i, field="endpoint",
                                      expected=list(endpoints), actual=seen, receipt=receipt)
        if _successful(row):
            try:
                want = sd.response_digest(row["request_digest"], row["output_token_ids"], row["text"])
            except Exception as exc:  # a malformed request digest
                raise MalformedServingLog("request digest", phase=phase, index=i, field="request_digest",
                                          expected="blake3:<hex>", actual=row["request_digest"],
                                          receipt=receipt) from exc
            if row["response_digest"] != want:
                raise ResponseDigestMismatch("response digest", phase=phase, index=i, field="response_digest",
                                             expected=row["response_digest"], actual=want, receipt=receipt)


def verify_phase(record: Mapping[str, Any], *, requests: Sequence[Mapping[str, Any]] | None = None,
                 receipt: str | None = None) -> None:
    """Verify a phase record: its rows (:func:`verify_rows`), its request-set digest (when ``requests`` is given)
    and every recorded figure, exactly (the same float expressions recompute the same bits)."""
    name = record.get("phase")
    missing = sorted({"phase", "run_id", "concurrency", "endpoints", "request_set", "rows", "metrics", *FIGURES}
                     - set(record))
    if missing:
        raise MalformedServingLog("phase record fields", phase=name, field=missing[0], expected="present",
                                  actual="missing", receipt=receipt)
    endpoints = record["endpoints"]
    verify_rows(record["rows"], phase=name, requests=requests, endpoints=endpoints, receipt=receipt)
    if requests is not None:  # after the rows, so a differing request is named by its index
        want = sd.request_set_digest(requests)
        if record["request_set"] != want:
            raise PhaseFigureMismatch("request set digest", phase=name, field="request_set",
                                      expected=record["request_set"], actual=want, receipt=receipt)
    figures = phase_figures(record["rows"], endpoints)
    for f in FIGURES:
        if record[f] != figures[f]:
            raise PhaseFigureMismatch(f, phase=name, field=f, expected=record[f], actual=figures[f], receipt=receipt)
    for m in record["metrics"]:
        if not isinstance(m, Mapping) or set(m) != {"endpoint", "before", "after"}:
            raise MalformedServingLog("metrics entry", phase=name, field="metrics",
                                      expected="{endpoint, before, after}", actual=m, receipt=receipt)
        for side in ("before", "after"):
            s = m[side]
            if s is not None and (not isinstance(s, Mapping) or set(s) != set(METRIC_COUNTERS)
                                  or not all(_is_int(v) and v >= 0 for v in s.values())):
                raise MalformedServingLog("metrics summary", phase=name, field=f"metrics.{side}",
                                          expected=list(METRIC_COUNTERS), actual=s, receipt=receipt)


# --------------------------------------------------------------------------------------------- conditions


def _phase_list(phases: Mapping[str, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [phases[p] for p in PHASES if p in phases] + [phases[p] for p in sorted(set(phases) - set(PHASES))]


def all_requests_completed(phases: Mapping[str, Mapping[str, Any]]) -> bool:
    """Every phase answered every one of its requests with status 200 (and had requests)."""
    listed = _phase_list(phases)
    return bool(listed) and all(p["rows"] and all(_successful(r) for r in p["rows"]) for p in listed)


def identical_successful_output_tokens(phases: Mapping[str, Mapping[str, Any]]) -> bool:
    """For each request index, all successful answers in all phases carry the same output token ids."""
    by_index: dict[int, set[tuple[int, ...]]] = {}
    request_of: dict[int, str] = {}
    for p in _phase_list(phases):
        for r in p["rows"]:
            i = r["index"]
            if request_of.setdefault(i, r["request_digest"]) != r["request_digest"]:
                raise MalformedServingLog("phases disagree on the request at this index", phase=p.get("phase"),
                                          index=i, field="request_digest", expected=request_of[i],
                                          actual=r["request_digest"])
            if _successful(r):
                by_index.setdefault(i, set()).add(tuple(r["output_token_ids"]))
    return bool(by_index) and all(len(outputs) == 1 for outputs in by_index.values())


def no_cache_hits(phases: Mapping[str, Mapping[str, Any]]) -> bool:
    """Measured zero cache hits (definition in the module docstring)."""
    scraped = 0
    for p in _phase_list(phases):
        answered: dict[str, int] = {}
        for r in p["rows"]:
            if _successful(r):
                answered[r["endpoint"]] = answered.get(r["endpoint"], 0) + 1
        lost = {u["endpoint"] for u in p["unavailable"]}
        by_endpoint = {m["endpoint"]: m for m in p["metrics"]}
        for endpoint, count in answered.items():
            m = by_endpoint.get(endpoint)
            if m is None or m["after"] is None:
                if endpoint in lost:
                    continue
                return False
            if m["before"] is not None and (
                    m["after"]["cache_lookups_total"] - m["before"]["cache_lookups_total"] < count):
                return False
            if m["before"] is None and m["after"]["cache_lookups_total"] < count:
                return False
        for m in p["metrics"]:
            for side in ("before", "after"):
                if m[side] is not None:
                    scraped += 1
                    if m[side]["cache_hits_total"] != 0:
                        return False
    return scraped > 0


def conditions(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """The three serving conditions of the report."""
    return {
        "all_requests_completed": all_requests_completed(phases),
        "identical_successful_output_tokens": identical_successful_output_tokens(phases),
        "no_cache_hits": no_cache_hits(phases),
    }


def four_throughput_ratio(phases: Mapping[str, Mapping[str, Any]]) -> float | None:
    """requests/s of the ``four`` phase over that of ``single`` (each recomputed from its rows)."""
    four = phase_figures(phases["four"]["rows"], phases["four"]["endpoints"])["requests_per_second"]
    single = phase_figures(phases["single"]["rows"], phases["single"]["endpoints"])["requests_per_second"]
    if four is None or single is None or single == 0:
        return None
    return float(four / single)


def serving_summary(phases: Mapping[str, Mapping[str, Any]], *, required: Mapping[str, bool] | None = None,
                    expected_model_digest: str | None = None) -> dict[str, Any]:
    """The report's serving section, recomputed from the phase records.

    ``required``: the contract's serving conditions (name -> must hold); by default all three must hold.
    """
    missing = [p for p in PHASES if p not in phases]
    if missing:
        raise MalformedServingLog("serving phases", field="phases", expected=list(PHASES), actual=sorted(phases))
    figures = {p: phase_figures(phases[p]["rows"], phases[p]["endpoints"]) for p in PHASES}
    conds = conditions(phases)
    need = {c: True for c in CONDITIONS} if required is None else {c: bool(required.get(c, True)) for c in CONDITIONS}
    model_digests = {figures[p]["model_digest"] for p in PHASES}
    model_digest = model_digests.pop() if len(model_digests) == 1 else None
    request_sets = {phases[p]["request_set"] for p in PHASES}
    passed = (all(conds[c] for c in CONDITIONS if need[c])
              and model_digest is not None
              and (expected_model_digest is None or model_digest == expected_model_digest)
              and len(request_sets) == 1
              and bool(figures["failure"]["unavailable"]))
    return {
        "conditions": conds,
        "failure_retries": figures["failure"]["retries"],
        "four_throughput_ratio": four_throughput_ratio(phases),
        "parameter_digest": model_digest,
        "phases": {p: {**report_phase(phases[p]), **{k: figures[p][k] for k in FIGURES}} for p in PHASES},
        "request_set": request_sets.pop() if len(request_sets) == 1 else None,
        "serving_fixture_passed": passed,
    }


def _compare(recorded: Any, recomputed: Any, path: str, receipt: str | None) -> None:
    if isinstance(recomputed, Mapping) and isinstance(recorded, Mapping):
        for key in sorted(set(recorded) | set(recomputed)):
            if key not in recorded or key not in recomputed:
                raise SummaryMismatch(f"summary field {path}{key}", field=f"{path}{key}",
                                      expected=recorded.get(key, "<absent>"),
                                      actual=recomputed.get(key, "<absent>"), receipt=receipt)
            _compare(recorded[key], recomputed[key], f"{path}{key}.", receipt)
    elif recorded != recomputed or type(recorded) is not type(recomputed):
        raise SummaryMismatch(f"summary field {path.rstrip('.')}", field=path.rstrip("."), expected=recorded,
                              actual=recomputed, receipt=receipt)


def verify_serving(phases: Mapping[str, Mapping[str, Any]], *, requests: Sequence[Mapping[str, Any]] | None = None,
                   summary: Mapping[str, Any] | None = None, required: Mapping[str, bool] | None = None,
                   expected_model_digest: str | None = None, receipt: str | None = None) -> dict[str, Any]:
    """Verify every phase record, recompute the serving summary and, when a recorded ``summary`` is given, check
    every field of it (raising :class:`SummaryMismatch` naming the first that differs). Returns the summary."""
    for p in _phase_list(phases):
        verify_phase(p, requests=requests, receipt=receipt)
    recomputed = serving_summary(phases, required=required, expected_model_digest=expected_model_digest)
    if summary is not None:
        _compare(summary, recomputed, "", receipt)
    return recomputed


__all__ = [
    "CONDITIONS",
    "PHASES",
    "MalformedServingLog",
    "PhaseFigureMismatch",
    "RequestDigestMismatch",
    "ResponseDigestMismatch",
    "ServingMismatch",
    "SummaryMismatch",
    "all_requests_completed",
    "conditions",
    "four_throughput_ratio",
    "identical_successful_output_tokens",
    "metrics_summary",
    "no_cache_hits",
    "parse_metrics",
    "percentile",
    "phase_figures",
    "phase_record",
    "report_phase",
    "serving_summary",
    "verify_phase",
    "verify_rows",
    "verify_serving",
]
