"""Misbehaving TCP peers on 127.0.0.1 that the stub server cannot play (raw sockets)."""

from __future__ import annotations

import contextlib
import socket
import threading


class RawPeer:
    """A listening socket that misbehaves in one way.

    Modes:
        no-accept: completes the TCP handshake (backlog) but never accepts or reads.
        no-answer: reads the request, never answers.
        cut-body: answers 200 with Content-Length 100, sends 12 bytes, closes.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._conns: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        if mode != "no-accept":
            threading.Thread(target=self._accept_loop, name="raw-peer", daemon=True).start()

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="raw-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            if self.mode == "cut-body":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                             b'{"cancelled"')
                conn.close()
            else:
                self._stop.wait()
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refused_url() -> str:
    """A loopback URL whose port has no listener (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
