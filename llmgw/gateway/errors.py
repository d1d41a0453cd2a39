"""
OpenAI-shaped error responses.

Every refusal the gateway makes is a JSON body C{{"error": {"message",
"type", "code", "param"}}} with the matching HTTP status, so that OpenAI's
own clients raise their usual exception classes for it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Final

from llmgw.untrusted import clip

if TYPE_CHECKING:
    from llmgw.gateway.front import FrontRequest

#: Reason phrases that twisted.web's table lacks.
_REASONS: Final = {421: b"Misdirected Request", 429: b"Too Many Requests"}


class GatewayError(Exception):
    """
    A request the gateway refuses or cannot complete.

    C{status} is the HTTP status, C{type} and C{code} go into the body, and
    C{headers} are extra response headers (C{Retry-After}, say).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[bytes, bytes] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
    """
    The JSON body of an OpenAI-style error.
    """
    return json.dumps(
        {"error": {"message": message, "type": type, "code": code, "param": param}}
    ).encode()


def bad_request(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code)


def misdirected(host: bytes, option: str) -> GatewayError:
    """
    A request whose C{Host} is not a name this gateway serves (a page whose
    name rebinds to this address, or a wrong name).
    """
    return GatewayError(
        421,
        f"This gateway does not serve the host {clip(host)}; its operator lists the names "
        f"it serves with {option}",
        "invalid_request_error",
        "misdirected_request",
    )


def unauthorized(message: str) -> GatewayError:
    return GatewayError(
        401,
        message,
        "invalid_request_error",
        "invalid_api_key",
        {b"WWW-Authenticate": b'Bearer realm="llmgw"'},
    )


def not_found(message: str, code: str = "not_found") -> GatewayError:
    return GatewayError(404, message, "invalid_request_error", code)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model {clip(model)} does not exist: no deployment serves it",
        "invalid_request_error",
        "model_not_found",
    )


def method_not_allowed(method: str, path: str, allowed: bytes) -> GatewayError:
    return GatewayError(
        405,
        f"{clip(method)} is not allowed on {path}",
        "invalid_request_error",
        "method_not_allowed",
        {b"Allow": allowed},
    )


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413,
        f"The request body is larger than this gateway's limit of {limit} bytes",
        "invalid_request_error",
        "request_too_large",
    )


def no_ready_replica(model: str, retry_after: int) -> GatewayError:
    return GatewayError(
        503,
        f"No ready replica of {clip(model)} can take the request now; retry later",
        "server_error",
        "no_ready_replica",
        {b"Retry-After": b"%d" % retry_after},
    )


def overloaded(message: str, retry_after: int) -> GatewayError:
    """
    A request refused because the gateway itself is short of a resource
    (memory, room to parse): nothing wrong with it, retry later.
    """
    return GatewayError(503, message, "server_error", "overloaded", {b"Retry-After": b"%d" % retry_after})


def upstream_failed(model: str, reason: str) -> GatewayError:
    return GatewayError(
        502,
        f"The replicas of {clip(model)} failed: {reason}",
        "server_error",
        "upstream_error",
    )


def upstream_timeout(model: str, reason: str) -> GatewayError:
    return GatewayError(
        504,
        f"The replicas of {clip(model)} did not answer in time: {reason}",
        "server_error",
        "upstream_timeout",
    )


def send_error(request: FrontRequest, err: GatewayError) -> None:
    """
    Answer C{request} with C{err}'s status and JSON body.
    """
    body = err.body()
    headers = [(b"Content-Type", b"application/json")]
    headers += err.headers.items()
    request.start_response(err.status, headers, len(body), _REASONS.get(err.status), hold=True)
    request.write(body)
    request.finish()
