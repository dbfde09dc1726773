"""What the tests share besides fixtures: the trainer harness (a child Python that arms a watchdog
and really dies), the ledger records, containers (``unshare``), and raw guard peers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swe_flush_sync._guard.daemon import guard_status
from swe_flush_sync._process.proc import Place
from swe_flush_sync._process.wire import PROTOCOL, encode_state
from swe_flush_sync.testing import AgentServerStub

from .conftest import (
    PYTHON,
    SECRET,
    GuardProcess,
    _watchdog_pids,
    gone,
    read_until,
    spawn,
    subprocess_env,
    wait_until,
)

IDS = ("wd-a", "wd-b", "wd-c")


PRELUDE = """
import argparse, os, resource, signal, sys, time
from swe_flush_sync import abort, flush_at_exit, flush_on_signal, watchdog
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a real crash below, but no core file
args = argparse.Namespace(session_server_instance_ids={8000: "wd-a", 8001: "wd-b"},
                          session_server_instance_id="wd-c")
def armed(dog):
    print("ARMED", dog.pid, flush=True)
def until(condition, timeout=20.0):
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()
def refreshed(dog):
    # refresh(), and the watchdog's word when it comes after the half second one call waits for it
    # (a loaded host): True once it holds the new state
    return dog.refresh() or until(lambda: dog.armed)
"""


class Trainer:
    """A child Python running ``PRELUDE + body`` (``prelude=False``: ``body`` alone) in its own session,
    against ``stub``; ``contained``: as PID 1 of its own PID namespace (a container's main process)."""

    def __init__(self, stub: AgentServerStub, body: str, *, stdin: bool = False, prelude: bool = True,
                 contained: bool = False, **env: str) -> None:
        environ = subprocess_env(**{"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET, **env})
        command = [PYTHON, "-c", (PRELUDE if prelude else "") + textwrap.dedent(body)]
        if contained:
            command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *command]
        self.proc = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ,
                          start_new_session=True, stdin=subprocess.PIPE if stdin else None)
        self.watchdog_pid = 0
        self.lines: list[str] = []

    def read(self, word: str, timeout: float = 20) -> list[str]:
        """The words of the first stdout line starting with ``word``."""
        line = read_until(self.proc, lambda text: text.startswith(word), self.lines, timeout)
        if line is not None:
            return line.split()
        self.proc.kill()
        raise AssertionError(f"the trainer never printed {word}: {self.lines}")

    def armed(self) -> int:
        self.watchdog_pid = int(self.read("ARMED")[1])
        _watchdog_pids.append(self.watchdog_pid)
        return self.watchdog_pid

    def go_on(self, line: str = "") -> None:
        """One line to the trainer's stdin (``stdin=True``): a trainer waiting in ``sys.stdin.readline()`` goes on."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def death(self, timeout: float = 20) -> float:
        """When the trainer was seen to have ended (polled every few ms)."""
        assert wait_until(lambda: self.proc.poll() is not None, timeout), "the trainer did not end"
        return time.monotonic()

    def stderr_after_watchdog(self, timeout: float) -> str:
        """The trainer's stderr, read once the watchdog (which inherited it) is gone."""
        assert wait_until(lambda: gone(self.watchdog_pid), timeout), "the watchdog outlived its bound"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


ENV = {"HARBOR_ADMIN_SECRET": SECRET}


@contextlib.contextmanager
def port_held(port: int) -> Iterator[None]:
    """While a stopped stub is down: its port bound and not listening, so that connections are refused
    as by a stopped server, and no other process (a suite beside this one) is given the port before the
    server comes back on it."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", port))
    try:
        yield
    finally:
        held.close()


def records(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir() if path.name.endswith(".json"))


def read_records(folder: Path) -> list[dict[str, Any]]:
    """The records in ``folder`` as they are now; one removed or claimed (renamed) between the listing and
    its reading is left out, as a guard or ``recover`` may do at any moment."""
    read = []
    for path in records(folder):
        with contextlib.suppress(FileNotFoundError):
            read.append(json.loads(path.read_text()))
    return read


def write_record(folder: Path, name: str, ids: list[object], url: str, *, host: str = "elsewhere",
                 heartbeat_age: float = 3600.0, pid: int = 1, start_time: int | None = 1, **more: object) -> Path:
    """A record as a watchdog on another machine would have left it (written here by hand); ``more``
    adds or replaces fields (``boot_id``, ``pid_ns``, ``watchdog_pid``, ...)."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({
        "version": 1, "urls": [url], "ids": ids, "host": host, "pid": pid, "start_time": start_time,
        "boot_id": "another-boot", "heartbeat": time.time() - heartbeat_age, "heartbeat_interval": 10.0, **more}))
    path.chmod(0o600)
    return path


def here() -> dict[str, object]:
    """The record fields that place a process in this host, boot and PID namespace."""
    place = Place.here()
    return {"host": place.host, "boot_id": place.boot_id, "pid_ns": place.pid_ns}


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_unshare = pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare --pid (a container)")


def namespace_init(unshare: subprocess.Popen[str], timeout: float = 10) -> int:
    """The host pid of the process ``unshare --fork`` started: PID 1 of the new namespace."""
    children = f"/proc/{unshare.pid}/task/{unshare.pid}/children"
    found: list[int] = []

    def read() -> bool:
        with open(children) as handle:
            found[:] = [int(pid) for pid in handle.read().split()]
        return bool(found)

    assert wait_until(read, timeout), "unshare started no child"
    return found[0]


def guarded_trainer(stub: AgentServerStub, guard: GuardProcess, body: str = "time.sleep(60)", **env: str) -> Trainer:
    return Trainer(stub, f"""
        dog = watchdog(args, guard={guard.socket!r}, until_idle=False)
        print("ARMED", dog.pid, dog.armed, flush=True)
        {body}
    """, **env)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a process of another uid)")


OTHER_UID = 4242


def state_line(state: dict[str, object], seq: int = 1) -> bytes:
    return b'{"seq": %d, "v": %d, "state": %s}\n' % (seq, PROTOCOL, encode_state(state))


def a_state(**changes: object) -> dict[str, object]:
    state: dict[str, object] = {"urls": [], "ids": ["raw-a"], "tokens": None, "options": {"until_idle": False},
                                "trainer": "0" * 32}
    state.update(changes)
    return state


def answer(peer: socket.socket) -> bytes:
    """What the guard says until it closes the connection (a reset counts as a close), or its ``held``."""
    peer.settimeout(10)
    said = b""
    try:
        while chunk := peer.recv(4096):
            said += chunk
            if said.startswith(b"held") and said.endswith(b"\n"):
                break
    except ConnectionResetError:  # it closed with our bytes unread
        pass
    return said


def draining(path: str) -> bool:
    """A guard answers at ``path`` and says it is draining."""
    status = guard_status(path)
    return status is not None and status.draining


def connect(path: str) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(path)
    return peer


_CONNECTOR = """
import socket, sys
back = socket.socket(fileno=int(sys.argv[3]))
for _ in range(int(sys.argv[2])):
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(sys.argv[1])
    socket.send_fds(back, [b"c"], [peer.fileno()])
    peer.close()
"""


def connections_of_a_gone_process(path: str, count: int) -> list[socket.socket]:
    """``count`` connections to ``path`` made by a process that has exited since: the guard reads a dead
    pid for each peer (``SO_PEERCRED`` is taken at connect), as it would for a dead trainer's. A raw peer
    that closes its lock in this live process is no death (a free lock whose pid lives)."""
    mine, theirs = socket.socketpair()
    with mine:
        with theirs:
            subprocess.run([sys.executable, "-c", _CONNECTOR, path, str(count), str(theirs.fileno())],
                           pass_fds=(theirs.fileno(),), timeout=60, check=True)
        connections: list[socket.socket] = []
        while len(connections) < count:
            _, fds, _, _ = socket.recv_fds(mine, 16, 16)
            connections += [socket.socket(fileno=fd) for fd in fds]
    return connections


# -- 1. no bearer to an impostor ---------------------------------------------------------------------
IMPOSTOR = textwrap.dedent("""
    import os, socket, sys
    path = sys.argv[1]
    os.setgid(4242)
    os.setuid(4242)
    if os.path.exists(path):
        os.unlink(path)  # the folder lets this user: it takes the path while the guard restarts
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    print("LISTENING", flush=True)
    while True:
        conn, _ = listener.accept()
        got = 0
        conn.settimeout(5)
        try:
            while chunk := conn.recv(65536):
                got += len(chunk)
        except OSError:
            pass
        conn.close()
        print("CLOSED", got, flush=True)
""")


def impostor(path: str) -> subprocess.Popen[str]:
    proc = spawn([PYTHON, "-c", IMPOSTOR, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert read_until(proc, lambda line: line == "LISTENING", []) is not None
    return proc


def env_for(*stubs: AgentServerStub, secret: str | None = SECRET) -> dict[str, str]:
    """The environment naming ``stubs`` as the agent servers, with the admin secret unless None."""
    env = {"AGENT_SERVER_URL": ",".join(s.url for s in stubs)}
    if secret:
        env["HARBOR_ADMIN_SECRET"] = secret
    return env
