"""One serving replica: an OpenAI-compatible completions server (Starlette app, served by uvicorn) over a model
whose checkpoint it verified before loading.

Routes (errors always in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, 4xx for anything the
client got wrong, after which the replica keeps serving):

* ``POST /v1/completions``: ``model`` (this replica's name), ``prompt`` (one string; BOS is prepended, every
  character must be in the tokenizer), ``max_tokens`` (1..limit, default 16), ``temperature`` (0 or absent: decoding
  is greedy; anything else is refused), ``seed`` (accepted, ignored: greedy decoding draws nothing random),
  ``logprobs`` (0..5: the log-probability of each generated token and the top-k alternatives), ``user`` (ignored).
  OpenAI's other parameters are accepted only at the value that means "off" (``n`` 1, ``stream`` false, ``echo``
  false, ``best_of`` 1, ``top_p`` 1, penalties 0, ``stop``/``suffix``/``logit_bias``/``stream_options`` empty);
  an unknown parameter is a 400, as OpenAI does.
* ``GET /v1/models``, ``GET /health`` (status, the model digest recomputed from the loaded bytes, pid, queue),
  ``GET /metrics`` (Prometheus text: ``requests_total{route}``, ``errors_total{status}``, ``completions_total``,
  ``prompt_tokens_total``, ``completion_tokens_total``, ``generation_seconds_total``, ``in_flight``,
  ``cache_lookups_total{cache}``, ``cache_hits_total{cache}``, ``model_info``).

Determinism: a response is a pure function of (request, model). ``created`` is 0 and ``id`` is ``cmpl-`` plus the
first 32 hex digits of the response digest, so the same request gives byte-identical responses from every replica
of the same model (OpenAI only requires ``created`` to be an integer and ``id`` a string). Extension fields:
``model_digest``, ``request_digest``, ``response_digest`` (ledger/serving_digests.py) and ``choices[].token_ids``
(the generated ids without the final EOS, as vLLM names them). ``usage.prompt_tokens`` counts BOS;
``completion_tokens`` counts the generated ids without EOS. ``logprobs.text_offset`` indexes prompt + completion.

Batch invariance: every request is decoded alone (a batch of one, no padding, no KV cache, nothing kept between
requests) on the replica's one generation thread, whose intra-op thread count is pinned, so a prompt gives the same
float bits whatever else is in flight. Requests queue for that thread; the event loop stays free, so ``/health`` and
``/metrics`` answer while it is busy. The decode loop is :func:`runners.model.greedy_generate`'s with a batch of one
(the tests check they agree token for token).

Caches: there are none. Every place a cache could be consulted (a response cache keyed by the request, a prefix/KV
cache across requests keyed by the prompt) counts a lookup that misses, so ``cache_hits_total`` 0 is measured, not
assumed.

Run one as a process: ``python -m runners.serve --checkpoint DIR --state D --model-digest D --tokenizer FILE
--config FILE [...]`` (:func:`build_parser`; :class:`ReplicaSpec` builds the arguments). It verifies the checkpoint
against the expected digests and exits 1 with a one-line ``error: ...`` on any mismatch, before binding a port.
torch is imported only where a model is loaded or run, so the load client can import this module cheaply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger import digests
from ledger import serving_digests as sd
from ledger.errors import DigestMismatch, InputError, LedgerError, NonCanonical
from ledger.experiment.config import ExperimentConfig, config_from_bytes, load_config
from ledger.experiment.tokenizer import SPECIALS, CharTokenizer
from runners import numerics

if TYPE_CHECKING:
    import torch

    from runners.model import CausalLM

DEFAULT_MODEL_NAME: Final = "ledger-model"
MAX_LOGPROBS: Final = 5  # OpenAI's limit for /v1/completions
ROUTES: Final = ("/v1/completions", "/v1/models", "/health", "/metrics")
CACHES: Final = ("response", "prefix")
# OpenAI parameters we accept only at the value meaning "off" (absent or null is always allowed).
_OFF_NUMBERS: Final[Mapping[str, int]] = {"n": 1, "best_of": 1, "top_p": 1, "presence_penalty": 0,
                                          "frequency_penalty": 0}
_OFF_VALUES: Final[Mapping[str, tuple[Any, ...]]] = {"stream": (False,), "echo": (False,), "stop": ([],),
                                                     "suffix": ("",), "logit_bias": ({},), "stream_options": ()}
_KNOWN: Final = frozenset({"model", "prompt", "max_tokens", "temperature", "seed", "logprobs", "user",
                           *_OFF_NUMBERS, *_OFF_VALUES})


# ------------------------------------------------------------------------------------------------ errors


class ApiError(Exception):
    """A request the replica refuses, rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def parse_completion_request(payload: Any, *, model_name: str, max_prompt_chars: int,
                             max_tokens_limit: int) -> dict[str, Any]:
    """Validate a ``/v1/completions`` body and return its normalized form (ledger/serving_digests.py); raise
    :class:`ApiError` (400, or 404 for an unknown model) naming the parameter."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    for key in payload:
        if key not in _KNOWN:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    model = payload.get("model")
    if model is None:
        raise ApiError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string, not {type(model).__name__}", param="model", code="invalid_type")
    prompt = payload.get("prompt")
    if prompt is None:
        raise ApiError(400, "you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a single string (lists and token arrays are not supported)",
                       param="prompt", code="invalid_type")
    if len(prompt) > max_prompt_chars:
        raise ApiError(400, f"the prompt has {len(prompt)} characters; this replica accepts at most "
                       f"{max_prompt_chars}", param="prompt", code="context_length_exceeded")
    max_tokens = payload.get("max_tokens")
    if max_tokens is not None and not _is_int(max_tokens):
        raise ApiError(400, f"max_tokens must be an integer, not {type(max_tokens).__name__}", param="max_tokens",
                       code="invalid_type")
    effective = sd.DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not 1 <= effective <= max_tokens_limit:
        default = " (the default when max_tokens is absent)" if max_tokens is None else ""
        raise ApiError(400, f"max_tokens {effective}{default} is outside 1..{max_tokens_limit}", param="max_tokens",
                       code="invalid_value")
    temperature = payload.get("temperature")
    if temperature is not None:
        if not _is_number(temperature):
            raise ApiError(400, "temperature must be a number", param="temperature", code="invalid_type")
        if temperature != 0:
            raise ApiError(400, f"temperature {temperature} is not supported: this replica decodes greedily "
                           "(temperature 0)", param="temperature", code="unsupported_value")
    seed = payload.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, "seed must be an integer", param="seed", code="invalid_type")
    logprobs = payload.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer 0..{MAX_LOGPROBS} or null", param="logprobs",
                       code="invalid_value")
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", param="user", code="invalid_type")
    for key, off in _OFF_NUMBERS.items():
        value = payload.get(key)
        if value is not None and not (_is_number(value) and value == off):
            raise ApiError(400, f"{key}={json.dumps(value)[:40]} is not supported by this replica (only {off})",
                           param=key, code="unsupported_value")
    for key, allowed in _OFF_VALUES.items():
        value = payload.get(key)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ApiError(400, f"{key}={json.dumps(value)[:40]} is not supported by this replica", param=key,
                           code="unsupported_value")
    if model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist (this replica serves `{model_name}`)",
                       param="model", code="model_not_found")
    return sd.normalize_request({"model": model, "prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs})


# ------------------------------------------------------------------------------------------------ decoding


@dataclass(frozen=True)
class Decoded:
    """A greedy continuation: ids without the EOS, why it stopped, and (if asked) per-token log-probabilities."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens reached)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def decode(model: CausalLM, prompt_ids: Sequence[int], *, eos_id: int, max_new_tokens: int,
           top_logprobs: int | None = None) -> Decoded:
    """Greedy decoding of one prompt alone: :func:`runners.model.greedy_generate`'s loop for a batch of one (the
    last ``max_len`` tokens of context, argmax, stop at EOS), plus the log-probabilities of the chosen tokens and of
    the ``top_logprobs`` best ones (ties by lowest id) when asked. Call it with the intra-op thread count pinned."""
    import torch

    if not prompt_ids:
        raise InputError("the prompt is empty (start it with BOS)")
    module = model if isinstance(model, torch.nn.Module) else None
    if module is not None and module.training:
        raise InputError("serve a model in eval mode")
    device = next(module.parameters()).device if module is not None else torch.device("cpu")
    out: list[int] = []
    lps: list[float] | None = [] if top_logprobs is not None else None
    tops: list[list[tuple[int, float]]] | None = [] if top_logprobs else None
    finish = "length"
    with torch.inference_mode():
        seq = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        for _ in range(max_new_tokens):
            logits = model(seq[:, -model.max_len:])[:, -1, :]
            nxt = logits.argmax(dim=-1)
            token = int(nxt[0])
            if token == eos_id:
                finish = "stop"
                break
            out.append(token)
            if lps is not None:
                lp = torch.log_softmax(logits[0].float(), dim=-1)
                lps.append(_finite(float(lp[token])))
                if tops is not None and top_logprobs:
                    values, ids = lp.topk(min(top_logprobs, lp.numel()))
                    pairs = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: (-p[1], p[0]))
                    tops.append([(int(i), _finite(float(v))) for i, v in pairs])
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return Decoded(out, finish, lps, tops)


def _finite(x: float) -> float:
    # JSON has no -inf; a probability that underflows float32 is reported as the most negative finite float.
    return x if math.isfinite(x) else -sys.float_info.max


def token_text(tokenizer: CharTokenizer, token_id: int) -> str:
    """The text of one token for ``logprobs`` (a special token by its name)."""
    return SPECIALS[token_id] if 0 <= token_id < len(SPECIALS) else tokenizer.decode([token_id])


# ------------------------------------------------------------------------------------------------- metrics


@dataclass
class ReplicaMetrics:
    """The replica's counters (touched only on the event loop thread)."""

    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*ROUTES, "other"), 0))
    errors: dict[int, int] = field(default_factory=dict)
    completions: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    in_flight: int = 0
    cache_lookups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHES, 0))
    cache_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHES, 0))

    def exposition(self, model_name: str, model_digest: str) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float | int]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                shown = repr(value) if isinstance(value, float) else str(value)
                lines.append(f"{name}{labels} {shown}")

        family("requests_total", "counter", "HTTP requests received, by route",
               [(f'{{route="{r}"}}', n) for r, n in self.requests.items()])
        family("errors_total", "counter", "error responses, by HTTP status",
               [(f'{{status="{s}"}}', n) for s, n in sorted(self.errors.items())] or [("", 0)])
        family("completions_total", "counter", "completions generated", [("", self.completions)])
        family("prompt_tokens_total", "counter", "prompt tokens of generated completions", [("", self.prompt_tokens)])
        family("completion_tokens_total", "counter", "tokens generated", [("", self.completion_tokens)])
        family("generation_seconds_total", "counter", "seconds spent decoding", [("", self.generation_seconds)])
        family("in_flight", "gauge", "completions admitted and not finished", [("", self.in_flight)])
        family("cache_lookups_total", "counter",
               "places a cache could be consulted (there is no cache: every lookup misses)",
               [(f'{{cache="{c}"}}', n) for c, n in self.cache_lookups.items()])
        family("cache_hits_total", "counter", "cache hits (there is no cache)",
               [(f'{{cache="{c}"}}', n) for c, n in self.cache_hits.items()])
        family("model_info", "gauge", "the model this replica serves",
               [(f'{{model="{_label(model_name)}",model_digest="{model_digest}"}}', 1)])
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _CountResponses:
    """ASGI middleware counting every request by route and every error response by status (404 and 405 too)."""

    def __init__(self, app: ASGIApp, metrics: ReplicaMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.metrics.requests else "other"
        self.metrics.requests[route] += 1
        status = [500]

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if status[0] >= 400:
                self.metrics.errors[status[0]] = self.metrics.errors.get(status[0], 0) + 1


# ---------------------------------------------------------------------------------------------------- app


@dataclass
class _Replica:
    model: CausalLM
    tokenizer: CharTokenizer
    model_name: str
    model_digest: str
    checkpoint_receipt: str | None
    max_prompt_chars: int
    max_tokens_limit: int
    threads: int
    max_queue: int
    health_extra: dict[str, Any]
    metrics: ReplicaMetrics
    executor: ThreadPoolExecutor

    @property
    def max_body_bytes(self) -> int:
        # A prompt character takes at most 12 bytes of JSON (a \\uXXXX\\uXXXX surrogate pair), plus the rest.
        return 12 * self.max_prompt_chars + 16384


def _pin_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # no one to answer: counted as the client's error, never as the server's (a 500)
        raise ApiError(400, "the client disconnected before sending the whole body",
                       code="client_disconnected") from None
    return b"".join(chunks)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"), object_pairs_hook=digests.reject_duplicate_keys,
                          parse_constant=_reject_constant)
    except NonCanonical as exc:  # a duplicate key: which value the client meant is ambiguous
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc.detail}",
                       code="invalid_json") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, "We could not parse the JSON body of your request (it must be one JSON object in "
                       "UTF-8)", code="invalid_json") from exc


def _completion_body(r: _Replica, normalized: Mapping[str, Any], prompt_ids: Sequence[int],
                     decoded: Decoded) -> dict[str, Any]:
    tokenizer = r.tokenizer
    text = tokenizer.decode(decoded.token_ids)
    request_digest = sd.request_digest(normalized)
    response_digest = sd.response_digest(request_digest, decoded.token_ids, text)
    logprobs: dict[str, Any] | None = None
    if decoded.logprobs is not None:
        pieces = [token_text(tokenizer, t) for t in decoded.token_ids]
        offsets, at = [], len(normalized["prompt"])
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        logprobs = {
            "tokens": pieces,
            "token_logprobs": decoded.logprobs,
            "top_logprobs": None if decoded.top_logprobs is None else
            [{token_text(tokenizer, i): v for i, v in top} for top in decoded.top_logprobs],
            "text_offset": offsets,
        }
    return {
        "id": "cmpl-" + digests.digest_hex(response_digest)[:32],
        "object": "text_completion",
        "created": 0,
        "model": r.model_name,
        "system_fingerprint": "ledger-" + digests.digest_hex(r.model_digest)[:16],
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": decoded.finish_reason,
                     "token_ids": decoded.token_ids}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(decoded.token_ids),
                  "total_tokens": len(prompt_ids) + len(decoded.token_ids)},
        "model_digest": r.model_digest,
        "request_digest": request_digest,
        "response_digest": response_digest,
    }


def create_app(model: CausalLM, tokenizer: CharTokenizer, *, model_name: str, model_digest: str,
               checkpoint_receipt: str | None, max_prompt_chars: int, max_tokens_limit: int, threads: int,
               max_queue: int = 256, health_extra: Mapping[str, Any] | None = None) -> Starlette:
    """The replica's Starlette app over an already verified, eval-mode ``model``.

    ``model_digest`` is reported by ``/health`` and in every response: pass the digest recomputed from the loaded
    bytes (:func:`load_replica`). ``threads`` pins the generation thread's intra-op threads. More than ``max_queue``
    completions waiting gets 503s. ``health_extra`` adds fields to ``/health`` (e.g. the state digest).
    """
    if max_prompt_chars < 0 or max_tokens_limit < 1 or threads < 1 or max_queue < 1:
        raise InputError("max_prompt_chars >= 0, max_tokens_limit >= 1, threads >= 1 and max_queue >= 1 required")
    digests.check_digest(model_digest, "model digest")
    if getattr(model, "training", False):
        raise InputError("serve a model in eval mode (dropout would make answers random)")
    import torch

    metrics = ReplicaMetrics()
    software = {"cpu": numerics.describe(), "torch": torch.__version__}  # the replica receipt's binding records them
    replica = _Replica(model, tokenizer, model_name, model_digest, checkpoint_receipt, max_prompt_chars,
                       max_tokens_limit, threads, max_queue, dict(health_extra or {}), metrics,
                       ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-generate",
                                          initializer=_pin_threads, initargs=(threads,)))

    def generate(prompt_ids: list[int], max_tokens: int, logprobs: int | None) -> tuple[Decoded, float]:
        started = time.perf_counter()
        decoded = decode(model, prompt_ids, eos_id=tokenizer.eos_id, max_new_tokens=max_tokens,
                         top_logprobs=logprobs)
        return decoded, time.perf_counter() - started

    async def completions(request: Request) -> Response:
        try:
            payload = _parse_json(await _read_body(request, replica.max_body_bytes))
            normalized = parse_completion_request(payload, model_name=model_name, max_prompt_chars=max_prompt_chars,
                                                  max_tokens_limit=max_tokens_limit)
            try:
                prompt_ids = tokenizer.encode(normalized["prompt"], bos=True)
            except InputError as exc:
                raise ApiError(400, f"the prompt cannot be tokenized: {exc}", param="prompt",
                               code="unsupported_character") from exc
            if metrics.in_flight >= max_queue:
                raise ApiError(503, f"the replica has {max_queue} completions queued; retry later",
                               type="server_error", code="overloaded")
        except ApiError as exc:
            return exc.response()
        # No response cache (keyed by the request digest) and no prefix/KV cache across requests (keyed by the
        # prompt): each is a lookup that misses, counted where it would happen.
        for cache in CACHES:
            metrics.cache_lookups[cache] += 1
        metrics.in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            decoded, seconds = await loop.run_in_executor(replica.executor, generate, prompt_ids,
                                                          normalized["max_tokens"], normalized["logprobs"])
        finally:
            metrics.in_flight -= 1
        metrics.completions += 1
        metrics.prompt_tokens += len(prompt_ids)
        metrics.completion_tokens += len(decoded.token_ids)
        metrics.generation_seconds += seconds
        return JSONResponse(_completion_body(replica, normalized, prompt_ids, decoded))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "training-ledger",
             "model_digest": model_digest}]})

    async def health(request: Request) -> Response:
        return JSONResponse({
            "status": "ok",
            "model": model_name,
            "model_digest": model_digest,
            "checkpoint_receipt": checkpoint_receipt,
            "pid": os.getpid(),
            "threads": threads,
            **software,
            "in_flight": metrics.in_flight,
            "max_prompt_chars": max_prompt_chars,
            "max_tokens_limit": max_tokens_limit,
            **replica.health_extra,
        })

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.exposition(model_name, model_digest),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            err = ApiError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"Method {request.method} is not allowed for {request.url.path}",
                           code="method_not_allowed", headers=exc.headers)
        else:
            err = ApiError(exc.status_code, str(exc.detail), code=None, headers=exc.headers)
        return err.response()

    async def server_error(request: Request, exc: Exception) -> Response:
        return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                        code="internal_error").response()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            replica.executor.shutdown(wait=False, cancel_futures=True)

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        middleware=[Middleware(_CountResponses, metrics=metrics)],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # "/v1/completions/" is an unknown path (404 JSON), not a bodiless 307
    app.state.replica = replica
    return app


# ---------------------------------------------------------------------------------------- loading a replica


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica process needs to load and prove its model; :meth:`argv` gives its command line."""

    checkpoint: Path
    state: str  # expected state digest of the checkpoint directory (the train-end/checkpoint receipt's)
    model_digest: str  # expected model component digest
    tokenizer: Path  # the tokenizer artifact (canonical JSON)
    config: Path  # the config artifact (canonical JSON) or a TOML file
    model_name: str = DEFAULT_MODEL_NAME
    checkpoint_receipt: str | None = None
    tokenizer_digest: str | None = None  # when given, the tokenizer file must hash to it (plain BLAKE3)
    config_digest: str | None = None  # likewise for the config file
    threads: int = 1
    max_prompt_chars: int | None = None  # default: the model's max_len - 1 (room for BOS)
    max_tokens_limit: int | None = None  # default: the model's max_len

    def argv(self) -> list[str]:
        """The ``python -m runners.serve`` arguments for this spec (without host, port and ready file)."""
        args = ["--checkpoint", str(self.checkpoint), "--state", self.state, "--model-digest", self.model_digest,
                "--tokenizer", str(self.tokenizer), "--config", str(self.config), "--model-name", self.model_name,
                "--threads", str(self.threads)]
        for flag, value in (("--checkpoint-receipt", self.checkpoint_receipt),
                            ("--tokenizer-digest", self.tokenizer_digest), ("--config-digest", self.config_digest),
                            ("--max-prompt-chars", self.max_prompt_chars),
                            ("--max-tokens-limit", self.max_tokens_limit)):
            if value is not None:
                args += [flag, str(value)]
        return args


@dataclass
class LoadedReplica:
    model: Any  # TinyLM, in eval mode
    tokenizer: CharTokenizer
    config: ExperimentConfig
    model_digest: str  # recomputed from the tensors in memory after loading
    state_digest: str
    tokenizer_digest: str
    config_digest: str
    max_prompt_chars: int
    max_tokens_limit: int


_SAFETENSORS_DTYPES: Final = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                              "bool": "BOOL"}


def live_model_digest(model: torch.nn.Module, scalars: Mapping[str, Any] | None = None) -> str:
    """The model component digest (ledger/state.py) of the tensors in ``model`` right now, from their bytes in
    memory: what the replica actually serves, not what a file said."""
    import torch

    from ledger import state as ledger_state

    tensors: dict[str, str] = {}
    for name, t in model.state_dict().items():
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise InputError(f"tensor {name!r} has dtype {t.dtype}, which the model digest does not define")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
        tensors[name] = ledger_state.tensor_digest(name, dtype, list(t.shape), digests.raw_digest(raw))
    return ledger_state.component_digest("model", tensors, dict(scalars or {}))


def _read_checked(path: Path, expected: str | None, what: str) -> tuple[bytes, str]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the {what} {path}: {exc.strerror}") from exc
    actual = digests.raw_digest(data)
    if expected is not None and actual != expected:
        raise DigestMismatch(f"{what} {path}", expected=expected, actual=actual)
    return data, actual


def load_replica(spec: ReplicaSpec) -> LoadedReplica:
    """Verify and load what ``spec`` names: the tokenizer and config files (against their digests when given), the
    checkpoint directory (every file against its manifest, then the state and model digests against the expected
    ones; torch-free, never unpickles), then the model tensors, whose digest is recomputed from memory and must
    equal the expected model digest. Raises :class:`~ledger.errors.DigestMismatch` on any difference."""
    from safetensors.torch import load_file

    from ledger.state import verify_checkpoint
    from runners.model import build_model

    tok_bytes, tok_digest = _read_checked(spec.tokenizer, spec.tokenizer_digest, "tokenizer artifact")
    tokenizer = CharTokenizer.from_bytes(tok_bytes)
    cfg_bytes, cfg_digest = _read_checked(spec.config, spec.config_digest, "config artifact")
    config = load_config(spec.config) if Path(spec.config).suffix == ".toml" else config_from_bytes(cfg_bytes)
    if config.model.kind != "tiny":
        raise InputError(f"serving model.kind {config.model.kind!r} is not implemented (only 'tiny')")
    digests.check_digest(spec.state, "--state")
    digests.check_digest(spec.model_digest, "--model-digest")
    verified = verify_checkpoint(spec.checkpoint, expected_state=spec.state,
                                 expected_components={"model": spec.model_digest}, receipt=spec.checkpoint_receipt)
    component = verified.components["model"]
    tensors: dict[str, Any] = {}
    for name in component.files:
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(Path(spec.checkpoint) / name)))  # safetensors only: never unpickles
    model = build_model(config.model, tokenizer.vocab_size, 0)  # every weight is replaced just below
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # names or shapes that do not fit the configured model
        raise InputError(f"checkpoint {spec.checkpoint} does not fit the configured model: "
                         f"{str(exc).splitlines()[0][:200]}") from exc
    model.eval()
    live = live_model_digest(model, component.scalars)
    if live != spec.model_digest:
        raise DigestMismatch(f"checkpoint {spec.checkpoint}: the model loaded into memory", expected=spec.model_digest,
                             actual=live, receipt=spec.checkpoint_receipt, field="model")
    max_len = config.model.max_len
    return LoadedReplica(model, tokenizer, config, live, verified.digest, tok_digest, cfg_digest,
                         spec.max_prompt_chars if spec.max_prompt_chars is not None else max_len - 1,
                         spec.max_tokens_limit if spec.max_tokens_limit is not None else max_len)


def app_for(loaded: LoadedReplica, spec: ReplicaSpec) -> Starlette:
    """The app of a loaded replica, its ``/health`` naming every digest it checked."""
    return create_app(loaded.model, loaded.tokenizer, model_name=spec.model_name, model_digest=loaded.model_digest,
                      checkpoint_receipt=spec.checkpoint_receipt, max_prompt_chars=loaded.max_prompt_chars,
                      max_tokens_limit=loaded.max_tokens_limit, threads=spec.threads,
                      health_extra={"state_digest": loaded.state_digest, "tokenizer_digest": loaded.tokenizer_digest,
                                    "config_digest": loaded.config_digest})


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the kernel picks a free one, so parallel replicas never race for ports)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only then, and without it Nagle holds
    # the response body back until the client's delayed ACK of the headers (40 ms on Linux) on every request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def endpoint_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


REQUEST_TIMEOUT_S = 20.0  # a request's headers and body (at most max_body_bytes) must arrive within this


def uvicorn_server(app: Starlette, *, log_level: str = "warning", request_timeout: float = REQUEST_TIMEOUT_S) -> Any:
    """A uvicorn server for ``app`` with bounded timeouts (run it with ``.run(sockets=[bind(...)])``): an idle
    keep-alive connection is closed after 5 s (uvicorn's), and one whose request has not fully arrived
    ``request_timeout`` seconds after it opened or after its last response (a client that sends nothing, or a
    byte a second) is closed too (:func:`_deadline_protocol`; uvicorn has no such timeout, and idle sockets
    otherwise pile up until the process runs out of file descriptors).

    uvicorn picks uvloop and httptools when they are installed (dependencies on Linux and macOS): with them a replica
    spent a third less CPU per request outside the model (benchmarks/README.md, serve_bench); h11 and asyncio's loop
    otherwise."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=5,
                            timeout_graceful_shutdown=3, h11_max_incomplete_event_size=65536,
                            http=_deadline_protocol(request_timeout))
    return uvicorn.Server(config)


def _deadline_protocol(timeout: float, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``, else httptools', else h11's) with a deadline for receiving each request, and
    its answer to a request it cannot parse in OpenAI's error shape."""
    Base: Any = base
    if Base is None:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
        except ImportError:  # httptools not installed: uvicorn's pure-Python parser
            from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class WithDeadline(Base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout, self._passed)

        def _passed(self) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                return  # the request arrived and is being answered (generation may queue): not the client's delay
            if not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """Bytes that are not an HTTP request (uvicorn answers them in text/plain, then closes): the same 400 and
            close, in OpenAI's shape like every other error of this server. Written directly: the parser's state is
            an error already."""
            body = json.dumps(ApiError(400, f"malformed HTTP request: {msg}", code="malformed_http").body()).encode()
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return WithDeadline


def _watch_parent(parent_pid: int) -> None:
    # A replica started by the load client must not outlive it, even if the client is SIGKILLed.
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve_replica(spec: ReplicaSpec, *, host: str = "127.0.0.1", port: int = 0, ready_file: Path | None = None,
                  parent_pid: int | None = None, log_level: str = "warning",
                  listening: Callable[[str], None] | None = None) -> None:
    """Pin the intra-op threads, verify and load the model (raising before any port is bound if a digest
    differs), warm it up, bind ``host:port`` and serve until SIGTERM/SIGINT.

    ``ready_file``: once the socket listens, ``{"endpoint", "pid", "model_digest"}`` is written there atomically
    (how :func:`runners.loadgen.start_replicas` learns a kernel-chosen port). ``listening`` is then called with the
    endpoint (``ledger serve`` prints it: the port the kernel chose, only once the model verified and the port is
    bound).
    """
    import torch

    if parent_pid is not None:
        _watch_parent(parent_pid)
    torch.set_num_threads(spec.threads)
    loaded = load_replica(spec)
    # One short decode before serving, so the first measured request does not pay for lazy initialisation.
    decode(loaded.model, [loaded.tokenizer.bos_id], eos_id=loaded.tokenizer.eos_id, max_new_tokens=2)
    app = app_for(loaded, spec)
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    try:
        endpoint = endpoint_of(sock)
        if listening is not None:
            listening(endpoint)
        if ready_file is not None:
            tmp = Path(f"{ready_file}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"endpoint": endpoint, "pid": os.getpid(), "model_digest": loaded.model_digest}))
            os.replace(tmp, ready_file)
        uvicorn_server(app, log_level=log_level).run(sockets=[sock])
    finally:
        sock.close()


# ------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runners.serve",
                                description="Serve one verified model checkpoint over OpenAI-compatible HTTP.")
    p.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory")
    p.add_argument("--state", required=True, help="expected state digest of the checkpoint")
    p.add_argument("--model-digest", required=True, help="expected model component digest")
    p.add_argument("--tokenizer", required=True, type=Path, help="tokenizer artifact file")
    p.add_argument("--tokenizer-digest", help="expected digest of the tokenizer file")
    p.add_argument("--config", required=True, type=Path, help="config artifact file (canonical JSON) or TOML file")
    p.add_argument("--config-digest", help="expected digest of the config file")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="the name clients pass as `model`")
    p.add_argument("--checkpoint-receipt", help="id of the receipt that names the checkpoint (reported by /health)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the generation thread (pinned)")
    p.add_argument("--max-prompt-chars", type=int, help="longest prompt accepted (default: max_len - 1)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens accepted (default: max_len)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port chosen by the kernel (see --ready-file)")
    p.add_argument("--ready-file", type=Path, help="write {endpoint, pid, model_digest} here once listening")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer the parent")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def spec_from_args(ns: argparse.Namespace) -> ReplicaSpec:
    return ReplicaSpec(checkpoint=ns.checkpoint, state=ns.state, model_digest=ns.model_digest,
                       tokenizer=ns.tokenizer, config=ns.config, model_name=ns.model_name,
                       checkpoint_receipt=ns.checkpoint_receipt, tokenizer_digest=ns.tokenizer_digest,
                       config_digest=ns.config_digest, threads=ns.threads, max_prompt_chars=ns.max_prompt_chars,
                       max_tokens_limit=ns.max_tokens_limit)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (1 with a one-line ``error: ...`` when the checkpoint does not verify)."""
    ns = build_parser().parse_args(argv)
    if ns.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    try:
        serve_replica(spec_from_args(ns), host=ns.host, port=ns.port, ready_file=ns.ready_file,
                      parent_pid=ns.parent_pid, log_level=ns.log_level)
    except LedgerError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: cannot serve on {ns.host}:{ns.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
