"""HTTP transport: the ``requests.Session`` and one ``POST /flush`` per (server, id) pair.

``Transport.post`` runs in worker threads; it never logs and never raises: every
requests/urllib3 error and every failing status becomes a short message in
``describe_failure`` (no URL credentials, no secret, no headers).

Each POST carries a ``Request``: the time its retries must fit in, the time it must end by,
and the sockets it uses, so the caller can give it up (``Request.abandon``) and end any
blocked connect, recv or send at once. urllib3 is extended only through public hooks: a
``Timeout`` subclass clamps connect/read timeouts to the time left, a ``Retry`` subclass
shortens backoff to fit the deadline and stops at it, and connection classes (the pool's
``ConnectionCls``) register their sockets with the ``Request`` of their thread.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, cast

import requests
import requests.adapters
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
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
from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

from ._report import FlushResult
from ._version import __version__

if TYPE_CHECKING:
    from typing_extensions import Self
    from urllib3.connectionpool import ConnectionPool
    from urllib3.response import BaseHTTPResponse

USER_AGENT: Final = f"swe-flush-sync/{__version__}"
RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
MAX_BODY_BYTES: Final = 64 * 1024
_MIN_TIMEOUT: Final = 0.001
GATHER_TIMEOUT: Final = 1.0  # seconds a request waits at most for the others of its gather
_MAX_PREPARED: Final = 4096  # pairs whose request is kept for the next flush
_MIN_ATTEMPT: Final = 0.01  # seconds an attempt needs at least; less left: no more retries
_STATUS_HINTS: Final = {
    401: "unauthorized: wrong or missing bearer secret",
    403: "forbidden",
    404: "no /flush endpoint at this URL",
    405: "method not allowed",
    422: "the server rejected the request body",
}

_local = threading.local()  # .request: the Request the current thread is sending


class Request:
    """One POST in flight: when its retries must stop, when it must end, and its sockets.

    Args:
        retry_until: monotonic time after which no retry starts (the caller's deadline).
        expires_at: monotonic time by which every timeout of it ends (deadline + linger).
    """

    def __init__(self, retry_until: float, expires_at: float) -> None:
        self.retry_until = retry_until
        self.expires_at = expires_at
        self.abandoned = threading.Event()
        self.abandon_reason = "given up"
        self.failed_attempts = 0  # attempts the Retry counted as failed
        self.gave_up = False  # the Retry stopped: the last attempt is one of the failed ones
        self.next_wait = 0.0
        self.stop_reason: str | None = None
        # Set on the pairs of a call that needs more connections than the pool ever had:
        # each keeps its connection until all of them are answered (see ``hold``).
        self.gather: threading.Barrier | None = None
        self._held = False
        self._connections: list[HTTPConnection] = []

    def time_left(self) -> float:
        """Seconds until it must end."""
        return self.expires_at - time.monotonic()

    def retry_time_left(self) -> float:
        """Seconds in which another attempt may still start."""
        return min(self.retry_until, self.expires_at) - time.monotonic()

    def hold(self) -> None:
        """Answered, its body unread (its connection still out of the pool): wait for the others.

        Every request of a gather keeps its connection until all of them have their answer, so
        none reuses another's: the pool grows to the call's parallelism in one step instead of
        one connection per later call that happens to overlap more, and a warm Flusher then
        never opens a new one. Nothing is sent later for it. The wait is bounded
        (``GATHER_TIMEOUT``, half the time to the deadline); a request of the gather that fails, or a
        timed-out wait, lets every request go on at once.
        """
        if self.gather is not None and not self._held:
            self._held = True
            with contextlib.suppress(threading.BrokenBarrierError):
                self.gather.wait(max(min(GATHER_TIMEOUT, self.retry_time_left() / 2), 0))

    def track(self, connection: HTTPConnection) -> None:
        """Note a connection it uses (so ``abandon`` can shut its socket down)."""
        self._connections.append(connection)
        if self.abandoned.is_set():
            _shut(connection)

    @property
    def attempts(self) -> int:
        """Attempts made so far (at least 1 once it was sent)."""
        return max(self.failed_attempts + (0 if self.gave_up else 1), 1)

    def abandon(self, reason: str = "given up") -> None:
        """Give it up: no more retries, no more waiting, its sockets shut down now.

        Args:
            reason: said in its result, e.g. "the Flusher was closed" (the first one given stays).
        """
        if not self.abandoned.is_set():
            self.abandon_reason = reason
        self.retry_until = self.expires_at = -math.inf
        self.abandoned.set()
        if self.gather is not None:
            self.gather.abort()
        for connection in list(self._connections):
            _shut(connection)

    def finish(self) -> None:
        """Forget its connections (they are back in the pool or closed); never keep a gather waiting."""
        self._connections = []
        if self.gather is not None and not self._held:
            self.gather.abort()  # it failed before its answer: the others must not wait for it


def _shut(connection: HTTPConnection) -> None:
    sock = connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _current() -> Request | None:
    request: Request | None = getattr(_local, "request", None)
    return request


class _DeadlineTimeout(Timeout):
    """A urllib3 ``Timeout`` whose connect and read timeouts never reach past the request's end.

    urllib3 clones the timeout it is given at the start of every attempt (retries included);
    the clone is a plain ``Timeout`` of the time left then.
    """

    def __init__(self, connect: float, request: Request) -> None:
        super().__init__(connect=connect, read=None)
        self.limit = connect
        self.request = request

    def clone(self) -> Timeout:
        left = self.request.time_left()
        return Timeout(connect=max(min(self.limit, left), _MIN_TIMEOUT), read=max(left, _MIN_TIMEOUT))


class _DeadlineRetry(Retry):
    """``Retry`` that fits the deadline of the request its thread is sending.

    A backoff wait is shortened to half the time left, so one more attempt still starts
    before the deadline; a ``Retry-After`` reaching past the deadline stops retrying at once
    (the server asked for that; its response is returned and reported).
    """

    def increment(
        self,
        method: str | None = None,
        url: str | None = None,
        response: BaseHTTPResponse | None = None,
        error: Exception | None = None,
        _pool: ConnectionPool | None = None,
        _stacktrace: TracebackType | None = None,
    ) -> Self:
        request = _current()
        if request is None:
            return super().increment(method, url, response, error, _pool, _stacktrace)
        request.failed_attempts = len(self.history) + 1
        try:
            new_retry = super().increment(method, url, response, error, _pool, _stacktrace)
        except MaxRetryError:  # exhausted
            request.gave_up = True
            raise
        retry_after = self._retry_after(response)
        left = request.retry_time_left()
        if retry_after is not None and retry_after >= left and response is not None:
            given = str(response.headers.get("Retry-After", ""))[:40]
            request.stop_reason = f"Retry-After: {given} reaches past the deadline"
        elif left < _MIN_ATTEMPT:
            request.stop_reason = request.abandon_reason if request.abandoned.is_set() \
                else "deadline passed before the next retry"
        else:
            wait = new_retry.get_backoff_time() if retry_after is None else retry_after
            request.next_wait = min(wait, left / 2)
            return new_retry
        request.gave_up = True
        raise MaxRetryError(_pool, url or "", error or ResponseError(request.stop_reason))  # type: ignore[arg-type]

    def _retry_after(self, response: BaseHTTPResponse | None) -> float | None:
        if response is None or not self.respect_retry_after_header:
            return None
        try:
            return self.get_retry_after(response)
        except Exception:  # noqa: BLE001 - an unparsable Retry-After: fall back to backoff
            return None

    def sleep(self, response: BaseHTTPResponse | None = None) -> None:
        request = _current()
        if request is None:
            super().sleep(response)
            return
        wait = min(request.next_wait, request.retry_time_left())
        if wait > 0:
            request.abandoned.wait(wait)  # abandoning it ends the wait at once


class _TrackedConnectionMixin:
    """Registers the connection with the request its thread is sending."""

    def connect(self) -> None:
        request = _current()
        if request is not None:
            request.track(self)  # type: ignore[arg-type]
        super().connect()  # type: ignore[misc]

    def request(self, *args: Any, **kwargs: Any) -> None:
        request = _current()
        if request is not None:
            request.track(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]


class _TrackedHTTPConnection(_TrackedConnectionMixin, HTTPConnection):
    pass


class _TrackedHTTPSConnection(_TrackedConnectionMixin, HTTPSConnection):
    pass


class _TrackedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class _FlushAdapter(requests.adapters.HTTPAdapter):
    """An ``HTTPAdapter`` with tracked connection classes and the short ``send`` a flush needs.

    ``send`` keeps what ``HTTPAdapter.send`` does for a flush (the TLS-aware pool, urllib3's
    ``urlopen`` with the adapter's ``Retry``, no redirects) and drops what a flush never uses:
    proxy selection, cookie extraction and header merging, about a third of each request's
    CPU. Errors are urllib3's own, not wrapped; the response is a bare ``requests.Response``
    over the urllib3 response (status, reason, raw). ``responses`` can patch it in tests.
    """

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _TrackedHTTPPool, "https": _TrackedHTTPSPool}
        self._routes: dict[str, tuple[HTTPConnectionPool, str]] = {}

    def send(self, request: requests.PreparedRequest, stream: bool = False, timeout: Any = None,
             verify: bool | str = True, cert: Any = None, proxies: Mapping[str, str] | None = None,
             ) -> requests.Response:
        url = request.url or ""
        route = self._routes.get(url)
        if route is None:  # once per server URL: the PoolManager returns the same pool to every thread
            pool = self.get_connection_with_tls_context(request, verify, proxies=None, cert=cert)
            self.cert_verify(pool, url, verify, cert)
            route = self._routes[url] = (pool, request.path_url)
        pool, path = route
        raw = pool.urlopen(
            request.method or "POST", path,
            body=request.body,  # type: ignore[arg-type]  # always bytes here (Transport.prepare)
            headers=request.headers,  # type: ignore[arg-type]  # str values; the same ignore as requests'
            redirect=False, assert_same_host=False, preload_content=False, decode_content=False,
            retries=self.max_retries, timeout=timeout, chunked=False)
        response = requests.Response()
        response.status_code = raw.status
        response.reason = raw.reason or ""
        response.raw = raw
        response.url = url
        response.request = request
        return response

    def close(self) -> None:
        self._routes.clear()
        super().close()


def build_retry(retries: int, backoff_factor: float) -> Retry:
    """The retry policy: up to ``retries`` retries of POST on connection errors and 429/5xx."""
    return _DeadlineRetry(
        total=retries,
        connect=None,
        read=None,
        redirect=0,
        status=None,
        allowed_methods=frozenset({"POST"}),  # flush is idempotent; POST is not retried by default
        status_forcelist=RETRY_STATUSES,
        backoff_factor=backoff_factor,
        backoff_jitter=backoff_factor,
        backoff_max=max(backoff_factor * 16, 1.0),
        raise_on_status=False,  # the last 503/429 comes back as a response we can report
        raise_on_redirect=False,
        respect_retry_after_header=True,
    )


def build_session(*, hosts: int, pool_maxsize: int, retries: int, backoff_factor: float) -> requests.Session:
    """A fully configured Session: one adapter on both schemes, pool sized to the workers."""
    session = requests.Session()
    # trust_env off: an abort must reach the agent server directly, never through a proxy
    # meant for internet egress, and .netrc must never swap the bearer for Basic credentials.
    # A custom CA bundle is still honoured when the usual variables name one.
    session.trust_env = False
    # Only the headers a flush needs: no gzip (the body is never decoded), no Accept, no
    # Connection (HTTP/1.1 keeps alive); fewer header lines to build and for the server to parse.
    session.headers = requests.structures.CaseInsensitiveDict({"User-Agent": USER_AGENT})
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    adapter = _FlushAdapter(
        pool_connections=max(hosts, 1),
        pool_maxsize=pool_maxsize,
        max_retries=build_retry(retries, backoff_factor),
        pool_block=False,
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class Transport:
    """The Session and its adapter, with a prepared ``POST /flush`` per server URL.

    Each pair's request is built once from the server's prepared template, kept for the
    next flush, and sent straight through the adapter: the per-request merging of session
    settings, cookies and hooks in ``Session.request`` costs about a fifth of each
    request's CPU, and a flush needs none of it.
    """

    def __init__(self, server_urls: tuple[str, ...], *, pool_maxsize: int, retries: int,
                 backoff_factor: float, connect_timeout: float) -> None:
        self.session = build_session(hosts=len(server_urls), pool_maxsize=pool_maxsize, retries=retries,
                                     backoff_factor=backoff_factor)
        self._adapter = self.session.get_adapter("http://")
        self._verify: bool | str = self.session.verify if self.session.verify is not None else True
        self._connect_timeout = connect_timeout
        self._templates = {
            url: self.session.prepare_request(
                requests.Request("POST", url + "/flush", headers={"Content-Type": "application/json"}))
            for url in server_urls
        }
        self._prepared: dict[tuple[str, str, str | None], requests.PreparedRequest] = {}

    def prepare(self, server_url: str, instance_id: str, authorization: str | None) -> requests.PreparedRequest:
        """The ``POST {server_url}/flush`` of one id: built once, then reused read-only.

        A per-step abort flushes the same ids every step, so each pair's request (body and
        headers; urllib3 adds ``Content-Length``) is kept, up to ``_MAX_PREPARED`` of them.
        """
        key = (server_url, instance_id, authorization)
        prepared = self._prepared.get(key)
        if prepared is None:
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.clear()
            template = self._templates[server_url]
            headers = {str(name): str(value) for name, value in template.headers.items()
                       if name.lower() != "content-length"}  # the template's "0"
            if authorization is not None:
                headers["Authorization"] = authorization
            prepared = requests.PreparedRequest()
            prepared.method = template.method
            prepared.url = template.url
            # A plain dict, not requests' CaseInsensitiveDict: urllib3 copies the headers of
            # every request, and a dict copies in C. Only this adapter (and ``responses``) reads them.
            prepared.headers = cast("requests.structures.CaseInsensitiveDict[str | bytes]", headers)
            prepared.body = json.dumps({"session_server_instance_id": instance_id}).encode()
            self._prepared[key] = prepared
        return prepared

    def post(self, server_url: str, instance_id: str, authorization: str | None, request: Request) -> FlushResult:
        """POST ``{server_url}/flush`` for one id within ``request``'s times; never raises."""
        started = time.monotonic()
        _local.request = request
        response: requests.Response | None = None
        try:
            if request.retry_time_left() <= 0:
                return FlushResult(server_url, instance_id, ok=False, error="deadline passed before it was sent")
            # The adapter never follows redirects: the bearer never travels to another host.
            response = self._adapter.send(
                self.prepare(server_url, instance_id, authorization),
                stream=True,  # so that a huge or trickling body is never read past its bounds
                # requests passes a urllib3 Timeout through unchanged; its stubs do not say so
                timeout=_DeadlineTimeout(self._connect_timeout, request),  # type: ignore[arg-type]
                verify=self._verify,
                cert=None,
                proxies={},
            )
            request.hold()
            status = response.status_code
            attempts = request.attempts
            if 200 <= status < 300:
                return FlushResult(server_url, instance_id, ok=True, status_code=status,
                                   cancelled=_read_cancelled(response, request), attempts=attempts,
                                   elapsed=time.monotonic() - started)
            return FlushResult(server_url, instance_id, ok=False, status_code=status, attempts=attempts,
                               elapsed=time.monotonic() - started, error=describe_failure(request, response=response))
        except Exception as exc:  # noqa: BLE001 - never raises: every failure is data
            return FlushResult(server_url, instance_id, ok=False, attempts=request.attempts,
                               elapsed=time.monotonic() - started, error=describe_failure(request, exc=exc))
        finally:
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()
            _local.request = None
            request.finish()

    def close(self) -> None:
        """Close the pool (connections still in flight close when they come back)."""
        self.session.close()


def _read_cancelled(response: requests.Response, request: Request) -> int | None:
    """The ``cancelled`` count of a 2xx body, or None if the body does not give an int in time."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= MAX_BODY_BYTES and request.time_left() > 0:
            chunk = response.raw.read1(MAX_BODY_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if response.raw.length_remaining == 0:  # all of a Content-Length body: no read for EOF
                break
        else:
            return None  # too large, or still trickling when its time was up
    except Exception:  # noqa: BLE001 - a body cut mid-way still flushed
        return None
    try:
        data = json.loads(b"".join(chunks).decode())  # str: json skips sniffing the encoding
    except ValueError:
        return None
    cancelled = data.get("cancelled") if isinstance(data, dict) else None
    if isinstance(cancelled, int) and not isinstance(cancelled, bool):
        return cancelled
    return None


def describe_failure(request: Request | None = None, *, response: requests.Response | None = None,
                     exc: BaseException | None = None) -> str:
    """Why a pair failed, in a few words: a status, or a requests/urllib3/socket error.

    The one place where statuses and exceptions become messages; never shows a URL's
    credentials, a header or a secret.
    """
    stop_reason = request.stop_reason if request is not None else None
    if response is not None:
        status = response.status_code
        hint = _STATUS_HINTS.get(status)
        if 300 <= status < 400:
            hint = "redirect not followed (the bearer never leaves the configured server)"
        elif status in RETRY_STATUSES:
            hint = stop_reason or "retries exhausted"
        return f"HTTP {status}: {hint}" if hint else f"HTTP {status}"
    message = _describe_exception(exc)
    if request is not None and request.abandoned.is_set():
        return f"{request.abandon_reason} while in flight"
    if stop_reason:
        return f"{message}; {stop_reason}"
    if request is not None and request.time_left() <= 0:
        return f"deadline passed ({message})"
    return message


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
    if isinstance(reason, NameResolutionError):
        return "host name did not resolve"
    if isinstance(reason, NewConnectionError):
        cause = reason.__cause__ or reason.__context__
        if isinstance(cause, OSError) and cause.strerror:
            return f"could not connect: {cause.strerror.lower()}"
        return "could not connect"
    if isinstance(reason, (ConnectTimeoutError, requests.ConnectTimeout)):
        return "connect timed out"
    if isinstance(reason, (ReadTimeoutError, requests.ReadTimeout, socket.timeout)):
        return "read timed out"
    if isinstance(reason, (Urllib3SSLError, requests.exceptions.SSLError)):
        return "TLS error"
    if isinstance(reason, (ProtocolError, http.client.HTTPException, requests.exceptions.ChunkedEncodingError,
                           ConnectionError)):
        return "connection dropped by the server"
    if isinstance(reason, ResponseError):
        return "too many error responses"
    if isinstance(reason, (Urllib3HTTPError, requests.RequestException, OSError)):
        return f"request failed ({type(reason).__name__})"
    return f"unexpected {type(reason).__name__}"
