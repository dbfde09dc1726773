"""A guard's parser process: long lines are shape-checked and parsed outside the guard's interpreter.

``json.loads`` of a state of tens of MiB holds the GIL for most of a tenth of a second, and no
thread of the guard runs meanwhile: not its loop, not a flush. So a line over ``OFFLOAD_BYTES``
goes to one child process (started with the guard, restarted if it dies), which sends back the
parsed message as ``marshal`` data: a few times cheaper to load than the JSON it came from. The
child ends when the guard closes its pipe (at the guard's death too: end-of-file). A parse whose
child makes no progress for ``PARSE_TIMEOUT`` (a stopped or stuck child), or runs past a ceiling
that grows with the line (``PARSE_PER_MIB``), has its child killed and replaced, and is tried once
more on the new one; a slow parse on a loaded host is waited for, not refused.
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

from .._process.proc import process_stat
from .._process.wire import BadLine, parse_line

_HEADER: Final = struct.Struct("!Q")  # the length of what follows
PARSE_TIMEOUT: Final = 3.0  # seconds a parse's child may make no progress (use no CPU) before it is replaced
PARSE_PER_MIB: Final = 5.0  # ... and seconds per MiB of the line (on top of PARSE_TIMEOUT) it may take at most,
# progress or not (a 9.5 MiB state took 2.3-4.1 s alone, 13.8 s beside 12 CPU burners)


class _Patience:
    """How long a parse is waited for: while its child makes progress (its CPU time grows within each
    ``PARSE_TIMEOUT``), up to ``PARSE_TIMEOUT`` plus ``PARSE_PER_MIB`` a MiB of the line. A stopped or
    stuck child is replaced after ``PARSE_TIMEOUT``; a slow one, under load, is waited for."""

    def __init__(self, pid: int, size: int) -> None:
        now = time.monotonic()
        self._pid = pid
        self._ceiling = now + PARSE_TIMEOUT + PARSE_PER_MIB * size / (1 << 20)
        self._cpu, self._next_look = _cpu_ticks(pid), now + PARSE_TIMEOUT

    def left(self) -> float:
        """Seconds until the next look at the child's progress."""
        return min(self._next_look, self._ceiling) - time.monotonic()

    def goes_on(self) -> bool:
        """At a look: has the child used CPU since the last one (and is the ceiling still ahead)?"""
        now, cpu = time.monotonic(), _cpu_ticks(self._pid)
        if now >= self._ceiling or cpu is None or cpu == self._cpu:
            return False
        self._cpu, self._next_look = cpu, now + PARSE_TIMEOUT
        return True


def _cpu_ticks(pid: int) -> int | None:
    """The user and system CPU time ``pid`` used, in clock ticks; None when it is gone."""
    fields = process_stat(pid)
    return None if fields is None or len(fields) < 13 else int(fields[11]) + int(fields[12])


def _wait(fd: int, event: int, patience: _Patience | None) -> None:
    """Until ``fd`` is ready for ``event`` (a non-blocking pipe); ``TimeoutError`` once ``patience`` ends."""
    if patience is None:
        return
    poller = select.poll()
    poller.register(fd, event)
    while not poller.poll(max(patience.left(), 0.0) * 1000):
        if not patience.goes_on():
            raise TimeoutError


def _read_exactly(fd: int, size: int, patience: _Patience | None = None) -> bytearray:
    """``size`` bytes from ``fd``, read in place; fewer only at end-of-file."""
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        try:
            got = os.readv(fd, [view[done:]])
        except BlockingIOError:
            _wait(fd, select.POLLIN, patience)
            continue
        if not got:
            del data[done:]
            break
        done += got
    view.release()
    return data


def _write_exactly(fd: int, data: bytes | bytearray, patience: _Patience | None = None) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            _wait(fd, select.POLLOUT, patience)


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


# The child imports this file, ``_process.wire`` and ``_process.proc`` (the standard library's only) as
# modules of a package named ``LEAN_PACKAGE`` on the package's folder, so that the package's own
# ``__init__`` (every public name, requests included) is never run there.
LEAN_PACKAGE: Final = "_swe_flush_parser"
_CHILD_CODE: Final = f"""import importlib, importlib.machinery, importlib.util, sys
spec = importlib.machinery.ModuleSpec({LEAN_PACKAGE!r}, None, is_package=True)
spec.submodule_search_locations = [{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
importlib.import_module({LEAN_PACKAGE + "._guard.parser"!r}).main()
"""


class ParserProcess:
    """The guard's side: one child, used by one thread at a time (the guard's parse thread)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the child now (at the guard's start: no thread or process is started later but this one,
        and only to replace it)."""
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-c", _CHILD_CODE], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/")
            assert self._child.stdin is not None and self._child.stdout is not None
            os.set_blocking(self._child.stdin.fileno(), False)  # waits are the guard's, with a deadline
            os.set_blocking(self._child.stdout.fileno(), False)

    def parse(self, line: bytes | bytearray) -> dict[str, Any] | BadLine:
        """The message of ``line``, or what is wrong with it (the child replaced, and tried once more,
        if it failed, or made no progress for ``PARSE_TIMEOUT``, or ran past its line's ceiling)."""
        for _ in range(2):
            try:
                self.start()
                child = self._child
                assert child is not None and child.stdin is not None and child.stdout is not None
                patience = _Patience(child.pid, len(line))
                _write_exactly(child.stdin.fileno(), _HEADER.pack(len(line)), patience)
                _write_exactly(child.stdin.fileno(), line, patience)
                header = _read_exactly(child.stdout.fileno(), _HEADER.size, patience)
                if len(header) < _HEADER.size:
                    raise EOFError
                kind, value = marshal.loads(_read_exactly(child.stdout.fileno(), _HEADER.unpack(header)[0],
                                                          patience))
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
