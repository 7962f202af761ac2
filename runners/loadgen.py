"""The serving step's load client: a fixed request set, fixed concurrency, fail-over across replicas, three phases.

* :func:`request_set`: a deterministic, content-addressed selection of held-out task documents, interleaved across
  families and variants; its digest is :func:`ledger.serving_digests.request_set_digest`.
* :func:`run_phase`: ``concurrency`` workers take the requests in index order. Request ``i`` goes to the live
  endpoint with the fewest requests in flight (ties: ``i mod n``, then the ones after it); an attempt that meets a
  dead endpoint (connection refused or reset, timeout, a 5xx, an unreadable answer) marks that endpoint unavailable
  (with the error class name) and is retried on another live endpoint, counted as a retry. A 4xx is the final
  answer (the request was wrong, not the replica). Every figure of the phase record is computed from the request
  log by :mod:`verify.serving`, the functions the verifier runs again.
* :func:`start_replicas` / :meth:`ReplicaSet.stop`: replica processes (``python -m runners.serve``) on 127.0.0.1,
  on kernel-chosen ports (reported through a ready file, so parallel starts never race for a port) or from
  ``base_port``. Each is accepted only when its ``/health`` answers with its own pid and the expected model
  digest. They are always stopped (SIGTERM, then SIGKILL), on errors and KeyboardInterrupt too, and each replica
  exits by itself if this process dies.
* :func:`run_serving`: the phases ``single`` (first endpoint), ``four`` (all) and ``failure`` (all; one replica is
  SIGKILLed once a quarter of the requests have started, so requests in flight on it fail over).

Traffic goes only to loopback addresses unless a caller passes ``allow_remote=True``. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

from ledger import serving_digests as sd
from ledger.errors import InputError, LedgerError
from runners.hosts import HostSet
from runners.serve import DEFAULT_MODEL_NAME, ReplicaSpec
from verify import serving as vs

DEFAULT_CONCURRENCY: Final = 4
LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Timeouts:
    """Bounds (seconds) on every wait of the client."""

    connect: float = 2.0
    request: float = 60.0  # reading one completion
    scrape: float = 5.0  # /health and /metrics
    phase: float = 600.0  # a whole phase
    kill: float = 10.0  # the kill action


class ReplicaStartError(LedgerError):
    """A replica did not start (its own one-line error when it printed one)."""


# ----------------------------------------------------------------------------------------------- requests


def _document_fields(doc: Any) -> tuple[str, int, str, str]:
    record = doc if isinstance(doc, Mapping) else doc.to_json()
    try:
        return str(record["family"]), int(record["variant"]), str(record["prompt"]), str(record["document"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"not a task document record: {str(record)[:120]}") from exc


def request_set(documents: Iterable[Any], count: int = 64, *, model: str = DEFAULT_MODEL_NAME,
                max_tokens: int = sd.DEFAULT_MAX_TOKENS) -> list[dict[str, Any]]:
    """``count`` completion requests (OpenAI bodies, temperature 0) from held-out task documents (records or
    :class:`~ledger.experiment.tasks.Document`): documents are grouped by (family, variant), each group ordered by
    document digest, and the groups are taken in turn, so every family and variant is equally represented and the
    set depends only on which documents are given, not on their order."""
    if count < 1:
        raise InputError(f"a request set needs at least one request, not {count}")
    cells: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for doc in documents:
        family, variant, prompt, digest = _document_fields(doc)
        cells.setdefault((family, variant), []).append((digest, prompt))
    total = sum(len(c) for c in cells.values())
    if total < count:
        raise InputError(f"{count} requests asked for, but only {total} documents given")
    ordered = [sorted(cells[k]) for k in sorted(cells)]
    prompts: list[str] = []
    for rank in range(max(len(c) for c in ordered)):
        prompts.extend(c[rank][1] for c in ordered if rank < len(c))
    return [{"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts[:count]]


# --------------------------------------------------------------------------------------------------- phase


@dataclass(frozen=True)
class Kill:
    """Take ``endpoint`` down with ``action`` (e.g. SIGKILL its process) once ``after`` requests have started."""

    after: int
    action: Callable[[], object]
    endpoint: str


def check_endpoints(endpoints: Sequence[str], *, allow_remote: bool = False) -> None:
    if not endpoints:
        raise InputError("a phase needs at least one endpoint")
    for ep in endpoints:
        url = httpx.URL(ep)
        if url.scheme != "http" or not url.host:
            raise InputError(f"endpoint {ep!r} is not an http:// URL")
        if not allow_remote and url.host not in LOOPBACK:
            raise InputError(f"endpoint {ep!r} is not a loopback address (pass allow_remote=True for real hosts)")
    if len(set(endpoints)) != len(endpoints):
        raise InputError("endpoints repeat")


class _Failover:
    """Which endpoints are still live, and which one request ``i`` tries next: the live, untried endpoint with the
    fewest requests in flight (a least-outstanding-requests balancer), ties broken in the order ``i, i + 1, ...``
    modulo the endpoints. Routing by index alone queued a request behind a busy replica while another sat idle: a
    fifth of the cores went unused in the four-replica phase (benchmarks/README.md, serve_bench)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.dead: dict[str, str] = {}
        self.in_flight: dict[str, int] = dict.fromkeys(self.endpoints, 0)

    def next_live(self, index: int, tried: set[str]) -> str | None:
        n = len(self.endpoints)
        best: str | None = None
        for k in range(n):
            ep = self.endpoints[(index + k) % n]
            if ep not in self.dead and ep not in tried and (best is None or self.in_flight[ep] < self.in_flight[best]):
                best = ep
        return best

    def mark(self, endpoint: str, error: str) -> None:
        self.dead.setdefault(endpoint, error)


async def _scrape(client: httpx.AsyncClient, endpoint: str, timeout: float) -> dict[str, int] | None:
    try:
        r = await client.get(f"{endpoint}/metrics", timeout=timeout)
        r.raise_for_status()
        return vs.metrics_summary(r.text)
    except (httpx.HTTPError, ValueError):
        return None


async def _attempt(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[int, Any]:
    r = await client.post(url, content=body, headers={"content-type": "application/json"})
    if r.status_code >= 500:
        return r.status_code, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def _answer(payload: Any) -> dict[str, Any] | None:
    """The fields of a 200 answer the log keeps, or None if it is not a completion of ours."""
    try:
        choice = payload["choices"][0]
        out = {"response_digest": payload["response_digest"], "output_token_ids": choice["token_ids"],
               "text": choice["text"], "finish_reason": choice["finish_reason"],
               "model_digest": payload["model_digest"]}
    except (KeyError, IndexError, TypeError):
        return None
    ids = out["output_token_ids"]
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            and all(isinstance(out[k], str) for k in ("response_digest", "text", "finish_reason", "model_digest"))):
        return None
    return out


async def _request(client: httpx.AsyncClient, index: int, request: Mapping[str, Any], failover: _Failover,
                   t0: float) -> dict[str, Any]:
    body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    started = time.perf_counter() - t0
    errors: list[dict[str, Any]] = []
    tried: set[str] = set()
    row: dict[str, Any] = {"index": index, "request_digest": sd.request_digest(request), "endpoint": None,
                           "status": None, **dict.fromkeys(vs.ANSWER_KEYS)}
    while (endpoint := failover.next_live(index, tried)) is not None:
        tried.add(endpoint)
        failover.in_flight[endpoint] += 1
        try:
            status, payload = await _attempt(client, f"{endpoint}/v1/completions", body)
            error = "HTTPStatusError" if status >= 500 else None
            answer = _answer(payload) if status == 200 else None
            if status == 200 and answer is None:
                error = "InvalidResponse"
        except httpx.HTTPError as exc:  # refused, reset, timed out, protocol error
            error = type(exc).__name__
        finally:
            failover.in_flight[endpoint] -= 1
        if error is not None:
            errors.append({"endpoint": endpoint, "error": error, "at": time.perf_counter() - t0})
            failover.mark(endpoint, error)
            continue
        row.update(endpoint=endpoint, status=status)
        if answer is not None:
            row.update(answer)
        break
    finished = time.perf_counter() - t0
    row.update(attempts=len(errors) + (1 if row["status"] is not None else 0), errors=errors, started_at=started,
               finished_at=finished, latency_seconds=finished - started)
    return row


async def run_phase_async(name: str, endpoints: Sequence[str], requests: Sequence[Mapping[str, Any]],
                          concurrency: int = DEFAULT_CONCURRENCY, run_id: str | None = None, kill: Kill | None = None,
                          *, timeouts: Timeouts = Timeouts(), allow_remote: bool = False) -> dict[str, Any]:
    """:func:`run_phase` inside a running event loop."""
    check_endpoints(endpoints, allow_remote=allow_remote)
    if concurrency < 1:
        raise InputError(f"concurrency must be at least 1, not {concurrency}")
    if not requests:
        raise InputError("a phase needs at least one request")
    if kill is not None and not 0 <= kill.after < len(requests):
        raise InputError(f"kill.after must be in 0..{len(requests) - 1}, not {kill.after}")
    timeout = httpx.Timeout(timeouts.request, connect=timeouts.connect)
    limits = httpx.Limits(max_connections=concurrency * len(endpoints) + len(endpoints),
                          max_keepalive_connections=concurrency * len(endpoints))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        before = await asyncio.gather(*(_scrape(client, ep, timeouts.scrape) for ep in endpoints))
        failover = _Failover(endpoints)
        rows: list[dict[str, Any]] = []
        pending = iter(range(len(requests)))
        killed: dict[str, Any] | None = None

        async def worker() -> None:
            nonlocal killed
            for i in pending:  # one shared iterator: each index is taken once, in order
                if kill is not None and i == kill.after:
                    await asyncio.wait_for(asyncio.to_thread(kill.action), timeouts.kill)
                    killed = {"endpoint": kill.endpoint, "after_requests": kill.after}
                rows.append(await _request(client, i, requests[i], failover, t0))

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeouts.phase)
        except TimeoutError as exc:
            raise LedgerError(f"phase {name} did not finish within {timeouts.phase:g} s") from exc
        after = await asyncio.gather(*(_scrape(client, ep, timeouts.scrape) for ep in endpoints))
    metrics = [{"endpoint": ep, "before": b, "after": a} for ep, b, a in zip(endpoints, before, after, strict=True)]
    return vs.phase_record(name, run_id=run_id or name, endpoints=endpoints, concurrency=concurrency,
                           request_set=sd.request_set_digest(requests), rows=rows, metrics=metrics, killed=killed)


def run_phase(name: str, endpoints: Sequence[str], requests: Sequence[Mapping[str, Any]],
              concurrency: int = DEFAULT_CONCURRENCY, run_id: str | None = None, kill: Kill | None = None, *,
              timeouts: Timeouts = Timeouts(), allow_remote: bool = False) -> dict[str, Any]:
    """Send every request once (with fail-over) at fixed ``concurrency``; return the phase record
    (:func:`verify.serving.phase_record`: settings, figures, replica metrics before/after, and the request log)."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(run_phase_async(name, endpoints, requests, concurrency, run_id, kill, timeouts=timeouts,
                                          allow_remote=allow_remote))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS): the client's share of the
    cores it shares with the replicas fell by a fifth with it (benchmarks/README.md, serve_bench); else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# ------------------------------------------------------------------------------------------------ replicas


@dataclass
class Replica:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path
    health: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid


class ReplicaSet:
    """Running replica processes; a context manager that always stops them."""

    def __init__(self, replicas: list[Replica], workdir: tempfile.TemporaryDirectory[str] | None) -> None:
        self.replicas = replicas
        self._workdir = workdir

    @property
    def endpoints(self) -> list[str]:
        return [r.endpoint for r in self.replicas]

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` and reap it (what the failure phase does mid-phase)."""
        process = self.replicas[i].process
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)

    def killer(self, i: int) -> Callable[[], None]:
        return lambda: self.kill(i)

    def stop(self, grace: float = 5.0) -> None:
        """Stop every replica (SIGTERM, SIGKILL after ``grace`` seconds) and reap it; idempotent."""
        for r in self.replicas:
            if r.process.poll() is None:
                try:
                    r.process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for r in self.replicas:
            try:
                r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait(timeout=10)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or [""])[-1][:400]


def _wait_ready(replica: Replica, ready: Path, spec: ReplicaSpec, deadline: float, timeout: float) -> None:
    while not ready.exists():
        code = replica.process.poll()
        if code is not None:
            raise ReplicaStartError(f"replica exited with code {code}: {_last_line(replica.log) or 'no output'}")
        if time.monotonic() > deadline:
            raise ReplicaStartError(f"replica pid {replica.pid} was not ready within {timeout:g} s")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    replica.endpoint = str(info["endpoint"])
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while True:
            try:
                r = client.get(f"{replica.endpoint}/health")
                if r.status_code == 200:
                    replica.health = r.json()
                    break
            except httpx.HTTPError:
                pass
            if replica.process.poll() is not None:
                raise ReplicaStartError(f"replica exited with code {replica.process.returncode}: "
                                        f"{_last_line(replica.log) or 'no output'}")
            if time.monotonic() > deadline:
                raise ReplicaStartError(f"replica {replica.endpoint} did not answer /health within {timeout:g} s")
            time.sleep(0.05)
    if replica.health.get("pid") != replica.pid:
        raise ReplicaStartError(f"{replica.endpoint} is answered by pid {replica.health.get('pid')}, "
                                f"not by the replica started (pid {replica.pid})")
    if replica.health.get("model_digest") != spec.model_digest:
        raise ReplicaStartError(f"replica {replica.endpoint} serves model {replica.health.get('model_digest')}, "
                                f"expected {spec.model_digest}")


def start_replicas(n: int, spec: ReplicaSpec, *, base_port: int | None = None, host: str = "127.0.0.1",
                   startup_timeout: float = 120.0, log_dir: Path | None = None,
                   hosts: HostSet | None = None) -> ReplicaSet:
    """Start ``n`` replica processes of ``spec`` in parallel and wait until each answers ``/health`` with its pid
    and the expected model digest. Ports: ``base_port + i``, or kernel-chosen when ``base_port`` is None. Replica
    stderr goes to ``<log_dir>/replica-<i>.log`` (a temporary directory by default). On any failure (and on
    KeyboardInterrupt) every replica already started is stopped before the error propagates.

    With ``hosts`` (namespace hosts, :mod:`runners.hosts`), replica i runs on host i at its address instead of on
    loopback; the caller must then run in a namespace that reaches them (:func:`runners.hosts.in_namespace`)."""
    if n < 1:
        raise InputError(f"start at least one replica, not {n}")
    if hosts is not None and len(hosts) < n:
        raise InputError(f"{n} replicas need {n} hosts, {len(hosts)} are up")
    if hosts is None and host not in LOOPBACK:
        raise InputError(f"replicas are started on loopback only, not {host!r}")
    workdir = tempfile.TemporaryDirectory(prefix="ledger-replicas-")
    logs = Path(log_dir) if log_dir is not None else Path(workdir.name)
    logs.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)  # the children import the same code as this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads)}
    replicas: list[Replica] = []
    readies: list[Path] = []
    replica_set = ReplicaSet(replicas, workdir)
    try:
        for i in range(n):
            ready = Path(workdir.name) / f"ready-{i}.json"
            log = logs / f"replica-{i}.log"
            port = 0 if base_port is None else base_port + i
            cmd = [sys.executable, "-m", "runners.serve", *spec.argv(), "--host",
                   host if hosts is None else hosts[i].address, "--port", str(port), "--ready-file", str(ready),
                   "--parent-pid", str(os.getpid())]
            if hosts is not None:
                cmd = hosts[i].argv(cmd)  # exec all the way: the pid is the replica's, its parent is us
            with open(log, "wb") as err:
                process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           env=env, start_new_session=True)
            replicas.append(Replica("", process, log))
            readies.append(ready)
        deadline = time.monotonic() + startup_timeout
        for replica, ready in zip(replicas, readies, strict=True):
            _wait_ready(replica, ready, spec, deadline, startup_timeout)
    except BaseException:
        replica_set.stop(grace=2.0)
        raise
    return replica_set


def stop_replicas(replicas: ReplicaSet) -> None:
    """Stop every replica of ``replicas`` (see :meth:`ReplicaSet.stop`)."""
    replicas.stop()


# ------------------------------------------------------------------------------------------------- serving


def run_serving(replicas: ReplicaSet, requests: Sequence[Mapping[str, Any]], *,
                concurrency: int = DEFAULT_CONCURRENCY, run_prefix: str = "serve", kill_index: int = 1,
                kill_after: int | None = None, timeouts: Timeouts = Timeouts(),
                allow_remote: bool = False) -> dict[str, Any]:
    """The three phases over running replicas: ``single`` (the first endpoint), ``four`` (all of them) and
    ``failure`` (all; replica ``kill_index`` is SIGKILLed once ``kill_after`` requests have started, default a
    quarter). Returns {request_set, requests, replicas (their /health at the start), phases}."""
    endpoints = replicas.endpoints
    if len(endpoints) < 2 or not 0 <= kill_index < len(endpoints):
        raise InputError(f"the failure phase needs at least two replicas and kill_index in 0..{len(endpoints) - 1}")
    after = len(requests) // 4 if kill_after is None else kill_after
    phases = {
        "single": run_phase("single", endpoints[:1], requests, concurrency, f"{run_prefix}-single",
                            timeouts=timeouts, allow_remote=allow_remote),
        "four": run_phase("four", endpoints, requests, concurrency, f"{run_prefix}-four", timeouts=timeouts,
                          allow_remote=allow_remote),
        "failure": run_phase("failure", endpoints, requests, concurrency, f"{run_prefix}-failure",
                             Kill(after, replicas.killer(kill_index), endpoints[kill_index]), timeouts=timeouts,
                             allow_remote=allow_remote),
    }
    return {
        "request_set": sd.request_set_digest(requests),
        "requests": [dict(r) for r in requests],
        "replicas": [{"endpoint": r.endpoint, **r.health} for r in replicas.replicas],
        "phases": phases,
    }


__all__ = [
    "Kill",
    "Replica",
    "ReplicaSet",
    "ReplicaStartError",
    "Timeouts",
    "check_endpoints",
    "request_set",
    "run_phase",
    "run_phase_async",
    "run_serving",
    "start_replicas",
    "stop_replicas",
]
