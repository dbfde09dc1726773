"""A stub agent server speaking the ``/flush`` wire, on real loopback sockets (stdlib only).

It imports nothing from swe_flush_sync, so tests that use it never share code with what they
test. Public as ``swe_flush_sync.testing.AgentServerStub``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class RecordedRequest:
    """One request the stub received.

    Attributes:
        method, path: the request line.
        instance_id: the id in a well-formed ``/flush`` body, else None.
        authorization: the ``Authorization`` header as received, or None.
        body: the raw body.
        connection: serial number of the TCP connection it came on (1 = first accepted).
        status: the status answered; None when the connection was dropped or hung.
        at: ``time.monotonic()`` when it arrived (its body read), before any teardown or latency;
            the request is listed once it has been answered.
    """

    method: str
    path: str
    instance_id: str | None
    authorization: str | None
    body: bytes
    connection: int
    status: int | None
    at: float


@dataclass
class _Fault:
    latency: float = 0.0
    statuses: deque[int] = field(default_factory=deque)
    retry_after: str | None = None
    hang: bool = False
    drop: bool = False
    trickle: float | None = None
    body: bytes | None = None
    redirect_to: str | None = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the default 5 resets connections under a burst of connects

    def __init__(self, stub: AgentServerStub, address: tuple[str, int], tls: ssl.SSLContext | None) -> None:
        self.stub = stub
        super().__init__(address, _Handler)
        if tls is not None:  # the handshake runs on the first read, in the connection's own thread
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.stub._accepted(request)
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-answer (deadlines, capped reads) are expected here

    def shutdown_request(self, request: Any) -> None:
        self.stub._closed(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    arrived = 0.0  # when the request being handled arrived

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._not_found()

    def do_POST(self) -> None:
        self.server.stub._handle(self)

    def _not_found(self) -> None:
        self.server.stub._record(self, None, b"", 404)
        self.send_json(404, {"detail": "Not Found"})

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        """Answer ``status`` with a JSON body (and extra headers)."""
        self.send_raw(status, json.dumps(payload).encode(), headers)

    def send_raw(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Answer ``status`` with ``body`` as is."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class AgentServerStub:
    """A stub Harbor agent server for tests, demos and benchmarks.

    Serves ``POST /flush`` on 127.0.0.1 at a free port: checks the bearer secret (401), the
    JSON body (422), answers 404 elsewhere, and on success waits ``teardown`` seconds (the
    cancelled trials' teardown) and answers ``{"session_server_instance_id": id,
    "cancelled": n}`` with the in-flight trials it held for that id. Per-id faults can be
    scripted with ``fault``; every request is recorded.

    Like the bridge, it runs at most ``max_concurrent`` trials at once: a run added beyond that
    waits for a slot, and only a trial that holds one is registered for ``/flush`` (so one flush
    does not cancel the runs still waiting; they take the freed slots when its teardown ends).
    ``POST /trials`` with ``{"session_server_instance_id": id, "count": n}`` adds runs over HTTP.

    Args:
        secret: the static bearer secret required; None accepts any request.
        teardown: seconds each successful flush takes (its trials stay registered meanwhile,
            and a flush arriving then is counted in ``recancels``).
        host: the address to bind.
        port: the port to bind; 0 picks a free one (see ``url``).
        scoped_secret: a master secret: each flush must carry the per-instance bearer
            (hex HMAC-SHA256 of ``miles-harbor-flush-session-v1\\x00session:<id>``), as newer
            deployments require; takes precedence over ``secret``.
        max_concurrent: trials running at once (the bridge's ``AGENT_MAX_CONCURRENT``); None: no limit.
        tls: a server-side ``ssl.SSLContext`` (its certificate loaded; ``verify_mode`` set to require
            a client certificate if wanted): serve https instead of http.
        ca_bundle: the CA file that trusts the stub's certificate, kept for its clients (not read).

    Examples:
        ```python
        with AgentServerStub(secret="s3cret", teardown=0.1) as stub:
            stub.add_trials("inst-1", 3)
            flush(stub.url, ["inst-1"], admin_secret="s3cret").cancelled
        # 3
        ```
    """

    def __init__(self, *, secret: str | None = None, teardown: float = 0.0, host: str = "127.0.0.1",
                 scoped_secret: str | None = None, port: int = 0, max_concurrent: int | None = None,
                 tls: ssl.SSLContext | None = None, ca_bundle: str | None = None) -> None:
        self.secret = secret
        self.tls = tls
        self.ca_bundle = ca_bundle
        self._port = port
        self.scoped_secret = scoped_secret
        self.teardown = teardown
        self._host = host
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.max_concurrent = max_concurrent
        self._trials: dict[str, int] = {}  # id -> trials holding a slot (registered for /flush)
        self._waiting: deque[str] = deque()  # one id per run waiting for a slot, oldest first
        self._faults: dict[str, _Fault] = {}
        self._requests: list[RecordedRequest] = []
        self._sockets: dict[int, tuple[int, socket.socket]] = {}  # id -> (serial, socket), open ones
        self._connections = 0
        self._tearing_down: dict[str, int] = {}  # id -> flushes now waiting for its teardown
        self._recancels = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AgentServerStub:
        """Bind the port (a free one by default) and serve in a background thread."""
        self._server = _Server(self, (self._host, self._port), self.tls)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="agent-server-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; hung and trickling requests are released, open connections closed."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            sockets = [sock for _, sock in self._sockets.values()]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> AgentServerStub:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (``https://`` with ``tls``)."""
        if self._server is None:
            raise RuntimeError("the stub is not started")
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host.decode() if isinstance(host, bytes) else host}:{port}"

    # -- scripting ---------------------------------------------------------------------------
    def add_trials(self, instance_id: str, count: int = 1) -> None:
        """Start ``count`` more runs for ``instance_id``: each a trial while a slot is free, else waiting."""
        with self._lock:
            self._waiting.extend([instance_id] * count)
            self._start_waiting()

    def trials(self, instance_id: str) -> int:
        """Trials of ``instance_id`` running (holding a slot)."""
        with self._lock:
            return self._trials.get(instance_id, 0)

    def waiting(self, instance_id: str | None = None) -> int:
        """Runs waiting for a slot (of ``instance_id``, or of every id)."""
        with self._lock:
            return sum(1 for queued in self._waiting if instance_id in (None, queued))

    def _start_waiting(self) -> None:
        """Give free slots to the oldest waiting runs (lock held)."""
        while self._waiting and (self.max_concurrent is None or sum(self._trials.values()) < self.max_concurrent):
            instance_id = self._waiting.popleft()
            self._trials[instance_id] = self._trials.get(instance_id, 0) + 1

    def fault(self, instance_id: str, *, latency: float = 0.0, statuses: Iterable[int] = (),
              retry_after: str | int | None = None, hang: bool = False, drop: bool = False,
              trickle: float | None = None, body: bytes | None = None,
              redirect_to: str | None = None) -> None:
        """Script how flushes of ``instance_id`` misbehave (replaces any earlier script).

        Args:
            latency: extra seconds before answering.
            statuses: statuses answered, one per request, before the normal answer.
            retry_after: ``Retry-After`` header value sent with those statuses.
            hang: never answer (until the stub stops).
            drop: close the connection without answering.
            trickle: answer 200 headers, then one body byte every ``trickle`` seconds, forever.
            body: the raw 200 body to send instead of the JSON answer.
            redirect_to: ``Location`` sent with 3xx statuses.
        """
        with self._lock:
            self._faults[instance_id] = _Fault(latency, deque(statuses), None if retry_after is None
                                               else str(retry_after), hang, drop, trickle, body, redirect_to)

    # -- records -----------------------------------------------------------------------------
    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        with self._lock:
            return self._connections

    @property
    def recancels(self) -> int:
        """Flushes that arrived while an earlier flush of the same id was still tearing down.

        The real bridge cancels the trials again then, mid-teardown: a client should never.
        """
        with self._lock:
            return self._recancels

    def flushed_ids(self) -> list[str]:
        """Ids of the requests answered 2xx, in order (an id flushed twice appears twice). A request is
        recorded as its answer is sent, before the client has read it: stop the stub only once the
        client is done, or its last answers may be cut off."""
        return [r.instance_id for r in self.requests if r.instance_id and r.status and 200 <= r.status < 300]

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        with self._lock:
            self._requests.clear()

    # -- serving (handler threads) -------------------------------------------------------------
    def _accepted(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._connections += 1
            self._sockets[id(sock)] = (self._connections, sock)

    def _closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.pop(id(sock), None)

    def _record(self, handler: _Handler, instance_id: str | None, body: bytes, status: int | None) -> None:
        with self._lock:
            serial = self._sockets.get(id(handler.connection), (0, None))[0]
            self._requests.append(RecordedRequest(handler.command, handler.path, instance_id,
                                                  handler.headers.get("Authorization"), body, serial,
                                                  status, handler.arrived))

    def _handle(self, handler: _Handler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        handler.arrived = time.monotonic()  # recorded once answered (after any teardown), timed from here
        if handler.path == "/trials":
            self._add_trials_over_http(handler, body)
            return
        if handler.path != "/flush":
            self._record(handler, None, body, 404)
            handler.send_json(404, {"detail": "Not Found"})
            return
        instance_id = self._parse_id(body)
        if instance_id is None:  # the body is validated first, as FastAPI does before the endpoint runs
            self._record(handler, None, body, 422)
            handler.send_json(422, {"detail": "session_server_instance_id (str) required"})
            return
        if not self._authorized(handler.headers.get("Authorization"), instance_id):
            self._record(handler, None, body, 401)
            handler.send_json(401, {"detail": "Invalid bearer token"})
            return
        with self._lock:
            fault = self._faults.get(instance_id) or _Fault()
            status = fault.statuses.popleft() if fault.statuses else None
        if fault.latency:
            self._stopping.wait(fault.latency)
        if fault.hang or fault.drop:
            self._record(handler, instance_id, body, None)
            if fault.hang:
                self._stopping.wait()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if status is not None:
            self._record(handler, instance_id, body, status)
            headers = {}
            if fault.retry_after is not None:
                headers["Retry-After"] = fault.retry_after
            if fault.redirect_to is not None:
                headers["Location"] = fault.redirect_to
            handler.send_json(status, {"detail": f"scripted {status}"}, headers)
            return
        if fault.trickle is not None:
            self._record(handler, instance_id, body, 200)
            self._trickle(handler, fault.trickle)
            return
        with self._lock:
            if self._tearing_down.get(instance_id):
                self._recancels += 1
            self._tearing_down[instance_id] = self._tearing_down.get(instance_id, 0) + 1
            cancelled = self._trials.get(instance_id, 0)  # registered until their teardown ends
        if self.teardown:
            self._stopping.wait(self.teardown)
        with self._lock:
            self._tearing_down[instance_id] -= 1
            self._trials[instance_id] = self._trials.get(instance_id, 0) - cancelled  # their slots are free
            self._start_waiting()
        self._record(handler, instance_id, body, 200)
        if fault.body is not None:
            handler.send_raw(200, fault.body)
        else:
            handler.send_json(200, {"session_server_instance_id": instance_id, "cancelled": cancelled})

    def _add_trials_over_http(self, handler: _Handler, body: bytes) -> None:
        instance_id = self._parse_id(body)
        try:
            count = json.loads(body).get("count", 1)
        except (ValueError, AttributeError):
            count = None
        if instance_id is None or not isinstance(count, int) or not 0 <= count <= 100_000:
            self._record(handler, None, body, 422)
            handler.send_json(422, {"detail": "session_server_instance_id (str) and count (int) required"})
            return
        self.add_trials(instance_id, count)
        self._record(handler, None, body, 200)
        handler.send_json(200, {"running": self.trials(instance_id), "waiting": self.waiting(instance_id)})

    def _authorized(self, header: str | None, instance_id: str) -> bool:
        if self.scoped_secret is not None:
            token = hmac.new(self.scoped_secret.encode(), b"miles-harbor-flush-session-v1\x00session:"
                             + instance_id.encode(), hashlib.sha256).hexdigest()
        elif self.secret is not None:
            token = self.secret
        else:
            return True
        expected = f"Bearer {token}".encode()
        return header is not None and secrets.compare_digest(header.encode("latin-1", "replace"), expected)

    @staticmethod
    def _parse_id(body: bytes) -> str | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        instance_id = data.get("session_server_instance_id") if isinstance(data, dict) else None
        return instance_id if isinstance(instance_id, str) and instance_id else None

    def _trickle(self, handler: _Handler, interval: float) -> None:
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "1000000")
        handler.end_headers()
        try:
            handler.wfile.write(b"{")
            while not self._stopping.wait(interval):
                handler.wfile.write(b" ")
                handler.wfile.flush()
        except OSError:
            pass


@contextlib.contextmanager
def black_holes(count: int) -> Iterator[list[str]]:
    """``count`` servers on 127.0.0.1 whose connects never complete (a listener whose one-place queue
    is full: the kernel drops every SYN after it, as a firewall that drops packets does); their URLs."""
    listeners: list[socket.socket] = []
    fillers: list[socket.socket] = []
    try:
        for _ in range(count):
            listener = socket.create_server(("127.0.0.1", 0), backlog=0)
            listeners.append(listener)
            fillers.append(socket.create_connection(listener.getsockname()))
        yield [f"http://127.0.0.1:{listener.getsockname()[1]}" for listener in listeners]
    finally:
        for sock in fillers + listeners:
            sock.close()
