"""HTTP transport: the ``requests.Session`` and one ``POST /flush`` per (server, id) pair.

``Transport.post`` runs in worker threads and never logs; every transport error and failing
status becomes a short message (``failures.describe_failure``: no credentials, secret or header).
Each POST carries a ``CancelToken``: the sender's time budget and the request's sockets, so
the sender can give it up at once. urllib3 is extended only through public hooks: a
``Timeout`` whose ``clone`` clamps timeouts to the time left, a ``Retry`` subclass that fits
backoff into the deadline, and the pool's ``ConnectionCls``, which registers sockets.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import requests
import requests.adapters
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError as Urllib3HTTPError
from urllib3.exceptions import MaxRetryError, ResponseError
from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

from .._version import __version__
from .cancel import CancelToken
from .failures import RETRY_STATUSES, TRANSPORT_ERRORS, describe_failure, not_an_answer
from .report import FlushResult
from .tls import ssl_context, tls_failure

if TYPE_CHECKING:
    from typing_extensions import Self
    from urllib3.connectionpool import ConnectionPool
    from urllib3.response import BaseHTTPResponse

    from .options import FlushOptions

USER_AGENT: Final = f"swe-flush-sync/{__version__}"
MAX_BODY_BYTES: Final = 64 * 1024
_MIN_TIMEOUT: Final = 0.001
_MIN_ATTEMPT: Final = 0.01  # seconds an attempt needs at least; less left: no more retries


class _Local(threading.local):
    token: CancelToken | None = None  # of the request the current thread is sending


_local = _Local()


class _DeadlineTimeout(Timeout):
    """A ``Timeout`` cloned (by urllib3, at each attempt) as a plain one of the token's time left."""

    def __init__(self, connect: float, token: CancelToken) -> None:
        super().__init__(connect=connect, read=None)
        self.limit = connect
        self.token = token

    def clone(self) -> Timeout:
        left = self.token.time_left()
        return Timeout(connect=max(min(self.limit, left), _MIN_TIMEOUT), read=max(left, _MIN_TIMEOUT))


class _DeadlineRetry(Retry):
    """``Retry`` that fits its thread's token: a backoff wait is at most half the time left, so one
    more attempt still starts before the deadline; a ``Retry-After`` reaching past it stops at once."""

    def increment(
        self,
        method: str | None = None,
        url: str | None = None,
        response: BaseHTTPResponse | None = None,
        error: Exception | None = None,
        _pool: ConnectionPool | None = None,
        _stacktrace: TracebackType | None = None,
    ) -> Self:
        if tls_failure(error) is not None:  # a certificate or TLS protocol failure: no retry changes it
            raise MaxRetryError(_pool, url or "", error)  # type: ignore[arg-type]
        new_retry = super().increment(method, url, response, error, _pool, _stacktrace)  # exhausted: raises
        token = _local.token
        if token is None:
            return new_retry
        retry_after = self._retry_after(response)
        left = token.retry_time_left()
        if retry_after is not None and retry_after >= left and response is not None:
            given = str(response.headers.get("Retry-After", ""))[:40]
            token.stop_reason = f"Retry-After: {given} reaches past the deadline"
        elif left < _MIN_ATTEMPT:
            token.stop_reason = token.reason if token.cancelled.is_set() else "deadline passed before the next retry"
        else:
            token.next_wait = min(new_retry.get_backoff_time() if retry_after is None else retry_after, left / 2)
            token.attempts += 1
            return new_retry
        raise MaxRetryError(_pool, url or "", error or ResponseError(token.stop_reason))  # type: ignore[arg-type]

    def _retry_after(self, response: BaseHTTPResponse | None) -> float | None:
        try:
            return self.get_retry_after(response) if response is not None else None
        except Urllib3HTTPError:  # InvalidHeader: an unparsable Retry-After falls back to backoff
            return None

    def sleep(self, response: BaseHTTPResponse | None = None) -> None:
        token = _local.token
        if token is None:
            super().sleep(response)
            return
        wait = min(token.next_wait, token.retry_time_left())
        if wait > 0:
            token.cancelled.wait(wait)  # cancelling the token ends the wait at once


class _TrackedConnectionMixin:
    """Registers the connection with the token its thread is sending, at connect and at each request."""

    def connect(self) -> None:
        _track(self)  # type: ignore[arg-type]  # mixed into HTTPConnection only
        super().connect()  # type: ignore[misc]
        _track(self)  # type: ignore[arg-type]  # a cancel while connecting found no socket: it is shut now

    def request(self, *args: Any, **kwargs: Any) -> None:
        _track(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]


def _track(holder: HTTPConnection | socket.socket) -> None:
    token = _local.token
    if token is not None:
        token.track(holder)


class _TrackedHTTPConnection(_TrackedConnectionMixin, HTTPConnection):
    pass


class _TrackedHTTPSConnection(_TrackedConnectionMixin, HTTPSConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(ssl.SSLEOFError):  # TLS 1.3 tells a refused client certificate on the read
            super().request(*args, **kwargs)


class _TrackedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class _FlushAdapter(requests.adapters.HTTPAdapter):
    """requests' ``HTTPAdapter``, extended at the hooks it documents for subclasses: pools with the
    tracked connection classes and our TLS context (its trust store, never one requests looks up per
    request), the request path (a flush never goes through a proxy), and a response of what a
    flush reads: status, reason, raw body (no header dict, no cookie jar)."""

    def __init__(self, tls: ssl.SSLContext | None, **kwargs: Any) -> None:
        self._tls = tls
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        if self._tls is not None:
            kwargs["ssl_context"] = self._tls
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _TrackedHTTPPool, "https": _TrackedHTTPSPool}

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        if url.lower().startswith("https"):
            conn.cert_reqs, conn.ca_certs, conn.ca_cert_dir = "CERT_REQUIRED", None, None  # trust: the context

    def request_url(self, request: requests.PreparedRequest, proxies: Mapping[str, str] | None) -> str:
        return request.path_url

    def build_response(self, req: requests.PreparedRequest, resp: BaseHTTPResponse) -> requests.Response:
        response = requests.Response()
        response.status_code, response.reason, response.raw = resp.status, resp.reason or "", resp
        response.url, response.request, response.connection = req.url or "", req, self
        return response


def build_retry(retries: int, backoff_factor: float) -> Retry:
    """The retry policy: up to ``retries`` retries of POST on connection errors and 429/5xx."""
    return _DeadlineRetry(
        total=retries, connect=None, read=None, redirect=0, status=None, raise_on_redirect=False,
        allowed_methods=frozenset({"POST"}),  # flush is idempotent; POST is not retried by default
        status_forcelist=RETRY_STATUSES, respect_retry_after_header=True,
        backoff_factor=backoff_factor, backoff_jitter=backoff_factor, backoff_max=max(backoff_factor * 16, 1.0),
        raise_on_status=False,  # the last 503/429 comes back as a response we can report
    )


class Transport:
    """One ``requests.Session``, one adapter on both schemes, a connection per worker and server (so
    none is discarded), the ``build_retry`` policy of ``options``, a ``POST /flush`` template per server."""

    def __init__(self, server_urls: tuple[str, ...], options: FlushOptions) -> None:
        session = self.session = requests.Session()
        # trust_env off: an abort goes straight to the agent server, never through a proxy meant for
        # egress, and .netrc never swaps the bearer for Basic; a CA bundle variable is still honoured.
        session.trust_env = False
        # No gzip (the body is never decoded), no Accept, no Connection (HTTP/1.1 keeps alive).
        session.headers = requests.structures.CaseInsensitiveDict({"User-Agent": USER_AGENT})
        tls = ssl_context(options.ca_bundle, options.client_cert, _track) if any(
            url.startswith("https:") for url in server_urls) else None
        self._adapter = _FlushAdapter(tls, pool_connections=max(len(server_urls), 1), pool_maxsize=options.workers,
                                      max_retries=build_retry(options.retries, options.backoff_factor))
        session.mount("http://", self._adapter)
        session.mount("https://", self._adapter)
        self._connect_timeout = options.connect_timeout
        self._templates = {
            url: session.prepare_request(
                requests.Request("POST", url + "/flush", headers={"Content-Type": "application/json"}))
            for url in server_urls
        }

    def prepare(self, server_url: str, instance_id: str, authorization: str | None) -> requests.PreparedRequest:
        """The ``POST {server_url}/flush`` of one id, with a ``Content-Length`` JSON body."""
        prepared = self._templates[server_url].copy()
        prepared.prepare_body(json.dumps({"session_server_instance_id": instance_id}).encode(), None)
        if authorization is not None:
            prepared.headers["Authorization"] = authorization
        return prepared

    def post(self, server_url: str, instance_id: str, authorization: str | None, token: CancelToken) -> FlushResult:
        """POST ``{server_url}/flush`` for one id within ``token``'s times; raises only on a bug."""
        started = time.monotonic()
        if token.retry_time_left() <= 0:
            reason = token.reason if token.cancelled.is_set() else "deadline passed"
            return FlushResult(server_url, instance_id, ok=False, error=f"{reason} before it was sent")
        _local.token = token
        token.attempts = 1
        response: requests.Response | None = None
        try:
            # requests' own send; it never follows redirects, so the bearer never leaves the server.
            response = self._adapter.send(
                self.prepare(server_url, instance_id, authorization),
                stream=True,  # so that a huge or trickling body is never read past its bounds
                # requests passes a urllib3 Timeout through unchanged; its stubs do not say so
                timeout=_DeadlineTimeout(self._connect_timeout, token),  # type: ignore[arg-type]
                verify=True,  # always: the adapter's TLS context holds the trust store
                proxies={},
            )
            status = response.status_code
            if 200 <= status < 300:
                cancelled, not_an_answer = _read_answer(response, authorization)
                if not_an_answer is not None:  # a 2xx from something else (a proxy's page): nothing was flushed
                    return FlushResult(server_url, instance_id, ok=False, status_code=status, attempts=token.attempts,
                                       elapsed=time.monotonic() - started, error=not_an_answer)
                return FlushResult(server_url, instance_id, ok=True, status_code=status, passes=1,
                                   cancelled=cancelled, attempts=token.attempts, elapsed=time.monotonic() - started)
            return FlushResult(server_url, instance_id, ok=False, status_code=status, attempts=token.attempts,
                               elapsed=time.monotonic() - started, error=describe_failure(token, response=response))
        except TRANSPORT_ERRORS as exc:
            return FlushResult(server_url, instance_id, ok=False, attempts=token.attempts,
                               elapsed=time.monotonic() - started, error=describe_failure(token, exc=exc))
        finally:
            if response is not None:
                with contextlib.suppress(*TRANSPORT_ERRORS):
                    response.close()
            _local.token = None
            token.finish()

    def close(self) -> None:
        """Close the pool (connections still in flight close when they come back)."""
        self.session.close()


def _read_answer(response: requests.Response, authorization: str | None) -> tuple[int | None, str | None]:
    """The ``cancelled`` count of a 2xx that is the flush's answer (a JSON object with an int
    ``cancelled``); else None and what came back instead: the status, the content type and the body's
    first characters, with the bearer masked."""
    status, kind = response.status_code, response.raw.headers.get("Content-Type") or "none"
    try:  # a Content-Length body ends there: no read waits for EOF
        body = response.raw.read(MAX_BODY_BYTES + 1, decode_content=False)
    except TRANSPORT_ERRORS:
        return None, f"HTTP {status}, but its body was cut off: not a whole flush answer"
    data = None
    if len(body) <= MAX_BODY_BYTES:
        with contextlib.suppress(ValueError):  # not UTF-8 (a ValueError too) or not JSON
            data = json.loads(body.decode())
    cancelled = data.get("cancelled") if isinstance(data, dict) else None
    if isinstance(cancelled, int) and not isinstance(cancelled, bool):
        return cancelled, None
    return None, not_an_answer(status, kind, body[:MAX_BODY_BYTES], authorization)
