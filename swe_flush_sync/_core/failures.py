"""What a failed ``POST /flush`` says: the one place where statuses and exceptions become messages.

A message is a few words (``HTTP 401: unauthorized: wrong or missing bearer secret``, ``could not
connect: connection refused``, ``deadline passed (read timed out)``), never with a URL's
credentials, a header or a secret. Also which statuses are transient (retried by the transport)
and which exceptions sending a request can raise.
"""

from __future__ import annotations

import http.client
import socket
from typing import TYPE_CHECKING, Final

import requests
from urllib3.exceptions import (
    ConnectTimeoutError,
    MaxRetryError,
    NameResolutionError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    ResponseError,
)
from urllib3.exceptions import HTTPError as Urllib3HTTPError
from urllib3.exceptions import SSLError as Urllib3SSLError

from .text import shown
from .tls import tls_failure

if TYPE_CHECKING:
    from .cancel import CancelToken

RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
UNREACHABLE: Final = "could not connect"  # how a failure to connect to the server's port begins
ANSWER_EXCERPT: Final = 80  # characters of a 2xx body that is not the flush answer shown in its error
# What sending or reading a request can raise; anything else is a bug and propagates.
TRANSPORT_ERRORS: Final = (requests.RequestException, Urllib3HTTPError, http.client.HTTPException, OSError)
_STATUS_HINTS: Final = {401: "unauthorized: wrong or missing bearer secret", 403: "forbidden",
                         404: "no /flush endpoint at this URL", 405: "method not allowed",
                         422: "the server rejected the request body"}


def describe_failure(token: CancelToken | None = None, *, response: requests.Response | None = None,
                     exc: BaseException | None = None) -> str:
    """Why a pair failed, in a few words: its status with a hint, or its exception, and why the
    token stopped retrying."""
    stop_reason = token.stop_reason if token is not None else None
    if response is not None:
        status = response.status_code
        hint = _STATUS_HINTS.get(status)
        if 300 <= status < 400:
            hint = "redirect not followed (the bearer never leaves the configured server)"
        elif status in RETRY_STATUSES:
            hint = stop_reason or "retries exhausted"
        return f"HTTP {status}: {hint}" if hint else f"HTTP {status}"
    message = _describe_exception(exc)
    if token is not None and token.cancelled.is_set():
        return f"{token.reason} while in flight"
    if stop_reason:
        return f"{message}; {stop_reason}"
    if token is not None and token.time_left() <= 0:
        return f"deadline passed ({message})"
    return message


_EXCEPTION_MESSAGES: Final = (  # the first class that matches, after NewConnectionError
    (NameResolutionError, "host name did not resolve"),
    ((ConnectTimeoutError, requests.ConnectTimeout), "connect timed out"),
    ((ReadTimeoutError, requests.ReadTimeout, socket.timeout), "read timed out"),
    ((Urllib3SSLError, requests.exceptions.SSLError), "TLS error"),
    ((ProtocolError, http.client.HTTPException, requests.exceptions.ChunkedEncodingError, ConnectionError),
     "connection dropped by the server"),
    (ResponseError, "too many error responses"),
)


def not_an_answer(status: int, content_type: str, body: bytes, authorization: str | None) -> str:
    """What a 2xx that is not the flush's answer brought: its status, content type and the body's first
    characters, with the bearer masked (before the body is cut: no part of it shows)."""
    text = body.decode("utf-8", "replace")
    secret = (authorization or "").partition(" ")[2]
    if secret:
        text = text.replace(secret, "***")
    excerpt = shown(" ".join(text.split()), ANSWER_EXCERPT)
    return (f"HTTP {status} with content type {shown(content_type, 60)} and no flush answer "
            f"({excerpt or 'an empty body'}): not an agent server's /flush (a proxy's page?)")


def unreachable(error: str | None) -> bool:
    """Did a pair fail because its server's port could not be connected to (refused, unreachable)?"""
    return error is not None and error.startswith(UNREACHABLE)


def _describe_exception(exc: BaseException | None) -> str:
    reason: BaseException | None = exc
    for _ in range(6):  # unwrap requests -> MaxRetryError -> the urllib3 reason
        if isinstance(reason, MaxRetryError) and reason.reason is not None:
            reason = reason.reason
        elif isinstance(reason, requests.RequestException) and reason.args \
                and isinstance(reason.args[0], BaseException):
            reason = reason.args[0]
        else:
            break
    if isinstance(reason, NewConnectionError) and not isinstance(reason, NameResolutionError):
        cause = reason.__cause__ or reason.__context__
        return f"{UNREACHABLE}: {cause.strerror.lower()}" if isinstance(cause, OSError) and cause.strerror \
            else UNREACHABLE
    why = tls_failure(reason)
    if why is not None:
        return f"TLS error: {why}"
    for kinds, message in _EXCEPTION_MESSAGES:
        if isinstance(reason, kinds):
            return message
    if isinstance(reason, (Urllib3HTTPError, requests.RequestException, OSError)):
        return f"request failed ({type(reason).__name__})"
    return f"unexpected {type(reason).__name__}"
