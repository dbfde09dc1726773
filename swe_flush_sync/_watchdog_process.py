"""The watchdog process: waits for its trainer's end, then flushes the trainer's last ids.

Run by ``watchdog()`` as a fresh interpreter (``python <this file> --trainer-pid N ...``), it
double-forks into its own session, ignores SIGINT, SIGTERM and SIGHUP, and blocks reading the
control pipe whose write end only the trainer holds. Each line on the pipe is a JSON message:
``{"state": {...}}`` (servers, ids, per-id bearers, options, the trainer's ``sys.path``, the
ledger) or ``{"disarm": true}``. End-of-file means the trainer is gone, however it died: the
watchdog then imports ``swe_flush_sync`` (only now: while it waits it holds nothing but the
standard library), calls the public ``flush`` with the last state, writes one summary line to
the stderr it inherited and exits.

With a ledger (a directory), it also keeps one record of the trainer's servers and ids there
(never a secret), refreshes its heartbeat, and removes it after a flush that succeeded for every
pair or on disarm. This module imports only the standard library: ``swe_flush_sync._ledger``
reads the records with the helpers below.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from swe_flush_sync import FlushReport

RECORD_VERSION: Final = 1
MAX_STATE_BYTES: Final = 64 << 20  # a control line, and so a ledger record (smaller), is at most this long
RECORD_SUFFIX: Final = ".json"
HELD: Final = b"held"  # "held SEQ PID": the watchdog holds state SEQ whole (the first one: it is armed)
LEDGER: Final = b"ledger"  # "ledger ok", or "ledger WHY" when its record could not be written
SAY_TIMEOUT: Final = 0.5  # seconds a line to the inherited stderr may take (a reader that stopped reading)
IGNORED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PROCESS_NAME: Final = b"swe-flush-watch"  # /proc/PID/comm, at most 15 bytes
# The standard library that requests, urllib3 and the flush need, imported while the watchdog waits:
# about 10 MiB more (20 MiB in all) for about 40 ms less between the trainer's death and the first
# flush request. requests itself (another 10 MiB) is imported only then.
PRELOADED: Final = ("ssl", "http.client", "email.parser", "concurrent.futures.thread", "logging", "dataclasses",
                    "urllib.parse", "hmac", "hashlib", "queue", "weakref", "typing")


def host_name() -> str:
    """This machine's host name."""
    return socket.gethostname()


def boot_id() -> str | None:
    """The kernel's boot id (changes at every boot), None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> int | None:
    """The inode of this process's PID namespace: pids mean something only inside one. None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When the live process ``pid`` started (clock ticks since boot); None if it does not exist, is
    a zombie nobody has reaped yet or is dying (states Z and X: as dead as it will get), or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    fields = stat.rpartition(b")")[2].split()
    try:
        if fields[0] in (b"Z", b"X", b"x"):  # field 3, the state
            return None
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def record_file_name(host: str, pid: int, started: int | None, watchdog_pid: int) -> str:
    """The ledger file of one watchdog: its trainer's host, pid and start time (unique on a host
    across pid reuse), and its own pid (a trainer may arm several)."""
    safe_host = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in host)[:64] or "host"
    return f"{safe_host}.{pid}.{started or 0}.{watchdog_pid}{RECORD_SUFFIX}"


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``: a temporary file beside it, fsync, rename, fsync the directory."""
    folder = os.path.dirname(path) or "."
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


class _RecordKeeper:
    """The trainer's record in the ledger directory, kept by the watchdog."""

    def __init__(self, folder: str, trainer_pid: int, heartbeat: float) -> None:
        self.heartbeat = heartbeat
        self._host = host_name()
        self._started = process_start_time(trainer_pid)
        self._pid = trainer_pid
        self._boot = boot_id()
        self._namespace = pid_namespace()  # the trainer's too: it started us
        self._watchdog = {"watchdog_pid": os.getpid(), "watchdog_start_time": process_start_time(os.getpid())}
        self.path = os.path.join(folder, record_file_name(self._host, trainer_pid, self._started, os.getpid()))
        self._state: Mapping[str, Any] = {}

    def write(self, state: Mapping[str, Any] | None = None) -> None:
        """Write (or rewrite) the record with ``state``'s servers and ids and a fresh heartbeat."""
        if state is not None:
            self._state = state
        record = {"version": RECORD_VERSION, "urls": list(self._state.get("urls", ())),
                  "ids": list(self._state.get("ids", ())), "host": self._host, "pid": self._pid,
                  "start_time": self._started, "boot_id": self._boot, "pid_ns": self._namespace, **self._watchdog,
                  "heartbeat": time.time(), "heartbeat_interval": self.heartbeat}
        write_atomically(self.path, json.dumps(record).encode())

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _say(line: str) -> None:
    """One line on the inherited stderr, given up after ``SAY_TIMEOUT``: a closed, broken or full
    one (a launcher that stopped reading) never keeps the watchdog from going on or exiting."""
    if sys.stderr is None:  # fd 2 was closed when the trainer started us
        return
    writer = threading.Thread(target=_write_all, args=(2, (line + "\n").encode("utf-8", "replace")), daemon=True)
    writer.start()
    writer.join(SAY_TIMEOUT)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data):]


def _detach() -> None:
    """Double fork into a new session; only the grandchild returns (the others exit, reaped)."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)  # the middle process ends at once: no zombie stays
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(PROCESS_NAME)
    except OSError:
        pass


class _Watch:
    """The watchdog's state: the last state it holds whole, the ledger record, the ready pipe."""

    def __init__(self, trainer_pid: int, ready_fd: int) -> None:
        self.trainer_pid = trainer_pid
        self.state: dict[str, Any] | None = None
        self.ledger: _RecordKeeper | None = None
        self._ready_fd = ready_fd
        self._preloaded = False
        self._ledger_error: str | None = None
        os.set_blocking(ready_fd, False)  # a trainer that does not read our word never stops us

    def take(self, line: bytes) -> bool:
        """Apply one control line; False on disarm."""
        try:
            message = json.loads(line)
        except ValueError:
            return True  # a line the trainer cut and ended early: the next state replaces it
        if not isinstance(message, dict):
            return True
        if message.get("disarm"):
            return False
        state, seq = message.get("state"), message.get("seq")
        if isinstance(state, dict) and isinstance(seq, int):
            self.state = state
            self._keep_record(state)  # first: once watchdog() or refresh() returns, recover() can see it
            self._tell(HELD + b" %d %d" % (seq, os.getpid()))
            if not self._preloaded:  # while watchdog() returns
                self._preloaded = True
                for module in PRELOADED:
                    importlib.import_module(module)
        return True

    def _tell(self, word: bytes) -> None:
        """One line to the trainer; dropped when the trainer is gone or has not read for long."""
        with contextlib.suppress(OSError):
            os.write(self._ready_fd, word + b"\n")

    def _keep_record(self, state: dict[str, Any] | None = None) -> None:
        """Write the ledger record (with ``state``, else a heartbeat); say once per kind when it fails."""
        folder = state.get("ledger") if state is not None else None
        if self.ledger is None and isinstance(folder, str) and state is not None:
            self.ledger = _RecordKeeper(folder, self.trainer_pid, float(state.get("heartbeat", 10.0)))
        if self.ledger is None:
            return
        try:
            self.ledger.write(state)
        except OSError as exc:
            error: str | None = exc.strerror or type(exc).__name__
        else:
            error = None
        if error != self._ledger_error:
            self._ledger_error = error
            self._tell(LEDGER + b" " + (b"ok" if error is None else error.encode("utf-8", "replace")))
            if error is not None:
                _say(f"swe-flush watchdog for pid {self.trainer_pid}: cannot write the ledger record: {error}")

    def wait_for_end(self, control_fd: int) -> bool:
        """Block until end-of-file (True) or disarm (False); heartbeats in between."""
        pending = b""
        while True:
            timeout = self.ledger.heartbeat if self.ledger is not None else None
            readable, _, _ = select.select([control_fd], [], [], timeout)
            if not readable:
                self._keep_record()
                continue
            chunk = os.read(control_fd, 1 << 20)
            if not chunk:
                return True
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not self.take(line):
                    return False

    def flush(self) -> FlushReport | None:
        """Flush the last state's pairs with the public ``flush``; None when there was nothing to flush."""
        state = self.state
        if state is None or not state.get("ids") or not state.get("urls"):
            return None
        sys.path[:] = state.get("sys_path") or sys.path
        from swe_flush_sync import flush  # imported only now: the wait stays lean

        tokens: dict[str, str] | None = state.get("tokens")
        options = dict(state.get("options") or {})
        if tokens is not None:
            options["bearer"] = tokens.__getitem__  # a missing token fails that pair only
        return flush(state["urls"], state["ids"], linger=0.0, **options)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the watchdog process (``--trainer-pid N --control-fd R --ready-fd W``)."""
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED_SIGNALS)  # blocked by the trainer while it started us
    args = dict(zip(*[iter(argv if argv is not None else sys.argv[1:])] * 2, strict=False))
    trainer_pid = int(args["--trainer-pid"])
    control_fd, ready_fd = int(args["--control-fd"]), int(args["--ready-fd"])
    _detach()
    watch = _Watch(trainer_pid, ready_fd)
    code, said = 0, ""
    try:
        if watch.wait_for_end(control_fd):
            report = watch.flush()
            code = 0 if report is None or report.ok else 1
            said = "" if report is None else f"trainer gone; {report.summary()}"
        if code == 0 and watch.ledger is not None:  # flushed, or disarmed: the trainer's own hook flushed
            watch.ledger.remove()
    except Exception as exc:  # noqa: BLE001 - the last words of a process nobody waits for
        code, said = 2, f"failed: {type(exc).__name__}"
    if said:  # after the record is settled: a stalled stderr holds us at most SAY_TIMEOUT
        _say(f"swe-flush watchdog for pid {trainer_pid}: {said}")
    os._exit(code)  # no lingering worker thread (a DNS lookup, a connect) may hold the exit


if __name__ == "__main__":
    main()
