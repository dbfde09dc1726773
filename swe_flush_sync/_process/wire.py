"""The control line protocol between a trainer and its watchdog or guard: constants, the encoding,
its shape check and the line parser. Standard library only (the watchdog process imports it).

A trainer writes one JSON object a line: ``{"seq": N, "v": PROTOCOL, "state": {...}}``,
``{"disarm": true}`` or ``{"status": true}``. The far end answers with one word a line: ``held``,
``refused``, ``ledger``, ``status``, ``lock`` or ``recorded`` (below; a guard passes a descriptor with
``lock``). A successor guard asks its draining predecessor ``{"listener": true}`` and is passed the
listening socket with ``listener``.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
from collections.abc import Mapping
from typing import Any, Final

# 1 (0.5.0) had no version; 2 adds "v", the trainer's token, the guard's version in "held",
# "refused", and strings that hold no raw backslash-quote (see encode_state); 3 adds "recorded" (a
# guard of 3 says it once the record naming the lock it passed is written) and "listener".
PROTOCOL: Final = 3
OLDEST_GUARD: Final = 2  # the oldest protocol a trainer arms with (a guard of 2 never says "recorded")
MAX_IDS: Final = 100_000  # ids in one state
MAX_SOCKET_PATH: Final = 107  # bytes in a guard's socket path (sockaddr_un's sun_path, less its NUL)
OFFLOAD_BYTES: Final = 64 << 10  # a guard parses a longer line on a worker, not on its loop
MAX_STATE_BYTES: Final = 32 << 20  # a control line, and so a ledger record, is at most this long
MAX_STRINGS: Final = 3 * MAX_IDS + 4096  # ids, and each id's bearer with its key, and the rest
MAX_ITEMS: Final = 2 * MAX_IDS + 4096  # commas outside strings: list items and object members
MAX_CONTAINERS: Final = 64  # lists and objects in one message ("[" and "{" outside strings)
CANCEL: Final = b"\x18"  # ends a line written only in part: "drop this line" (JSON never holds a raw one)
STATUS: Final = b"status"  # the answer to {"status": true}: "status PID TRAINERS [draining]"
HELD: Final = b"held"  # "held SEQ PID PROTOCOL": the far end holds state SEQ whole (the first one: armed)
LEDGER: Final = b"ledger"  # "ledger ok", or "ledger WHY" when its record could not be written
REFUSED: Final = b"refused"  # "refused WHY": a guard will not hold this state; the connection ends
LOCK_WORD: Final = b"lock"  # sent with a lock file's descriptor (SCM_RIGHTS), before "held": hold it while you live
RECORDED: Final = b"recorded"  # the ledger record names the lock passed last: older locks may go (see ownership)
LISTENER: Final = b"listener"  # sent with a draining guard's listening socket to its successor (SCM_RIGHTS)
MAX_PASSED_FDS: Final = 4  # descriptors one read takes from a guard (it passes one at a time)


class BadLine(ValueError):
    """A line that cannot be taken; the message says why (never its content)."""


def encode_state(message: Mapping[str, Any]) -> bytes:
    """``message`` as one JSON line body in which a ``"`` byte only ever starts or ends a string: the
    escapes ``\\\\`` and ``\\"`` are written ``\\u005c`` and ``\\u0022`` (the same JSON), so a reader can
    check the line's shape by splitting it on ``"`` before it parses it."""
    return json.dumps(message).encode().replace(b"\\\\", b"\\u005c").replace(b'\\"', b"\\u0022")


def shape_problem(line: bytes | bytearray) -> str | None:
    """Why ``line`` is not shaped like a control message (too many strings, items or containers,
    or escapes ``encode_state`` never writes), or None. Costs a few C-level passes over the bytes,
    so a line that would parse into a huge or deeply nested object is refused before ``json.loads``."""
    if line.count(b'"') > 2 * MAX_STRINGS:
        return f"a message of more than {MAX_STRINGS} strings"
    if b'\\"' in line or b"\\\\" in line:
        return "a message with a raw backslash escape (not protocol 2)"
    outside = line.split(b'"')[0::2]  # what is not inside a string
    if sum(part.count(b"[") + part.count(b"{") for part in outside) > MAX_CONTAINERS:
        return f"a message of more than {MAX_CONTAINERS} lists and objects"
    if sum(part.count(b",") for part in outside) > MAX_ITEMS:
        return f"a message of more than {MAX_ITEMS} items"
    return None


def parse_line(line: bytes | bytearray, strict: bool) -> dict[str, Any]:
    """The message of one line; ``strict`` (a guard's peers): shape-checked first (``shape_problem``).

    Raises:
        BadLine: what is wrong with it.
    """
    problem = shape_problem(line) if strict else None
    if problem is not None:
        raise BadLine(problem)
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise BadLine("a line that is not JSON") from None
    if not isinstance(message, dict):
        raise BadLine("a message that is not an object")
    return message


def send_with_fd(sock_fd: int, data: bytes, passed: int) -> None:
    """Send ``data`` whole with a copy of the descriptor ``passed`` (``SCM_RIGHTS``) on the Unix socket
    ``sock_fd``; ``OSError`` when it cannot be sent whole at once (a peer that does not read)."""
    sock = socket.socket(fileno=sock_fd)
    try:
        if socket.send_fds(sock, [data], [passed]) != len(data):
            raise OSError("sent in part")
    finally:
        sock.detach()


def receive_with_fds(sock_fd: int, size: int) -> tuple[bytes, list[int], bool]:
    """What can be read from the Unix socket ``sock_fd``, the descriptors passed with it (made
    close-on-exec as they arrive), and whether some were lost (``MSG_CTRUNC``: the kernel found no
    free descriptor, or no room, for them). ``BlockingIOError`` when nothing waits."""
    sock = socket.socket(fileno=sock_fd)
    try:
        data, ancillary, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(MAX_PASSED_FDS * 4),
                                                 socket.MSG_CMSG_CLOEXEC)
    finally:
        sock.detach()
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), bool(flags & socket.MSG_CTRUNC)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (blocking), giving up silently at the first error."""
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data):]
