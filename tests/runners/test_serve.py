"""The serving step on a real (tiny) experiment: replicas over loopback, real uvicorn, real clients, no mocks.

A tiny experiment is prepared (runners/prepare.py) and its seed model trained for a few steps on the held-out
answers, so completions both stop at EOS and run to max_tokens. One replica runs in-process (uvicorn in a thread)
for the protocol tests; the phase tests start replica processes with runners/loadgen.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from ledger import serving_digests as sd
from ledger.artifacts import ArtifactStore, read_jsonl, workdir_root
from ledger.errors import DigestMismatch
from ledger.experiment.config import config_from_dict
from ledger.store import Store
from runners import loadgen
from runners.checkpoint import save_checkpoint
from runners.model import greedy_generate
from runners.prepare import pinned_threads, prepare
from runners.rng import Rngs
from runners.serve import (
    ReplicaSpec,
    app_for,
    bind,
    decode,
    endpoint_of,
    load_replica,
    serve_replica,
    uvicorn_server,
)
from verify import serving as vs

TINY: dict[str, Any] = {
    "data": {"train_per_variant": 8, "eval_per_variant": 4, "retention_probes": 4},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 64},
    "pretrain": {"steps": 2, "batch_size": 2, "seq_len": 16, "task_documents": 8},
}
MODEL = "tiny-served"


@dataclass
class Served:
    spec: ReplicaSpec  # the trained checkpoint
    seed_spec: ReplicaSpec  # the seed checkpoint (another model)
    documents: list[dict[str, Any]]
    loaded: Any  # runners.serve.LoadedReplica of ``spec``


def _train(loaded: Any, documents: list[dict[str, Any]], steps: int = 200) -> torch.optim.Optimizer:
    """AdamW steps on the documents' answers (+EOS): the model then stops by itself on most prompts (not all) and
    its outputs differ from prompt to prompt."""
    model, tok = loaded.model, loaded.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        batch = [documents[(step * 8 + i) % len(documents)] for i in range(8)]
        rows = [(tok.encode(d["prompt"], bos=True), tok.encode(d["answer"], eos=True)) for d in batch]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tok.pad_id)
        mask = torch.zeros((len(rows), width - 1))
        for i, (p, a) in enumerate(rows):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
        nll = F.cross_entropy(model(ids[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return optimizer


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    root = tmp_path_factory.mktemp("serve-experiment")
    config = config_from_dict(TINY)
    with Store.open(root / "ledger.db", create=True) as store, pinned_threads(1):
        result = prepare(config, root, store)
    arts = ArtifactStore(workdir_root(root))
    a = result.artifacts
    seed_spec = ReplicaSpec(checkpoint=result.seed_checkpoint, state=a["seed_state"], model_digest=a["model"],
                            tokenizer=arts.path_for(a["tokenizer"]), config=arts.path_for(a["config"]),
                            model_name=MODEL, tokenizer_digest=a["tokenizer"], config_digest=a["config"])
    documents = read_jsonl(arts, a["eval_selection"], name="eval_selection")
    with pinned_threads(1):
        seed = load_replica(seed_spec)
        optimizer = _train(seed, documents)
        saved = save_checkpoint(root / "trained", model=seed.model, optimizer=optimizer, rngs=Rngs.from_seed(1, 0),
                                cursor=200, meta={"run": "serve-test", "rank": 0, "step": 200})
    spec = replace(seed_spec, checkpoint=saved.path, state=saved.digest,
                   model_digest=str(saved.manifest.components["model"]))
    with pinned_threads(1):
        loaded = load_replica(spec)
    return Served(spec, seed_spec, documents, loaded)


class ThreadedServer:
    """A real uvicorn server in a thread of this process, on a kernel-chosen loopback port; ``server_for`` makes the
    server for the app (the replica's own, by default)."""

    def __init__(self, app: Any, server_for: Callable[[Any], Any] = uvicorn_server) -> None:
        self.sock = bind("127.0.0.1", 0)
        self.endpoint = endpoint_of(self.sock)
        self.server = server_for(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(served: Served) -> Iterator[str]:
    torch.set_num_threads(1)
    with ThreadedServer(app_for(served.loaded, served.spec)) as s:
        yield s.endpoint


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=30) as c:
        yield c


def _complete(client: httpx.Client, endpoint: str, prompt: str, **extra: Any) -> dict[str, Any]:
    r = client.post(f"{endpoint}/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _serve_children() -> list[int]:
    """Live replica processes whose parent is this process (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"runners.serve" in cmdline:
            out.append(int(entry.name))
    return out


# ------------------------------------------------------------------------------------ in-process replica


def test_decode_is_greedy_generate_for_one_prompt(served: Served) -> None:
    tok, model = served.loaded.tokenizer, served.loaded.model
    finishes = set()
    with pinned_threads(1):
        for i, doc in enumerate(served.documents[:16]):
            ids = tok.encode(doc["prompt"], bos=True)
            n = 3 if i % 2 else 16
            d = decode(model, ids, eos_id=tok.eos_id, max_new_tokens=n, top_logprobs=2)
            assert d.token_ids == greedy_generate(model, [ids], eos_id=tok.eos_id, max_new_tokens=n)[0]
            assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
            finishes.add(d.finish_reason)
    assert finishes == {"stop", "length"}


def test_completion_response_shape_digests_and_determinism(served: Served, server: str,
                                                           client: httpx.Client) -> None:
    doc = served.documents[3]
    request = {"model": MODEL, "prompt": doc["prompt"], "max_tokens": 12, "temperature": 0, "seed": 5, "logprobs": 2}
    first = client.post(f"{server}/v1/completions", json=request)
    second = client.post(f"{server}/v1/completions", json={**request, "seed": 99})  # seed is ignored
    assert first.status_code == 200 and first.content == second.content  # byte-identical, created = 0
    body = first.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["created"] == 0 and body["model"] == MODEL
    assert body["model_digest"] == served.spec.model_digest
    assert body["request_digest"] == sd.request_digest(request)
    assert body["response_digest"] == sd.response_digest(sd.request_digest(request), choice["token_ids"],
                                                         choice["text"])
    assert body["id"] == "cmpl-" + body["response_digest"].removeprefix("blake3:")[:32]
    tok = served.loaded.tokenizer
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": len(doc["prompt"]) + 1, "completion_tokens": len(choice["token_ids"]),
                             "total_tokens": len(doc["prompt"]) + 1 + len(choice["token_ids"])}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(choice["token_ids"])
    assert all(len(top) == 2 and max(top.values()) == v for top, v in zip(lp["top_logprobs"], lp["token_logprobs"],
                                                                           strict=True))
    models = client.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    health = client.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["model_digest"] == served.spec.model_digest
    assert health["state_digest"] == served.spec.state


def test_a_loopback_round_trip_does_not_wait_for_a_delayed_ack(server: str, client: httpx.Client) -> None:
    # Without TCP_NODELAY on accepted connections, Nagle holds each response body back until the client's delayed
    # ACK of the headers: 40 ms on every request (runners/serve.py: bind).
    times = []
    for _ in range(15):
        t = time.perf_counter()
        client.get(f"{server}/health").raise_for_status()
        times.append(time.perf_counter() - t)
    assert sorted(times)[len(times) // 2] < 0.035  # a stall makes every one >= 40 ms


def test_official_openai_client_gets_the_same_completion(served: Served, server: str, client: httpx.Client) -> None:
    import openai

    oai = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        for doc in served.documents[:4]:
            got = oai.completions.create(model=MODEL, prompt=doc["prompt"], max_tokens=10, temperature=0, seed=1,
                                         logprobs=1)
            ours = _complete(client, server, doc["prompt"], max_tokens=10, seed=1, logprobs=1)
            assert got.object == "text_completion" and got.model == MODEL
            assert got.choices[0].text == ours["choices"][0]["text"]
            assert got.choices[0].finish_reason == ours["choices"][0]["finish_reason"]
            assert got.choices[0].logprobs is not None
            assert got.choices[0].logprobs.token_logprobs == ours["choices"][0]["logprobs"]["token_logprobs"]
            assert got.usage is not None and got.usage.total_tokens == ours["usage"]["total_tokens"]
            extra = got.model_dump()
            assert extra["response_digest"] == ours["response_digest"]
            assert extra["model_digest"] == served.spec.model_digest
    finally:
        oai.close()


def test_a_thousand_bad_requests_get_openai_errors_and_serving_continues(served: Served, server: str,
                                                                         client: httpx.Client) -> None:
    prompt = served.documents[0]["prompt"]
    good = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reference = _complete(client, server, prompt, max_tokens=8)
    limit = served.loaded.max_prompt_chars

    def body(value: Any) -> bytes:
        return json.dumps(value).encode()

    kinds: list[tuple[str, str, bytes, int, str | None]] = [  # (method, path, body, status, param)
        ("POST", "/v1/completions", b'{"model": "tiny-served", "prompt": ', 400, None),  # malformed JSON
        ("POST", "/v1/completions", body({k: v for k, v in good.items() if k != "prompt"}), 400, "prompt"),
        ("POST", "/v1/completions", body({**good, "max_tokens": "8"}), 400, "max_tokens"),  # mistyped
        ("POST", "/v1/completions", body({**good, "prompt": "1" * (limit + 1)}), 400, "prompt"),  # oversized
        ("POST", "/v1/completions", body({**good, "max_tokens": 10_000}), 400, "max_tokens"),
        ("POST", "/v1/completions", body({**good, "temperature": 0.7}), 400, "temperature"),
        ("POST", "/v1/completions", body({**good, "model": "gpt-x"}), 404, "model"),  # unknown model
        ("POST", "/v1/completions", body({**good, "prompt": "sort: \u00e9\u4e2d -> "}), 400, "prompt"),  # unknown
        ("GET", "/v1/completions", b"", 405, None),  # wrong method
        ("POST", "/v1/complete", body(good), 404, None),  # wrong path
    ]
    before = vs.metrics_summary(client.get(f"{server}/metrics").text)

    async def send_all() -> list[tuple[int, httpx.Response]]:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as ac:
            sem = asyncio.Semaphore(8)

            async def one(k: int) -> tuple[int, httpx.Response]:
                method, path, content, _, _ = kinds[k % len(kinds)]
                async with sem:
                    return k % len(kinds), await ac.request(method, f"{server}{path}", content=content or None)

            return await asyncio.gather(*(one(k) for k in range(1000)))

    for kind, r in asyncio.run(send_all()):
        _, _, _, status, param = kinds[kind]
        assert r.status_code == status, (kind, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (kind, error)
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert error["param"] == param, (kind, error)
    after = vs.metrics_summary(client.get(f"{server}/metrics").text)
    assert after["errors_total"] - before["errors_total"] == 1000
    assert after["completions_total"] == before["completions_total"]  # no bad request reached the model
    assert client.post(f"{server}/v1/completions", content=b"x" * 10_000_000).status_code == 413
    again = _complete(client, server, prompt, max_tokens=8)
    assert again == reference


def test_concurrent_mixed_requests_give_the_tokens_of_one_at_a_time(served: Served, server: str,
                                                                    client: httpx.Client) -> None:
    variants = [{"max_tokens": 16}, {"max_tokens": 5, "logprobs": 3}, {"max_tokens": 24}]
    requests = [{"model": MODEL, "prompt": d["prompt"], "temperature": 0, **variants[i % 3]}
                for i, d in enumerate(served.documents[:24])]
    alone = [client.post(f"{server}/v1/completions", json=r).content for r in requests]

    async def together() -> list[bytes]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as ac:
            noise = [ac.post(f"{server}/v1/completions", content=b"{bad") for _ in range(8)]
            noise += [ac.get(f"{server}/health") for _ in range(8)]
            calls = [ac.post(f"{server}/v1/completions", json=r) for r in requests * 3]
            done = await asyncio.gather(*calls, *noise)
            return [r.content for r in done[: len(calls)]]

    mixed = asyncio.run(together())
    assert mixed == alone * 3  # byte-identical: same tokens, logprobs, digests whatever else is in flight


def test_health_and_metrics_answer_while_generation_is_busy(served: Served, server: str) -> None:
    # The generation thread is held inside the model's first forward pass (a hook on the real model, released by
    # the test), so "busy" does not depend on how the GIL shares this process's threads: racing real completions
    # against the probes saw at most one in flight on a loaded CI machine.
    prompt = served.documents[1]["prompt"]
    gate = threading.Event()
    entered = threading.Event()

    def hold(module: Any, args: Any) -> None:
        entered.set()
        assert gate.wait(timeout=60), "the test never released the generation thread"

    hook = served.loaded.model.register_forward_pre_hook(hold)

    async def run() -> tuple[list[int], list[str]]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as ac:
            calls = [asyncio.create_task(ac.post(f"{server}/v1/completions",
                                                 json={"model": MODEL, "prompt": prompt + "x" * i,
                                                       "max_tokens": 4, "temperature": 0}))
                     for i in range(3)]
            seen: list[int] = []
            exposed: list[str] = []
            deadline = time.monotonic() + 30
            try:
                while not (seen and seen[-1] == 3 and entered.is_set()):  # all admitted, the first one generating
                    assert time.monotonic() < deadline, f"in_flight never reached 3 (saw {seen[-5:]})"
                    h = await ac.get(f"{server}/health", timeout=10)
                    m = await ac.get(f"{server}/metrics", timeout=10)
                    assert h.status_code == 200 and m.status_code == 200
                    seen.append(h.json()["in_flight"])
                    exposed.append(next(line for line in m.text.splitlines() if line.startswith("in_flight ")))
                    await asyncio.sleep(0.005)
                assert not any(c.done() for c in calls)
            finally:
                gate.set()
            assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3
            after = (await ac.get(f"{server}/health")).json()["in_flight"]
            return seen + [after], exposed

    try:
        seen, exposed = asyncio.run(run())
    finally:
        gate.set()
        hook.remove()
    assert seen[-2:] == [3, 0]  # one generating, two queued behind it; none once they are answered
    assert exposed[-1].split()[-1] == "3"  # /metrics says what /health says
    assert seen == sorted(seen[:-1]) + [0]  # admitted completions only accumulate while generation is held


def test_replica_refuses_a_checkpoint_that_is_not_the_expected_one(served: Served) -> None:
    other_model = replace(served.spec, model_digest=served.seed_spec.model_digest)
    with pytest.raises(DigestMismatch, match="component 'model'"):
        load_replica(other_model)
    wrong_tokenizer = replace(served.spec, tokenizer_digest=served.spec.config_digest)
    with pytest.raises(DigestMismatch, match="tokenizer artifact"):
        load_replica(wrong_tokenizer)


@pytest.mark.slow
def test_replica_process_exits_with_one_line_error_on_another_checkpoints_digest(served: Served) -> None:
    other = replace(served.spec, state=served.seed_spec.state)  # the trained checkpoint, the seed's digest
    proc = subprocess.run([sys.executable, "-m", "runners.serve", *other.argv(), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "state digest" in lines[0], proc.stderr
    assert served.seed_spec.state in lines[0]
    with pytest.raises(loadgen.ReplicaStartError, match="state digest"):
        loadgen.start_replicas(2, other, startup_timeout=60)
    assert _serve_children() == []


# ---------------------------------------------------------------------------------- replica processes


@pytest.mark.slow
def test_three_phases_fail_over_and_verify(served: Served) -> None:
    requests = loadgen.request_set(served.documents, 64, model=MODEL, max_tokens=16)
    assert len({r["prompt"] for r in requests}) == 64
    assert loadgen.request_set(list(reversed(served.documents)), 64, model=MODEL) == requests
    with loadgen.start_replicas(4, served.spec) as replicas:
        pids = [r.pid for r in replicas.replicas]
        assert sorted(_serve_children()) == sorted(pids)
        record = loadgen.run_serving(replicas, requests, kill_index=1)
    assert _serve_children() == []  # stopped and reaped, the killed one too
    phases = record["phases"]
    summary = vs.verify_serving(phases, requests=requests, expected_model_digest=served.spec.model_digest)
    assert summary["conditions"] == {"all_requests_completed": True, "identical_successful_output_tokens": True,
                                     "no_cache_hits": True}
    assert summary["serving_fixture_passed"] is True
    failure = phases["failure"]
    killed = replicas.endpoints[1]
    assert failure["killed"] == {"endpoint": killed, "after_requests": 16}
    assert [u["endpoint"] for u in failure["unavailable"]] == [killed]
    assert failure["retries"] >= 1 and failure["successful"] == 64
    assert summary["failure_retries"] == failure["retries"]
    assert all(phases[p]["successful"] == 64 and phases[p]["unavailable"] == [] for p in ("single", "four"))
    assert {r["endpoint"] for r in phases["four"]["rows"]} == set(replicas.endpoints)
    # Every replica served exactly what this process computes for the same prompt alone.
    tok = served.loaded.tokenizer
    with pinned_threads(1):
        for row in phases["four"]["rows"][:16]:
            ids = tok.encode(requests[row["index"]]["prompt"], bos=True)
            assert row["output_token_ids"] == decode(served.loaded.model, ids, eos_id=tok.eos_id,
                                                     max_new_tokens=16).token_ids
    # One response digest changed in the failure phase's log: verification names the request.
    tampered = json.loads(json.dumps(phases))
    row = tampered["failure"]["rows"][37]
    row["response_digest"] = sd.response_digest(row["request_digest"], row["output_token_ids"], row["text"] + "!")
    with pytest.raises(vs.ResponseDigestMismatch, match="phase failure: request 37: response digest") as err:
        vs.verify_serving(tampered, requests=requests)
    assert err.value.index == 37 and err.value.field == "response_digest"


@pytest.mark.slow
def test_replicas_are_stopped_when_the_caller_is_interrupted(served: Served) -> None:
    with pytest.raises(KeyboardInterrupt):
        with loadgen.start_replicas(1, served.spec) as replicas:
            assert _serve_children() == [replicas.replicas[0].pid]
            raise KeyboardInterrupt
    assert _serve_children() == []
    with pytest.raises(Exception, match="loopback"):
        loadgen.run_phase("single", ["http://192.0.2.1:9090"], [{"model": MODEL, "prompt": "x"}])


def test_a_trailing_slash_is_an_unknown_path_and_a_disconnect_is_not_a_server_error(served: Served, server: str,
                                                                                      client: httpx.Client) -> None:
    """Starlette redirected '/v1/completions/' with a bodiless 307; a client gone mid-body ended in a traceback
    counted as a 500. Now: 404 in OpenAI's shape, and a 400 counted, no 500."""
    import socket
    import time
    from urllib.parse import urlparse

    r = client.post(f"{server}/v1/completions/", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    before = client.get(f"{server}/metrics").text
    url = urlparse(server)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        time.sleep(0.3)
    for _ in range(50):  # the server notices the disconnect on its own loop
        after = client.get(f"{server}/metrics").text
        if after != before and 'status="400"' in after:
            break
        time.sleep(0.1)
    assert 'errors_total{status="500"}' not in after, after
    assert _complete(client, server, served.documents[0]["prompt"], max_tokens=2)["choices"]


def test_the_endpoint_is_announced_once_bound_and_a_busy_port_is_one_line(served: Served) -> None:
    """`ledger serve` announced 'on http://127.0.0.1:0' before verifying or binding; serve_replica now calls back
    with the bound endpoint (the kernel's port), and a port it cannot bind is an InputError naming it."""
    import re
    import socket

    from ledger.errors import InputError

    class Bound(Exception):
        pass

    def listening(endpoint: str) -> None:
        raise Bound(endpoint)  # stop before serving: the announcement is what is tested

    with pytest.raises(Bound) as info:
        serve_replica(served.spec, port=0, listening=listening)
    assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*", str(info.value)), info.value
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(InputError, match=f"cannot listen on 127.0.0.1:{port}: "):
            serve_replica(served.spec, port=port, listening=listening)


def test_a_connection_whose_request_does_not_arrive_is_closed(served: Served) -> None:
    """uvicorn times out only idle keep-alive connections after a response: a client that connects and sends
    nothing, or a byte at a time, held its socket forever (20,000 of them stopped the server answering). Each
    request must now arrive within the deadline; a request that did is answered however long it takes."""
    import socket
    from urllib.parse import urlparse

    app = app_for(served.loaded, served.spec)
    with ThreadedServer(app, lambda a: uvicorn_server(a, request_timeout=0.5)) as server:
        url = urlparse(server.endpoint)
        silent = socket.create_connection((url.hostname, url.port))
        slow = socket.create_connection((url.hostname, url.port))
        slow.sendall(b"GET /health HTTP/1.1\r\n")  # the headers never end
        silent.settimeout(5)
        slow.settimeout(5)
        assert silent.recv(1) == b"" and slow.recv(1) == b""  # closed by the server, well before 5 s
        with httpx.Client(trust_env=False, timeout=30) as c:
            assert c.get(f"{server.endpoint}/health").status_code == 200
        silent.close()
        slow.close()


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_bytes_that_are_not_http_get_a_400_in_openais_shape(served: Served, parser: str) -> None:
    """uvicorn answers what it cannot parse with its own text/plain 400: the replica's is in OpenAI's error shape, like
    every other error it sends, with either of uvicorn's parsers; then it closes the connection and serves on."""
    import socket
    from urllib.parse import urlparse

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from runners.serve import _deadline_protocol

    base = {"httptools": HttpToolsProtocol, "h11": H11Protocol}[parser]

    def server_for(app: Any) -> Any:
        return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                             http=_deadline_protocol(5.0, base)))

    with ThreadedServer(app_for(served.loaded, served.spec), server_for) as server:
        endpoint = server.endpoint
        url = urlparse(endpoint)
        for garbage in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS ClientHello's first bytes
                        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"):
            with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
                conn.sendall(garbage)
                reply = b""
                while chunk := conn.recv(65536):  # the server closes after its answer
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            lines = head.decode("ascii").split("\r\n")
            assert lines[0] == "HTTP/1.1 400 Bad Request", (parser, reply)
            assert "content-type: application/json" in [line.lower() for line in lines[1:]]
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "malformed_http"
            assert error["message"].startswith("malformed HTTP request: ") and error["param"] is None
        with httpx.Client(trust_env=False, timeout=30) as c:
            assert c.get(f"{endpoint}/health").status_code == 200
