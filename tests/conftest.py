"""Shared fixtures: a clean environment, the stub agent server, thread accounting."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swe_flush_sync import Watchdog, watchdog
from swe_flush_sync._hooks import _close_cached_flushers
from swe_flush_sync._process.proc import process_stat
from swe_flush_sync._watchdog import api as watchdog_api
from swe_flush_sync._watchdog import ends as watchdog_ends
from swe_flush_sync.testing import AgentServerStub

SECRET = "s3cret-token-do-not-leak"
REPO = Path(__file__).resolve().parent.parent

_ENV_VARS = (
    "AGENT_SERVER_URL", "SWE_AGENT_URL", "HARBOR_ADMIN_SECRET", "MILES_HARBOR_AUTH_TOKEN",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "NETRC", "SWE_FLUSH_LEDGER",
)


@pytest.fixture(autouse=True, scope="session")
def sigint_as_python_starts_it() -> Iterator[None]:
    """Ctrl-C as a Python started from a terminal has it, in this process and so in every child.

    A suite started as a background job of a script (``cmd &``, ``nohup``, some CI runners) inherits
    SIGINT ignored, and an ignored signal stays ignored across ``exec``: no child would see a Ctrl-C
    test's SIGINT, and ``_thread.interrupt_main`` does nothing. A handled one is reset to the default
    at ``exec``, so with Python's own handler here every child Python installs its own again."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)


_children: list[subprocess.Popen[str]] = []


def spawn(args: list[str], **kwargs: object) -> subprocess.Popen[str]:
    """``subprocess.Popen(args, text=True, **kwargs)``, reaped after the test whatever happens."""
    proc: subprocess.Popen[str] = subprocess.Popen(args, text=True, **kwargs)  # type: ignore[call-overload]
    _children.append(proc)
    return proc


def read_until(proc: subprocess.Popen[str], wanted: Callable[[str], bool], seen: list[str],
               timeout: float = 20) -> str | None:
    """The first stdout line of ``proc`` (stripped) that is ``wanted``; every line read goes to ``seen``.
    None when the child's stdout ends or ``timeout`` passes first."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.strip())
        if wanted(line.strip()):
            return line.strip()
    return None


@pytest.fixture(autouse=True)
def reap_children() -> Iterator[None]:
    """No child outlives its test (a failed assertion included): killed if still running, waited for,
    its pipes closed, so no ``ResourceWarning: subprocess ... is still running`` lands in a later test."""
    yield
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a grandchild still holds its pipes: closed on our side
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()


_watchdog_pids: list[int] = []


@pytest.fixture(autouse=True)
def end_watchdogs(reap_children: None) -> Iterator[None]:
    """Every watchdog a test armed is gone after it: killed by its pid if it still runs, before its
    trainer is reaped (a watchdog that outlived its trainer holds the trainer's stderr while it flushes).
    A watchdog left armed in this process fails its test: the next test's abort would re-arm it. What
    a watchdog said and no abort logged yet is forgotten (the next test's abort would log it)."""
    yield
    watchdog_ends.unsaid.clear()
    left = list(watchdog_api._watchdogs)
    for dog in left:
        _watchdog_pids.append(dog.pid)
        dog.disarm()
    while _watchdog_pids:
        pid = _watchdog_pids.pop()
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the test left {len(left)} watchdog(s) armed in this process"


NOTHING_MORE_WINDOW = 1.0  # seconds a negative check watches for what must not happen


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Wait until ``condition()`` holds; False if it does not within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def stays(condition: Callable[[], bool], window: float = NOTHING_MORE_WINDOW) -> bool:
    """True when ``condition()`` holds all through ``window`` seconds (polled every few ms): a check
    that something does not happen watches for it over a stated window, not after a fixed sleep."""
    end = time.monotonic() + window
    while time.monotonic() < end:
        if not condition():
            return False
        time.sleep(0.005)
    return condition()


# The kernel function a main thread waits in, for each blocking call the tests' children make.
# (Python 3.10 sleeps in select(): poll_schedule_timeout; 3.11 and later in clock_nanosleep.)
BLOCKED_IN = {"sleep": ("hrtimer_nanosleep", "poll_schedule_timeout", "do_select"),
              "read": ("anon_pipe_read", "pipe_read")}


def blocked_in(pid: int, call: str = "sleep", timeout: float = 5.0) -> bool:
    """Wait until the main thread of ``pid`` is blocked in ``call`` (``time.sleep``, or a read from a
    pipe), as seen in ``/proc/PID/wchan``; False if it is not within ``timeout`` (or /proc hides it).

    A test that signals a child "while it sleeps" waits for this first. CPython runs a Python
    handler at its next check, and a C call that blocks after the C-level handler ran is not
    interrupted: a signal landing between the child's READY and its ``sleep`` waits for the
    sleep to end (on 3.14 and 3.15 under load, about half the runs of such a test).
    """
    wchan = Path(f"/proc/{pid}/wchan")

    def blocked() -> bool:
        try:
            return wchan.read_text().startswith(BLOCKED_IN[call])  # (a suffix: .constprop.0)
        except OSError:
            return False

    return wait_until(blocked, timeout)


def proc_stat(pid: int) -> list[bytes]:
    """``/proc/PID/stat``'s fields from the third on (0: the state, 1: the parent, 2: the group,
    3: the session, 11/12: user/system ticks, 19: the start time), read by the package's own parser."""
    fields = process_stat(pid)
    if fields is None:
        raise FileNotFoundError(f"/proc/{pid}/stat")
    return fields


def proc_status(pid: int, key: str) -> int:
    """One number of ``/proc/PID/status`` (``Threads``, ``VmRSS``, ``VmHWM``: KiB)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith(key + ":")))


def gone(pid: int) -> bool:
    """True when ``pid`` has exited (no such process, or a zombie not yet reaped by init)."""
    fields = process_stat(pid)
    return fields is None or fields[0] == b"Z"


@pytest.fixture(autouse=True)
def close_abort_cache() -> Iterator[None]:
    """abort() keeps warm Flushers (with idle worker threads) by design; start each test without."""
    yield
    _close_cached_flushers()


@pytest.fixture
def stub() -> Iterator[AgentServerStub]:
    with AgentServerStub(secret=SECRET) as server:
        yield server


@pytest.fixture
def stub_factory() -> Iterator:
    started: list[AgentServerStub] = []

    def make(**kwargs: object) -> AgentServerStub:
        server = AgentServerStub(**kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


_earlier: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def earlier_threads() -> None:
    """The library threads alive before this test, which ``ours()`` leaves out: an earlier test in this
    process (pytest-xdist runs files in any order) may keep some (an in-process guard's pools)."""
    _earlier.clear()
    _earlier.update(t for t in threading.enumerate() if t.name.startswith("swe-flush"))


def ours(threads: list[threading.Thread] | None = None) -> list[threading.Thread]:
    """Threads the library started in this test (its workers are named swe-flush*)."""
    return [t for t in (threads or threading.enumerate())
            if t.name.startswith("swe-flush") and t.is_alive() and t not in _earlier]


def wait_no_library_threads(timeout: float = 2.0) -> list[threading.Thread]:
    """Poll until no library thread is alive; return the ones still alive at the timeout."""
    return wait_threads_gone(ours, timeout)


def wait_threads_gone(which: Callable[[], list[threading.Thread]], timeout: float) -> list[threading.Thread]:
    """Poll ``which()`` until it is empty or ``timeout`` passes; return what is left."""
    end = time.monotonic() + timeout
    while which() and time.monotonic() < end:
        time.sleep(0.01)
    return which()


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports the package from this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in _ENV_VARS}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


PYTHON = sys.executable


@dataclass
class GuardProcess:
    proc: subprocess.Popen[str]
    socket: str
    lines: list[str]

    def stderr(self) -> str:
        """Its stderr, once it has ended."""
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


@pytest.fixture
def arm_in_process() -> Iterator[Callable[..., Watchdog]]:
    """``watchdog(args, **options)`` in this process; each one armed is disarmed after the test (this
    process's end would trigger it) and ended by its pid if it still runs."""
    dogs: list[Watchdog] = []

    def arm(args: object, **options: object) -> Watchdog:
        dog = watchdog(args, **options)  # type: ignore[arg-type]
        dogs.append(dog)
        _watchdog_pids.append(dog.pid)
        return dog

    yield arm
    for dog in dogs:
        dog.disarm()
        _watchdog_pids.append(dog.pid)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (a socket path is at most 107 bytes; pytest's tmp_path can be longer)."""
    folder = Path(tempfile.mkdtemp(prefix="sfg-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


StartGuard = Callable[..., GuardProcess]  # start_guard(*options, path=None, **env): a guard running


@pytest.fixture
def start_guard(short_dir: Path) -> StartGuard:
    def start(*extra: str, path: str | None = None, **env: str) -> GuardProcess:
        socket_path = path or str(short_dir / "run" / "guard.sock")
        proc = spawn([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", socket_path, *extra],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(**env),
                     start_new_session=True)
        lines: list[str] = []
        if read_until(proc, lambda line: line.startswith("guarding "), lines) is None:
            proc.kill()
            raise AssertionError(f"the guard never said it was guarding: {lines} {proc.communicate()[1]}")
        return GuardProcess(proc, socket_path, lines)

    return start


class HungServer:
    """Accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        for held in [*self.held, self.sock]:
            held.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer()
    yield server
    server.close()
