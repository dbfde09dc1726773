"""A guard's parser process: long lines are shape-checked and parsed outside the guard's interpreter.

``json.loads`` of a state of tens of MiB holds the GIL for most of a tenth of a second, and no
thread of the guard runs meanwhile: not its loop, not a flush. So a line over ``OFFLOAD_BYTES``
goes to one child process (started with the guard, restarted if it dies), which sends back the
parsed message as ``marshal`` data: a few times cheaper to load than the JSON it came from. The
child ends when the guard closes its pipe (at the guard's death too: end-of-file). A parse that
has not answered within ``PARSE_TIMEOUT`` (a stopped or stuck child) has its child killed and
replaced, and is tried once more on the new one: no thread of the guard waits on it for longer.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import struct
import subprocess
import sys
import time
from typing import Any, Final

from .._process.wire import BadLine, parse_line

_HEADER: Final = struct.Struct("!Q")  # the length of what follows
PARSE_TIMEOUT: Final = 3.0  # seconds a parse may take before its child is replaced (32 MiB: ~0.3 s loaded)


def _wait(fd: int, event: int, give_up_at: float | None) -> None:
    """Until ``fd`` is ready for ``event`` (a non-blocking pipe); ``TimeoutError`` past ``give_up_at``."""
    if give_up_at is None:
        return
    poller = select.poll()
    poller.register(fd, event)
    left = give_up_at - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise TimeoutError


def _read_exactly(fd: int, size: int, give_up_at: float | None = None) -> bytearray:
    """``size`` bytes from ``fd``, read in place; fewer only at end-of-file."""
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        try:
            got = os.readv(fd, [view[done:]])
        except BlockingIOError:
            _wait(fd, select.POLLIN, give_up_at)
            continue
        if not got:
            del data[done:]
            break
        done += got
    view.release()
    return data


def _write_exactly(fd: int, data: bytes | bytearray, give_up_at: float | None = None) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            _wait(fd, select.POLLOUT, give_up_at)


def main() -> None:
    """The child: parse each line it is sent; answer ``("ok", message)`` or ``("bad", why)``."""
    while True:
        header = _read_exactly(0, _HEADER.size)
        if len(header) < _HEADER.size:
            return  # the guard closed the pipe
        line = _read_exactly(0, _HEADER.unpack(header)[0])
        try:
            answer: tuple[str, Any] = ("ok", parse_line(line, strict=True))
        except BadLine as exc:
            answer = ("bad", str(exc))
        except Exception as exc:  # noqa: BLE001 - what a peer sends never stops the parser
            answer = ("bad", f"a message that raised {type(exc).__name__}")
        try:
            data = marshal.dumps(answer)
        except ValueError:
            data = marshal.dumps(("bad", "a message too deep to hold"))
        _write_exactly(1, _HEADER.pack(len(data)) + data)


class ParserProcess:
    """The guard's side: one child, used by one thread at a time (the guard's parse thread)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the child now (at the guard's start: no thread or process is started later but this one,
        and only to replace it)."""
        if self._child is None or self._child.poll() is not None:
            code = f"import sys; sys.path[:0] = {sys.path!r}; from swe_flush_sync._guard.parser import main; main()"
            self._child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, cwd="/")
            assert self._child.stdin is not None and self._child.stdout is not None
            os.set_blocking(self._child.stdin.fileno(), False)  # waits are the guard's, with a deadline
            os.set_blocking(self._child.stdout.fileno(), False)

    def parse(self, line: bytes | bytearray) -> dict[str, Any] | BadLine:
        """The message of ``line``, or what is wrong with it (the child replaced, and tried once more,
        if it failed or did not answer within ``PARSE_TIMEOUT``)."""
        for _ in range(2):
            try:
                self.start()
                child = self._child
                assert child is not None and child.stdin is not None and child.stdout is not None
                give_up_at = time.monotonic() + PARSE_TIMEOUT
                _write_exactly(child.stdin.fileno(), _HEADER.pack(len(line)), give_up_at)
                _write_exactly(child.stdin.fileno(), line, give_up_at)
                header = _read_exactly(child.stdout.fileno(), _HEADER.size, give_up_at)
                if len(header) < _HEADER.size:
                    raise EOFError
                kind, value = marshal.loads(_read_exactly(child.stdout.fileno(), _HEADER.unpack(header)[0],
                                                          give_up_at))
            except (OSError, EOFError, ValueError, TypeError):  # TimeoutError is an OSError
                self.close()
                continue
            return value if kind == "ok" and isinstance(value, dict) else BadLine(str(value))
        return BadLine("a line the guard's parser process failed on")

    def close(self) -> None:
        """End the child (its pipe closed, then killed if it lingers)."""
        child, self._child = self._child, None
        if child is None:
            return
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(OSError):
            child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(5)
