"""``CancelToken``: a sending call's hold on one request, its time budget and its sockets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from urllib3.connection import HTTPConnection

from .outcome import Gate


class CancelToken:
    """The sending call's hold on one request: its time budget, and the way to give it up.

    Args:
        deadline_at: monotonic time after which no attempt or retry starts (the owner's deadline).
        linger_until: monotonic time by which every timeout of the request ends (deadline + linger).
    """

    def __init__(self, deadline_at: float, linger_until: float) -> None:
        self.deadline_at = deadline_at
        self.linger_until = linger_until
        self.cancelled = Gate()  # lock-free: a signal handler may give up a request the main thread is giving up
        self.reason = "given up"
        self.attempts = 0  # counted in one place: set to 1 on send, +1 per retry (``_DeadlineRetry``)
        self.stop_reason: str | None = None  # why retrying stopped early
        self.next_wait = 0.0
        self.handed = False  # handed to a worker: only then may a signal handler in ``claimer`` join it
        self.claimer = threading.get_ident()  # the thread whose call claimed the pair (see ``Flusher``)
        # Connections (their socket changes on reconnect) and sockets in a TLS handshake (no connection holds
        # them yet: the wrap detaches the socket the connection had).
        self._holders: list[HTTPConnection | socket.socket] = []

    def time_left(self) -> float:
        """Seconds until the request must end."""
        return self.linger_until - time.monotonic()

    def retry_time_left(self) -> float:
        """Seconds in which another attempt may still start."""
        return min(self.deadline_at, self.linger_until) - time.monotonic()

    def start_lingering(self) -> None:
        """The sending call returned without it (it may return a moment before its deadline): no retry
        starts from now, and a later call short of workers may give it up."""
        self.deadline_at = min(self.deadline_at, time.monotonic())

    def track(self, holder: HTTPConnection | socket.socket) -> None:
        """Note a connection the request uses, or a socket starting its TLS handshake (``cancel`` shuts it down)."""
        self._holders.append(holder)
        if self.cancelled.is_set():
            _shut(holder)

    def cancel(self, reason: str = "given up") -> None:
        """Give the request up now (no more retries or waits, sockets shut down); the first reason stays."""
        if not self.cancelled.is_set():
            self.reason = reason
        self.deadline_at = self.linger_until = -1.0
        self.cancelled.set()
        for holder in list(self._holders):
            _shut(holder)

    def finish(self) -> None:
        """Forget its connections: they are back in the pool, or closed."""
        self._holders = []


def _shut(holder: HTTPConnection | socket.socket) -> None:
    sock = holder.sock if isinstance(holder, HTTPConnection) else holder
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

