"""The digests of the serving step: a completion request, a completion response and a fixed request set.

One definition for both sides: the replica (runners/serve.py) puts them in every response, the load client
(runners/loadgen.py) computes them for what it sends, and the verifier (verify/serving.py) recomputes them from a
request log. Torch-free; it imports only :mod:`ledger.digests`.

The normalized request is what a request *means*, so equal meanings give equal digests whatever the client wrote:

    {"format": "ledger-completion-request", "version": 1,
     "model": str, "prompt": str, "max_tokens": int, "logprobs": int | null}

``max_tokens`` defaults to OpenAI's 16 when absent; ``temperature`` (always 0: decoding is greedy), ``seed``
(accepted, ignored: greedy decoding draws no random numbers) and ``user`` are left out, since none of them can change
a response. Then

    request digest   = digest_json("json", normalized request)
    response digest  = digest_json("json", {"format": "ledger-completion-response", "version": 1,
                                            "request": request digest, "token_ids": [int], "text": str})
    request set      = digest_json("json", {"format": "ledger-serving-request-set", "version": 1,
                                            "requests": [normalized request, ...]})

``token_ids`` are the generated ids without the EOS that ended them. Every body carries its own ``format``, so
these ``json``-domain digests cannot collide with any other canonical document (``ledger.digests.DOMAINS`` has no
serving domain; the format tag is the separation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ledger import digests

REQUEST_FORMAT: Final = "ledger-completion-request"
RESPONSE_FORMAT: Final = "ledger-completion-response"
REQUEST_SET_FORMAT: Final = "ledger-serving-request-set"
VERSION: Final = 1
DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions


def normalize_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """The normalized form of an (already validated) ``/v1/completions`` body; see the module docstring."""
    max_tokens = request.get("max_tokens")
    return {
        "format": REQUEST_FORMAT,
        "version": VERSION,
        "model": request["model"],
        "prompt": request["prompt"],
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "logprobs": request.get("logprobs"),
    }


def request_digest(request: Mapping[str, Any]) -> str:
    """Digest of the normalized form of ``request`` (a raw body or an already normalized one)."""
    return digests.digest_json("json", normalize_request(request))


def response_digest(request_digest: str, token_ids: Sequence[int], text: str) -> str:
    """Digest binding the generated token ids and text to the request they answer."""
    digests.check_digest(request_digest, "request digest")
    return digests.digest_json("json", {"format": RESPONSE_FORMAT, "version": VERSION, "request": request_digest,
                                        "token_ids": list(token_ids), "text": text})


def request_set_digest(requests: Sequence[Mapping[str, Any]]) -> str:
    """Digest of a fixed, ordered request set (each request normalized)."""
    return digests.digest_json("json", {"format": REQUEST_SET_FORMAT, "version": VERSION,
                                        "requests": [normalize_request(r) for r in requests]})


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "normalize_request",
    "request_digest",
    "request_set_digest",
    "response_digest",
]
