"""verify/serving.py on hand-built request logs: every figure recomputes, every tampering is named.

The logs here are built with the same digest functions the replicas use (ledger/serving_digests.py); the real
replicas' logs are verified end to end in tests/runners/test_serve.py.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from ledger import serving_digests as sd
from ledger.errors import VerificationError
from verify import serving as vs

MODEL_DIGEST = "blake3:" + "ab" * 32
EPS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003", "http://127.0.0.1:9004"]
N = 12


def _requests() -> list[dict[str, Any]]:
    return [{"model": "m", "prompt": f"sort: {i} 3 1 -> ", "max_tokens": 8, "temperature": 0} for i in range(N)]


def _tokens(i: int) -> list[int]:
    return [4 + (i * 7 + k) % 11 for k in range(1 + i % 5)]


def _row(i: int, endpoint: str, *, started: float, latency: float, errors: list[dict[str, Any]] | None = None,
         status: int | None = 200, tokens: list[int] | None = None) -> dict[str, Any]:
    req = _requests()[i]
    ids = _tokens(i) if tokens is None else tokens
    text = "".join(chr(96 + t) for t in ids)
    errs = errors or []
    finished = started + latency
    answer = status == 200
    rd = sd.request_digest(req)
    return {"index": i, "request_digest": rd, "endpoint": endpoint if status is not None else None,
            "attempts": len(errs) + (status is not None), "errors": errs, "status": status,
            "started_at": started, "finished_at": finished, "latency_seconds": finished - started,
            "response_digest": sd.response_digest(rd, ids, text) if answer else None,
            "output_token_ids": ids if answer else None, "text": text if answer else None,
            "finish_reason": "stop" if answer else None, "model_digest": MODEL_DIGEST if answer else None}


def _metrics(endpoints: list[str], rows: list[dict[str, Any]], *, base: int = 0, hits: int = 0,
             dead: str | None = None) -> list[dict[str, Any]]:
    out = []
    for ep in endpoints:
        served = sum(1 for r in rows if r["endpoint"] == ep and r["status"] == 200)
        before = {"requests_total": base, "errors_total": 0, "completions_total": base,
                  "cache_lookups_total": 2 * base, "cache_hits_total": 0}
        after = {"requests_total": base + served, "errors_total": 0, "completions_total": base + served,
                 "cache_lookups_total": 2 * (base + served), "cache_hits_total": hits}
        out.append({"endpoint": ep, "before": before, "after": None if ep == dead else after})
    return out


def _phases(seed: int = 0) -> dict[str, dict[str, Any]]:
    rng = random.Random(seed)
    reqs = _requests()
    out = {}
    for name, endpoints in (("single", EPS[:1]), ("four", EPS), ("failure", EPS)):
        rows = []
        for i in range(N):
            errors = None
            ep = endpoints[i % len(endpoints)]
            if name == "failure" and ep == EPS[1] and i >= 4:
                errors = [{"endpoint": EPS[1], "error": "ConnectError" if i > 5 else "ReadError", "at": 0.01 * i}]
                ep = EPS[2]
            rows.append(_row(i, ep, started=0.005 * i, latency=rng.uniform(0.01, 0.2), errors=errors))
        metrics = _metrics(endpoints, rows, base=10, dead=EPS[1] if name == "failure" else None)
        out[name] = vs.phase_record(name, run_id=f"t-{name}", endpoints=endpoints, concurrency=4,
                                    request_set=sd.request_set_digest(reqs), rows=rows, metrics=metrics)
    return out


# ---------------------------------------------------------------------------------------------- figures


def test_percentile_is_numpys_linear_method() -> None:
    assert vs.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert vs.percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85, rel=1e-15)
    assert vs.percentile([7.0], 95) == 7.0 and vs.percentile([], 50) is None
    rng = random.Random(3)
    for n in range(1, 70):
        xs = [rng.expovariate(3.0) for _ in range(n)]
        for p in (0, 5, 25, 50, 90, 95, 99, 100):
            assert vs.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError):
        vs.percentile([1.0], 0.95)  # type: ignore[arg-type]


def test_phase_figures_recompute_from_rows() -> None:
    phases = _phases()
    failure = phases["failure"]
    assert failure["requests"] == failure["successful"] == N
    assert failure["retries"] == sum(1 for r in failure["rows"] if r["errors"])
    assert failure["unavailable"] == [{"endpoint": EPS[1], "error": "ReadError"}]  # its earliest error
    rows = failure["rows"]
    seconds = max(r["finished_at"] for r in rows) - min(r["started_at"] for r in rows)
    assert failure["seconds"] == seconds and failure["requests_per_second"] == N / seconds
    lat = sorted(r["latency_seconds"] for r in rows)
    assert failure["median_latency_seconds"] == vs.percentile(lat, 50)
    assert failure["model_digest"] == MODEL_DIGEST
    for p in phases.values():
        vs.verify_phase(p, requests=_requests())


def test_summary_has_the_reports_shape_and_passes() -> None:
    phases = _phases()
    summary = vs.verify_serving(phases, requests=_requests(), expected_model_digest=MODEL_DIGEST)
    assert set(summary) >= {"conditions", "failure_retries", "four_throughput_ratio", "phases",
                            "serving_fixture_passed", "parameter_digest"}
    assert summary["conditions"] == dict.fromkeys(vs.CONDITIONS, True)
    assert summary["serving_fixture_passed"] is True
    assert summary["four_throughput_ratio"] == (phases["four"]["requests_per_second"]
                                                / phases["single"]["requests_per_second"])
    assert set(summary["phases"]["four"]) == set(vs.REPORT_PHASE_FIELDS)
    vs.verify_serving(phases, summary=summary)  # a recorded summary that recomputes
    forged = copy.deepcopy(summary)
    forged["four_throughput_ratio"] *= 1.5
    with pytest.raises(vs.SummaryMismatch, match="four_throughput_ratio") as err:
        vs.verify_serving(phases, summary=forged)
    assert err.value.field == "four_throughput_ratio"
    forged = copy.deepcopy(summary)
    forged["phases"]["failure"]["p95_latency_seconds"] = 0.001
    with pytest.raises(vs.SummaryMismatch, match="phases.failure.p95_latency_seconds"):
        vs.verify_serving(phases, summary=forged)
    assert vs.serving_summary(phases, expected_model_digest="blake3:" + "00" * 32)["serving_fixture_passed"] is False


# ---------------------------------------------------------------------------------------------- tamper


def test_a_changed_response_digest_names_the_request() -> None:
    phases = _phases()
    row = phases["four"]["rows"][7]
    row["response_digest"] = sd.response_digest(row["request_digest"], row["output_token_ids"], row["text"] + "x")
    with pytest.raises(vs.ResponseDigestMismatch, match="phase four: request 7: response digest") as err:
        vs.verify_serving(phases, requests=_requests())
    assert err.value.index == 7 and err.value.phase == "four" and err.value.field == "response_digest"
    assert isinstance(err.value, VerificationError) and err.value.diagnostics()["index"] == 7


def test_changed_tokens_without_a_new_digest_are_caught() -> None:
    phases = _phases()
    phases["single"]["rows"][3]["output_token_ids"] = [5, 5, 5]
    with pytest.raises(vs.ResponseDigestMismatch, match="request 3"):
        vs.verify_phase(phases["single"], requests=_requests())


@pytest.mark.parametrize("field", ["p95_latency_seconds", "median_latency_seconds", "requests_per_second",
                                   "seconds", "successful", "retries", "unavailable", "model_digest"])
def test_a_changed_phase_figure_is_named(field: str) -> None:
    phases = _phases()
    value = phases["failure"][field]
    phases["failure"][field] = (value * 0.5 if isinstance(value, float) else value + 1 if isinstance(value, int)
                                else [] if isinstance(value, list) else "blake3:" + "cd" * 32)
    with pytest.raises(vs.PhaseFigureMismatch, match=f"phase failure: {field}") as err:
        vs.verify_phase(phases["failure"])
    assert err.value.field == field


def test_latency_request_digest_and_indices_are_checked() -> None:
    phases = _phases()
    phases["four"]["rows"][2]["latency_seconds"] += 1e-9
    with pytest.raises(vs.PhaseFigureMismatch, match="request 2: latency"):
        vs.verify_phase(phases["four"])
    phases = _phases()
    other = _requests()
    other[5] = {**other[5], "prompt": "different"}
    with pytest.raises(vs.RequestDigestMismatch, match="request 5: request digest"):
        vs.verify_phase(phases["four"], requests=other)
    phases = _phases()
    phases["four"]["rows"][4]["index"] = 3
    with pytest.raises(vs.MalformedServingLog, match="request indices"):
        vs.verify_phase(phases["four"])
    phases = _phases()
    phases["four"]["rows"][1]["attempts"] = 3
    with pytest.raises(vs.MalformedServingLog, match="request 1: row field attempts"):
        vs.verify_phase(phases["four"])
    phases = _phases()
    del phases["four"]["rows"][1]["text"]
    with pytest.raises(vs.MalformedServingLog, match="keys"):
        vs.verify_phase(phases["four"])


# ------------------------------------------------------------------------------------------ conditions


def test_different_tokens_across_phases_fail_the_identity_condition() -> None:
    phases = _phases()
    rows = phases["failure"]["rows"]
    rows[6] = _row(6, rows[6]["endpoint"], started=rows[6]["started_at"], latency=0.05, errors=rows[6]["errors"],
                   tokens=[9, 9])
    phases["failure"] = vs.phase_record("failure", run_id="t", endpoints=EPS, concurrency=4,
                                        request_set=phases["failure"]["request_set"], rows=rows,
                                        metrics=phases["failure"]["metrics"])
    vs.verify_phase(phases["failure"], requests=_requests())  # a consistent log ...
    summary = vs.serving_summary(phases)
    assert summary["conditions"]["identical_successful_output_tokens"] is False  # ... of a different answer
    assert summary["serving_fixture_passed"] is False


def test_a_failed_request_fails_completion() -> None:
    phases = _phases()
    rows = phases["failure"]["rows"]
    errors = [{"endpoint": ep, "error": "ConnectError", "at": 0.5 + k / 10} for k, ep in enumerate(EPS)]
    rows[9] = _row(9, EPS[1], started=0.4, latency=0.3, errors=errors, status=None)
    phases["failure"] = vs.phase_record("failure", run_id="t", endpoints=EPS, concurrency=4,
                                        request_set=phases["failure"]["request_set"], rows=rows,
                                        metrics=phases["failure"]["metrics"])
    vs.verify_phase(phases["failure"])
    assert phases["failure"]["successful"] == N - 1
    assert phases["failure"]["retries"] == sum(len(r["errors"]) for r in rows) - 1
    assert vs.conditions(phases)["all_requests_completed"] is False
    assert vs.conditions(phases)["identical_successful_output_tokens"] is True


def test_no_cache_hits_is_measured() -> None:
    assert vs.no_cache_hits(_phases()) is True  # the killed replica has no scrape after, and is unavailable
    phases = _phases()
    phases["four"]["metrics"][2]["after"]["cache_hits_total"] = 1
    assert vs.no_cache_hits(phases) is False
    phases = _phases()
    phases["four"]["metrics"][0]["after"]["cache_lookups_total"] = phases["four"]["metrics"][0]["before"][
        "cache_lookups_total"]  # answered requests without consulting (counting) a cache
    assert vs.no_cache_hits(phases) is False
    phases = _phases()
    phases["four"]["metrics"][3]["after"] = None  # a replica that answered but was not scraped, and not lost
    assert vs.no_cache_hits(phases) is False
    phases = _phases()
    for p in phases.values():
        for m in p["metrics"]:
            m["before"] = m["after"] = None
    assert vs.no_cache_hits(phases) is False  # nothing measured


def test_a_failure_phase_without_a_failure_does_not_pass() -> None:
    phases = _phases()
    phases["failure"] = copy.deepcopy(phases["four"]) | {"phase": "failure"}
    summary = vs.serving_summary(phases)
    assert all(summary["conditions"].values()) and summary["serving_fixture_passed"] is False


def test_contract_can_waive_a_condition() -> None:
    phases = _phases()
    phases["four"]["metrics"][2]["after"]["cache_hits_total"] = 3
    assert vs.serving_summary(phases)["serving_fixture_passed"] is False
    waived = vs.serving_summary(phases, required={"no_cache_hits": False})
    assert waived["conditions"]["no_cache_hits"] is False and waived["serving_fixture_passed"] is True


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_exposition_is_parsed_and_summed() -> None:
    text = "\n".join([
        "# HELP requests_total HTTP requests", "# TYPE requests_total counter",
        'requests_total{route="/v1/completions"} 7', 'requests_total{route="/health"} 2',
        'errors_total{status="400"} 3', 'errors_total{status="404"} 1', "completions_total 4",
        'cache_lookups_total{cache="response"} 4', 'cache_lookups_total{cache="prefix"} 4',
        'cache_hits_total{cache="response"} 0', 'cache_hits_total{cache="prefix"} 0',
        "generation_seconds_total 0.25",
        'model_info{model="a \\"quoted\\" name",model_digest="blake3:00"} 1', ""])
    assert vs.metrics_summary(text) == {"requests_total": 9, "errors_total": 4, "completions_total": 4,
                                        "cache_lookups_total": 8, "cache_hits_total": 0}
    info = [s for s in vs.parse_metrics(text) if s[0] == "model_info"][0]
    assert info[1] == {"model": 'a "quoted" name', "model_digest": "blake3:00"}
    with pytest.raises(ValueError):
        vs.parse_metrics("not a sample line at all {")


def test_verify_serving_imports_no_torch_and_no_runner() -> None:
    code = ("import sys, verify.serving; bad = [m for m in sys.modules if m == 'torch' or m.startswith('runners')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
