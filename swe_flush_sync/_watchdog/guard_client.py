"""The trainer's side of a guard connection: who is listening, before a byte is sent.

Whoever can put a socket at the guard's path (another user in a shared folder, or anyone while
the guard restarts) would receive the trainer's bearers. ``connect_to_guard`` therefore reads
the listener's credentials (``SO_PEERCRED``, filled in by the kernel at ``listen()``) and sends
nothing unless the guard runs as this user or as root, like ``ssh-agent`` checks its clients.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Final

from .._core.errors import FlushError
from .._core.text import shown

PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ImpostorError(FlushError):
    """The socket at the guard's path is served by another user; nothing was sent to it."""

    def __init__(self, path: str, uid: int) -> None:
        super().__init__(f"the socket at {shown(path)} is served by uid {uid}, not by this user (uid "
                         f"{os.geteuid()}) or root: nothing was sent to it")
        self.uid = uid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return int(uid)


def connect_to_guard(path: str, timeout: float) -> socket.socket:
    """A connection to the guard at ``path``, checked: its listener runs as this user or root.

    Raises:
        ImpostorError: another user listens there (the connection is closed, nothing sent).
        OSError: nobody listens there (no such file, refused, timed out).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        uid = peer_uid(sock)
    except BaseException:
        sock.close()
        raise
    if uid not in (os.geteuid(), 0):
        sock.close()
        raise ImpostorError(path, uid)
    return sock
