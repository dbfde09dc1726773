"""A real uvicorn server on 127.0.0.1 (port 0) running the contract app, in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from .harbor_app import Stats, create_app  # noqa: E402


@dataclass
class Harbor:
    url: str
    stats: Stats


@pytest.fixture
def harbor_factory() -> Iterator[Callable[..., Harbor]]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*, tls: dict[str, object] | None = None, **settings: object) -> Harbor:
        """The app with ``settings``; with ``tls`` (uvicorn's ``ssl_*`` settings), over https."""
        app, stats = create_app(**settings)  # type: ignore[arg-type]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **(tls or {})))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        end = time.monotonic() + 10
        while not server.started and time.monotonic() < end:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        servers.append((server, thread))
        return Harbor(f"{'https' if tls else 'http'}://127.0.0.1:{sock.getsockname()[1]}", stats)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)
