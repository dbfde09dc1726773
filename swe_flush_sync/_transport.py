"""HTTP transport: the ``requests.Session`` and one ``POST /flush`` per (url, id) pair.

Everything here runs in worker threads except ``build_session`` and ``PairCall.interrupt``.
Workers never log and ``post_flush`` never raises: every requests/urllib3 error becomes a
short message in ``FlushResult.error`` (no URL credentials, no secret, no headers).

The deadline reaches every wait a request can make: connect/read timeouts are clamped to the
time left (``_DeadlineTimeout``), retries stop and backoff sleeps shrink at the deadline
(``_DeadlineRetry``), and the caller shuts down in-flight sockets when it gives up
(``PairCall.interrupt``), which also ends a read from a server that trickles bytes.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import requests
import requests.adapters
import requests.auth
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError as Urllib3HTTPError,
    MaxRetryError,
    NameResolutionError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    ResponseError,
    SSLError as Urllib3SSLError,
)
from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

from ._report import FlushResult

if TYPE_CHECKING:
    from typing_extensions import Self
    from urllib3.connectionpool import ConnectionPool
    from urllib3.response import BaseHTTPResponse

RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
MAX_BODY_BYTES: Final = 64 * 1024
_MIN_TIMEOUT: Final = 0.001
_STATUS_HINTS: Final = {
    401: "unauthorized: wrong or missing bearer secret",
    403: "forbidden",
    404: "no /flush endpoint at this URL",
    405: "method not allowed",
    422: "the server rejected the request body",
}

_local = threading.local()


class ConnectionGate:
    """Keeps each worker's first connection out of the pool until every worker has one.

    Without it, a worker whose request ends before another worker starts hands its
    connection over, the call opens fewer connections than it has pairs in flight, and a
    later call with better overlap opens new ones. The worker is not held up: its connection
    waits aside and goes back to the pool when every expected worker holds one, at
    ``open()``, or ``patience`` seconds after the workers were counted (a busy shared
    executor may not run them all yet), whichever comes first. A worker's later pairs
    ``wait()`` for that, so the pool never grows past the workers.
    """

    def __init__(self, deadline: float, patience: float) -> None:
        self._arrived = 0
        self._expected: int | None = None
        self._deadline = deadline
        self._patience = patience
        self._aside: list[tuple[_GatedPoolMixin, Any]] | None = []  # None once open
        self._cond = threading.Condition(threading.Lock())

    def expect(self, workers: int) -> None:
        """Say how many workers were started."""
        with self._cond:
            self._expected = workers
            self._deadline = min(self._deadline, time.monotonic() + self._patience)
            self._cond.notify_all()  # waiters recompute their time
        self._open_if_due()

    def arrive(self) -> None:
        """One worker holds its first connection (or finished without needing one)."""
        with self._cond:
            self._arrived += 1
        self._open_if_due()

    def hold(self, pool: _GatedPoolMixin, connection: Any) -> bool:
        """Keep ``connection`` aside while the gate is shut; False when it is open."""
        self._open_if_due()
        with self._cond:
            if self._aside is None:
                return False
            self._aside.append((pool, connection))
            return True

    def open(self) -> None:
        """Put every connection kept aside back into its pool now."""
        with self._cond:
            aside, self._aside = self._aside, None
            self._cond.notify_all()
        for pool, connection in aside or ():
            pool.return_connection(connection)

    def wait(self) -> None:
        """Block while the gate is shut (at most until its time is up)."""
        with self._cond:
            while self._aside is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self.open()  # a no-op when already open; else the gate's time is up

    def _open_if_due(self) -> None:
        with self._cond:
            due = self._aside is not None and self._expected is not None and (
                self._arrived >= self._expected or time.monotonic() >= self._deadline)
        if due:
            self.open()


class PairCall:
    """The state of one (url, id) flush, shared by its worker and the calling thread."""

    __slots__ = ("deadline", "failed_attempts", "gave_up", "next_wait", "stop_reason", "gate", "_at_gate",
                 "_held", "_connections", "_lock", "_finished")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.gate: ConnectionGate | None = None  # set on a worker's first pair only
        self._at_gate = False
        self._held = False
        self.failed_attempts = 0  # attempts Retry.increment was called for
        self.gave_up = False  # the last increment stopped retrying
        self.next_wait = 0.0
        self.stop_reason: str | None = None
        self._connections: set[HTTPConnection] = set()
        self._lock = threading.Lock()
        self._finished = False

    @property
    def attempts(self) -> int:
        """HTTP attempts made so far, the one under way (or the final success) included."""
        return self.failed_attempts + (0 if self.gave_up else 1)

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once passed)."""
        return self.deadline - time.monotonic()

    def track(self, connection: HTTPConnection) -> None:
        """Remember a connection this pair is using, so ``interrupt`` can reach it."""
        with self._lock:
            if not self._finished:
                self._connections.add(connection)
        self.pass_gate()

    def finish(self) -> None:
        """Mark the pair done: ``interrupt`` no longer touches its connections."""
        with self._lock:
            self._finished = True
            self._connections.clear()
        self.pass_gate()

    def hold_first_connection(self) -> bool:
        """True the first time only: just the first connection a pair puts back is held aside."""
        first, self._held = not self._held, True
        return first

    def pass_gate(self) -> None:
        """Count this pair at its gate once: it holds a connection or finished without one."""
        if self.gate is not None and not self._at_gate:
            self._at_gate = True
            self.gate.arrive()

    def interrupt(self) -> None:
        """Give up an unfinished pair: no more retries, and shut down its sockets, which ends
        any blocked connect/recv/send at once."""
        with self._lock:
            if self._finished:
                return
            self.deadline = -math.inf
            sockets = [conn.sock for conn in self._connections]
        for sock in sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _current_call() -> PairCall | None:
    return getattr(_local, "call", None)


class _DeadlineTimeout(Timeout):
    """A urllib3 ``Timeout`` whose connect and read timeouts never reach past the pair's deadline."""

    def __init__(self, connect: float, read: float | None, call: PairCall) -> None:
        super().__init__(connect=connect, read=read)
        self.call = call

    def clone(self) -> _DeadlineTimeout:  # urllib3 clones it for every attempt
        return _DeadlineTimeout(self._connect, self._read, self.call)  # type: ignore[arg-type]

    def _clamp(self, configured: Any) -> float:
        left = max(self.call.remaining(), _MIN_TIMEOUT)
        return left if configured is None else min(float(configured), left)

    @property
    def connect_timeout(self) -> float:
        return self._clamp(super().connect_timeout)

    @property
    def read_timeout(self) -> float:
        return self._clamp(super().read_timeout)


class _DeadlineRetry(Retry):
    """``Retry`` that stops at the deadline of the pair running in this thread.

    A Retry-After or backoff wait that would end past the deadline stops retrying at once
    (the last response, e.g. a 429, is then returned and reported); shorter waits are slept.
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
        call = _current_call()
        if call is None:
            return super().increment(method, url, response, error, _pool, _stacktrace)
        call.failed_attempts += 1
        try:
            new_retry = super().increment(method, url, response, error, _pool, _stacktrace)  # raises when exhausted
        except BaseException:
            call.gave_up = True
            raise
        retry_after = self._retry_after(response) if response is not None else None
        wait = new_retry.get_backoff_time() if retry_after is None else retry_after
        if wait >= call.remaining():
            call.gave_up = True
            if response is not None and retry_after is not None:
                given = str(response.headers.get("Retry-After", ""))[:40]  # as the server sent it
                call.stop_reason = f"Retry-After: {given} reaches past the deadline"
            else:
                call.stop_reason = "the deadline passed before the next retry"
            raise MaxRetryError(_pool, url or "", error or ResponseError(call.stop_reason))  # type: ignore[arg-type]
        call.next_wait = wait
        return new_retry

    def _retry_after(self, response: Any) -> float | None:
        if not self.respect_retry_after_header:
            return None
        try:
            return self.get_retry_after(response)
        except Exception:  # an unparsable Retry-After: fall back to backoff
            return None

    def sleep(self, response: Any = None) -> None:
        call = _current_call()
        if call is None:
            super().sleep(response)
            return
        wait = min(call.next_wait, call.remaining())
        if wait > 0:
            time.sleep(wait)


class _TrackedConnectionMixin:
    """Registers the connection with the pair using it, so the caller can interrupt it."""

    def connect(self) -> None:
        call = _current_call()
        if call is not None:
            call.track(self)  # type: ignore[arg-type]
        super().connect()  # type: ignore[misc]

    def request(self, *args: Any, **kwargs: Any) -> None:
        call = _current_call()
        if call is not None:
            call.track(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]


class _TrackedHTTPConnection(_TrackedConnectionMixin, HTTPConnection):
    pass


class _TrackedHTTPSConnection(_TrackedConnectionMixin, HTTPSConnection):
    pass


class _GatedPoolMixin:
    """Lets the gate of a worker's first pair keep that connection aside (see ConnectionGate)."""

    def _put_conn(self, conn: Any) -> None:
        call = _current_call()
        if call is not None and call.gate is not None and call.hold_first_connection():
            call.pass_gate()  # it holds a connection, whatever happened before
            if call.gate.hold(self, conn):
                return
        super()._put_conn(conn)  # type: ignore[misc]

    def return_connection(self, conn: Any) -> None:
        """Put a connection kept aside back into the pool."""
        super()._put_conn(conn)  # type: ignore[misc]


class _TrackedHTTPPool(_GatedPoolMixin, HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(_GatedPoolMixin, HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class _FlushAdapter(requests.adapters.HTTPAdapter):
    """An ``HTTPAdapter`` whose pools use the tracked connection classes."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _TrackedHTTPPool, "https": _TrackedHTTPSPool}


class BearerAuth(requests.auth.AuthBase):
    """Sends ``Authorization: Bearer <secret>``; its repr never shows the secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self._secret}"
        return request

    def __repr__(self) -> str:
        return "BearerAuth('***')"


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


def build_session(*, admin_secret: str | None, hosts: int, pool_maxsize: int, retries: int,
                  backoff_factor: float) -> requests.Session:
    """A fully configured Session: one adapter on both schemes, pool sized to the workers."""
    session = requests.Session()
    # trust_env off: an abort must reach the agent server directly, never through a proxy
    # meant for internet egress, and .netrc must never swap the bearer for Basic credentials.
    # It also spares every request the environment and .netrc look-ups. A custom CA bundle
    # is still honoured when the usual variables name one.
    session.trust_env = False
    session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    session.auth = BearerAuth(admin_secret) if admin_secret else None
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

    Requests are built from the prepared template and sent straight through the adapter:
    the per-request merging of session settings, cookies and hooks in ``Session.request``
    cost about a fifth of each request's CPU, and a flush needs none of it.
    """

    def __init__(self, server_urls: tuple[str, ...], *, admin_secret: str | None, pool_maxsize: int,
                 retries: int, backoff_factor: float, connect_timeout: float) -> None:
        self.session = build_session(admin_secret=admin_secret, hosts=len(server_urls), pool_maxsize=pool_maxsize,
                                     retries=retries, backoff_factor=backoff_factor)
        self._adapter = self.session.get_adapter("http://")
        self._verify: bool | str = self.session.verify if self.session.verify is not None else True
        self._connect_timeout = connect_timeout
        self._templates = {
            url: self.session.prepare_request(
                requests.Request("POST", url + "/flush", headers={"Content-Type": "application/json"}))
            for url in server_urls
        }

    def _prepare(self, server_url: str, body: bytes) -> requests.PreparedRequest:
        template = self._templates[server_url]
        prepared = requests.PreparedRequest()
        prepared.method = template.method
        prepared.url = template.url
        prepared.headers = template.headers.copy()
        prepared.headers["Content-Length"] = str(len(body))
        prepared.body = body
        return prepared

    def post(self, server_url: str, instance_id: str, call: PairCall) -> FlushResult:
        """POST ``{server_url}/flush`` for one id within ``call.deadline``; never raises."""
        started = time.monotonic()
        _local.call = call
        response: requests.Response | None = None
        try:
            if call.remaining() <= 0:
                return FlushResult(server_url, instance_id, ok=False, error="deadline passed before it was sent")
            body = json.dumps({"session_server_instance_id": instance_id}).encode()
            # The adapter never follows redirects: the bearer never travels to another host.
            response = self._adapter.send(
                self._prepare(server_url, body),
                stream=True,  # so that a huge body is never read past MAX_BODY_BYTES
                # requests passes a urllib3 Timeout through unchanged; its stubs do not say so
                timeout=_DeadlineTimeout(connect=self._connect_timeout, read=None, call=call),  # type: ignore[arg-type]
                verify=self._verify,
                cert=None,
                proxies={},
            )
            status = response.status_code
            if 200 <= status < 300:
                cancelled = _read_cancelled(response)
                return FlushResult(server_url, instance_id, ok=True, status_code=status, cancelled=cancelled,
                                   attempts=call.attempts, elapsed=time.monotonic() - started)
            return FlushResult(server_url, instance_id, ok=False, status_code=status, attempts=call.attempts,
                               elapsed=time.monotonic() - started, error=_describe_status(response, call))
        except Exception as exc:
            error = describe_exception(exc)
            if call.remaining() <= 0:
                error = f"deadline passed ({error})"
            elif call.stop_reason:
                error = f"{error}; {call.stop_reason}"
            return FlushResult(server_url, instance_id, ok=False, attempts=call.attempts,
                               elapsed=time.monotonic() - started, error=error)
        finally:
            if response is not None:
                try:
                    response.close()
                except Exception:
                    pass
            _local.call = None
            call.finish()

    def close(self) -> None:
        """Close the pool (connections still in flight close when they come back)."""
        self.session.close()


def _read_cancelled(response: requests.Response) -> int | None:
    """The ``cancelled`` count of a 2xx body, or None if the body does not give an int."""
    try:
        raw = response.raw.read(MAX_BODY_BYTES + 1, decode_content=True)
    except Exception:
        return None
    if not raw or len(raw) > MAX_BODY_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    cancelled = data.get("cancelled") if isinstance(data, dict) else None
    if isinstance(cancelled, int) and not isinstance(cancelled, bool):
        return cancelled
    return None


def _describe_status(response: requests.Response, call: PairCall) -> str:
    status = response.status_code
    text = f"HTTP {status}"
    hint = _STATUS_HINTS.get(status)
    if 300 <= status < 400:
        hint = "redirect not followed (the bearer never leaves the configured server)"
    elif status in RETRY_STATUSES:
        hint = call.stop_reason or "retries exhausted"
        retry_after = response.headers.get("Retry-After")
        if retry_after and call.stop_reason is None:
            hint += f" (Retry-After: {retry_after[:40]})"
    return f"{text}: {hint}" if hint else text


def describe_exception(exc: BaseException) -> str:
    """A short, credential-free description of a requests/urllib3/socket error."""
    reason: BaseException = exc
    for _ in range(6):  # unwrap requests -> MaxRetryError -> the urllib3 reason
        if isinstance(reason, MaxRetryError) and reason.reason is not None:
            reason = reason.reason
        elif isinstance(reason, requests.RequestException) and reason.args and isinstance(reason.args[0], BaseException):
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
