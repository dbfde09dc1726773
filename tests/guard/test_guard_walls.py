"""The guard where it is deployed (issue 34): no bearer to an impostor, no peer can stop it, and no
flush lost to a restart, a full fd table, a slow disk, a server blip or a version skew.

One test per case of the issue, over real processes and real sockets: guards, trainers, impostors
of another uid, containers (``unshare``) and tracers are each ended by their pid after the test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from swe_flush_sync import recover
from swe_flush_sync._guard.daemon import guard_status
from swe_flush_sync.testing import AgentServerStub

from ..conftest import (
    PYTHON,
    SECRET,
    GuardProcess,
    StartGuard,
    gone,
    proc_stat,
    proc_status,
    read_until,
    spawn,
    subprocess_env,
    wait_until,
)
from ..helpers import (
    ENV,
    IDS,
    OTHER_UID,
    Trainer,
    a_state,
    answer,
    connect,
    guarded_trainer,
    impostor,
    namespace_init,
    needs_root,
    needs_unshare,
    port_held,
    read_records,
    records,
    state_line,
)


def exchange(path: str, line: bytes) -> bytes:
    """Connect, send ``line`` (the guard may close before it has all of it), return ``answer``."""
    with connect(path) as peer:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            peer.sendall(line)
        return answer(peer)


def guard_pid_lines(guard: GuardProcess) -> str:
    guard.proc.send_signal(signal.SIGTERM)
    assert guard.proc.wait(15) == 0
    return guard.stderr()


def open_folder(short_dir: Path) -> Path:
    """A folder another user may write (mode 0777, no sticky bit), on a path it can reach."""
    short_dir.chmod(0o755)
    folder = short_dir / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    return folder


@needs_root
def test_arming_against_a_socket_of_another_uid_sends_nothing(stub: AgentServerStub, short_dir: Path) -> None:
    path = str(open_folder(short_dir) / "guard.sock")
    listener = impostor(path)
    trainer = Trainer(stub, f"""
        from swe_flush_sync import FlushError
        try:
            watchdog(args, guard={path!r}, until_idle=False)
        except FlushError as exc:
            print("RAISED", exc, flush=True)
    """)
    words = " ".join(trainer.read("RAISED"))
    assert path in words and f"uid {OTHER_UID}" in words and "nothing was sent" in words
    assert read_until(listener, lambda line: line.startswith("CLOSED"), []) == "CLOSED 0"  # not one byte
    assert SECRET not in words


@needs_root
def test_a_path_taken_while_the_guard_restarts_gets_nothing(stub: AgentServerStub, short_dir: Path,
                                                              start_guard: StartGuard) -> None:
    folder = open_folder(short_dir)
    path = str(folder / "guard.sock")
    guard = start_guard(path=path)
    assert folder.stat().st_mode & 0o1000  # made sticky (see below) ...
    folder.chmod(0o777)  # a folder the guard could not make sticky (see the test below): others may replace it
    trainer = Trainer(stub, stdin=True, body=f"""
        import logging
        logging.basicConfig(level=logging.WARNING)
        dog = watchdog(args, guard={path!r}, until_idle=False)
        print("ARMED", dog.pid, flush=True)
        sys.stdin.readline()
        abort(args, until_idle=False, deadline=2)  # says what the follower thread met
        print("STEPPED", dog.armed, flush=True)
        time.sleep(60)
    """)
    trainer.read("ARMED")
    guard.proc.kill()
    guard.proc.wait()
    listener = impostor(path)  # another uid takes the path before the sidecar is back
    closed = read_until(listener, lambda line: line.startswith("CLOSED"), [])
    assert closed == "CLOSED 0"  # the trainer's follower connected, checked, and sent nothing
    trainer.go_on()
    assert trainer.read("STEPPED")[1] == "False"
    trainer.proc.kill()
    trainer.death()
    assert trainer.proc.stderr is not None
    err = trainer.proc.stderr.read()
    assert err.count(f"served by uid {OTHER_UID}") == 1 and SECRET not in err



@needs_root
def test_a_root_guard_makes_an_open_folder_sticky(short_dir: Path, start_guard: StartGuard) -> None:
    """1.1 only warned: in a 0777 emptyDir another uid could rename the guard's files away (issue 54)."""
    folder = open_folder(short_dir)
    guard = start_guard(path=str(folder / "guard.sock"))
    assert oct(folder.stat().st_mode & 0o7777) == "0o1777"  # set before it listens
    tried = subprocess.run([PYTHON, "-c", f"import os; os.setgid({OTHER_UID}); os.setuid({OTHER_UID})\n"
                            f"for name in {sorted(os.listdir(folder))!r}:\n"
                            "    try:\n"
                            f"        os.rename({str(folder)!r} + '/' + name, {str(folder)!r} + '/moved-' + name)\n"
                            "        print('MOVED', name)\n"
                            "    except PermissionError:\n"
                            "        print('REFUSED', name)\n"], capture_output=True, text=True, timeout=30, cwd="/")
    assert tried.stdout.split() == [word for name in sorted(os.listdir(folder)) for word in ("REFUSED", name)], tried
    assert guard_status(guard.socket) is not None
    assert f"set the sticky bit on {folder} (mode 1777 now)" in guard_pid_lines(guard)


@needs_root
def test_a_guard_that_cannot_make_its_open_folder_sticky_says_what_to_change(short_dir: Path) -> None:
    folder = open_folder(short_dir)  # root's, 0777: a guard of uid 4242 may use it, not chmod it
    command = [PYTHON, "-c", "import os, sys; from swe_flush_sync._cli.main import main; "  # imports first:
               f"os.setgid({OTHER_UID}); os.setuid({OTHER_UID}); "  # /root is not readable after this
               "sys.exit(main(sys.argv[1:]))", "guard", "--socket", str(folder / "g.sock")]
    guard = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), cwd="/")
    try:
        assert read_until(guard, lambda line: line.startswith("guarding "), []) is not None
    finally:
        guard.send_signal(signal.SIGTERM)  # (its lines are written by a thread of its own: a stop waits for them)
        err = guard.communicate(timeout=15)[1]
    assert f"run `chmod +t {folder}` as its owner" in err and "cannot set it" in err, err
    assert oct(folder.stat().st_mode & 0o7777) == "0o777"


@needs_root
def test_a_folder_of_another_uid_is_refused(short_dir: Path) -> None:
    short_dir.chmod(0o755)
    folder = short_dir / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    out = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", str(folder / "g.sock")],
                         capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"owned by uid {OTHER_UID}" in out.stderr and "Traceback" not in out.stderr


@needs_root
def test_a_non_root_guard_that_cannot_remove_a_stale_socket_says_so(short_dir: Path) -> None:
    short_dir.chmod(0o755)
    folder = short_dir / "tmp"
    folder.mkdir()
    folder.chmod(0o1777)  # like /tmp: the sticky bit keeps others from removing root's files
    path = str(folder / "g.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a root guard died and left its socket
    out = subprocess.run([PYTHON, "-c", "import os, sys; from swe_flush_sync._cli.main import main; "  # imports first:
                          f"os.setgid({OTHER_UID}); os.setuid({OTHER_UID}); "  # /root is not readable after this
                          "sys.exit(main(sys.argv[1:]))",
                          "guard", "--socket", path], capture_output=True, text=True, env=subprocess_env(),
                         timeout=30)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and "cannot remove the socket" in out.stderr and "(owned by uid 0)" in out.stderr
    assert "Traceback" not in out.stderr and os.path.exists(path)


# -- 2. nothing a peer sends stops the guard -----------------------------------------------------------
def test_nested_json_and_bad_fields_end_only_their_connection(stub: AgentServerStub, short_dir: Path,
                                                                start_guard: StartGuard) -> None:
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger), "--heartbeat", "10")
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    hostile = [b"[" * 4096 + b"\n", b"[" * 2000 + b"]" * 2000 + b"\n", b'{"seq": 1, "state": ' + b"[]," * 100 + b"\n",
               state_line(a_state(urls=5)), state_line(a_state(ids=5)), state_line(a_state(ids=[1, 2])),
               state_line(a_state(tokens=[1])), state_line(a_state(options={"deadline": "soon"})),
               state_line(a_state(options=3)), state_line(a_state(trainer="../../etc/passwd"))]
    refused = [exchange(guard.socket, line) for line in hostile]
    assert not any(said.startswith(b"held") for said in refused)
    assert refused[3].startswith(b"refused ") and b"urls" in refused[3]
    assert b"deadline" in refused[7]
    # a state whose heartbeat is a string, null or 0 is held: the heartbeat is the guard's own setting
    for heartbeat in ("x", None, 0, -1):
        with connect(guard.socket) as peer:
            token = f"{len(str(heartbeat)):032x}"
            peer.sendall(state_line(a_state(heartbeat=heartbeat, urls=[stub.url], trainer=token)))
            assert answer(peer).startswith(b"held")
            peer.sendall(b'{"disarm": true}\n')
    assert guard.proc.poll() is None
    trainer.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 3, 3.0)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1)
    err = guard_pid_lines(guard)
    assert err.count("dropped the connection") == 1 and "Traceback" not in err  # one a minute at most ...
    assert f"{len(hostile) - 1} more 'dropped connection' line(s) held back" in err  # ... and the rest counted


def test_a_records_heartbeat_is_the_guards(stub: AgentServerStub, short_dir: Path,
                                           start_guard: StartGuard) -> None:
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger), "--heartbeat", "5")
    with connect(guard.socket) as peer:
        peer.sendall(state_line(a_state(heartbeat=0, urls=[stub.url])))
        assert answer(peer).startswith(b"held")
        assert wait_until(lambda: len(records(ledger)) == 1, 5.0)
        [record] = records(ledger)
        digest = hashlib.sha256(b"0" * 32).hexdigest()
        assert record.name == f"trainer-{digest}.json"  # named by the trainer's token (its digest), not a pid
        assert json.loads(record.read_text())["heartbeat_interval"] == 5.0
        first = record.stat().st_mtime_ns
        time.sleep(1.0)  # a heartbeat of 0 from the peer would have rewritten it thousands of times
        assert record.stat().st_mtime_ns == first
        peer.sendall(b'{"disarm": true}\n')


def test_option_keys_the_guard_does_not_know_are_dropped_and_the_flush_goes_on(
        stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    with connect(guard.socket) as peer:
        state = a_state(urls=[stub.url], ids=["new-a", "new-b"], tokens={"new-a": SECRET, "new-b": SECRET},
                        options={"until_idle": False, "deadline": 5, "a_newer_option": {"x": 1}, "another": 2})
        peer.sendall(state_line(state))
        assert answer(peer).startswith(b"held")
    assert wait_until(lambda: len(stub.requests) >= 2, 5.0)  # the peer is gone: flushed without them
    assert sorted(stub.flushed_ids()) == ["new-a", "new-b"] and all(r.status == 200 for r in stub.requests)
    err = guard_pid_lines(guard)
    assert err.count("does not know") == 1 and "a_newer_option, another" in err


def test_a_trainer_older_than_its_guard_is_still_served(stub: AgentServerStub,
                                                         start_guard: StartGuard) -> None:
    guard = start_guard()
    old_state = {"urls": [stub.url], "ids": ["old-a"], "tokens": {"old-a": SECRET}, "heartbeat": 10.0,
                 "options": {"until_idle": False}, "sys_path": [], "ledger": None}  # as 0.5.0 sent it
    with connect(guard.socket) as peer:
        peer.sendall(b'{"seq": 1, "state": %s}\n' % json.dumps(old_state).encode())
        assert answer(peer).split() == [b"held", b"1", str(guard.proc.pid).encode()]  # the words 0.5.0 reads
    assert wait_until(lambda: stub.flushed_ids() == ["old-a"], 5.0)
    assert stub.requests[0].status == 200


OLD_GUARD = textwrap.dedent("""
    import os, socket, sys
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[1])
    listener.listen(8)
    print("LISTENING", flush=True)
    conn, _ = listener.accept()
    got = b""
    while not got.endswith(b"\\n"):
        got += conn.recv(65536)
    conn.sendall(b"held 1 %d\\n" % os.getpid())  # protocol 1 (0.5.0): no version
    more = b""
    conn.settimeout(5)
    try:
        while chunk := conn.recv(65536):
            more += chunk
    except OSError:
        pass
    print("THEN", more.decode().strip(), flush=True)
""")


def test_a_trainer_newer_than_its_guard_is_told_at_arming(stub: AgentServerStub, short_dir: Path) -> None:
    path = str(short_dir / "old.sock")
    old = spawn([PYTHON, "-c", OLD_GUARD, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert read_until(old, lambda line: line == "LISTENING", []) is not None
    trainer = Trainer(stub, f"""
        try:
            watchdog(args, guard={path!r}, until_idle=False)
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc, flush=True)
    """)
    words = " ".join(trainer.read("RAISED"))
    assert "FlushError" in words and "speaks protocol 1" in words and "upgrade" in words
    then = read_until(old, lambda line: line.startswith("THEN"), [])
    assert then is not None and '{"disarm": true}' in then  # it must not flush the trainer later


# -- 3. records per trainer; restarts never cancel a live trainer --------------------------------------
@needs_unshare
def test_trainers_in_sibling_pid_namespaces_each_keep_a_record(stub: AgentServerStub, short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    path = str(short_dir / "guard.sock")
    guard = spawn(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", PYTHON, "-m", "swe_flush_sync",
                   "guard", "--socket", path, "--ledger", str(ledger), "--heartbeat", "0.5"],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), start_new_session=True)
    guard_init = namespace_init(guard)
    assert read_until(guard, lambda line: line.startswith("guarding"), []) is not None
    trainers = []
    for index in range(2):
        unshare = Trainer(stub, f"""
            args = argparse.Namespace(session_server_instance_ids={{1: "sib{index}-a", 2: "sib{index}-b"}})
            dog = watchdog(args, guard={path!r}, until_idle=False)
            print("ARMED", flush=True)
            time.sleep(60)
        """, contained=True).proc
        trainers.append((unshare, namespace_init(unshare)))
        assert unshare.stdout is not None and unshare.stdout.readline().startswith("ARMED")
    assert wait_until(lambda: len(records(ledger)) == 2, 5.0)  # the guard sees both as pid 0: one record each
    assert sorted(json.loads(r.read_text())["pid"] for r in records(ledger)) == [0, 0]
    os.kill(guard_init, signal.SIGKILL)  # the pod is lost: guard and trainers together
    for _, init in trainers:
        os.kill(init, signal.SIGKILL)
    guard.wait(10)
    for unshare, _ in trainers:
        unshare.wait(10)
    assert stub.requests == []
    # Their guard's pids mean nothing here: the heartbeat (0.5 s, stale after three) decides.
    assert wait_until(lambda: len(recover(str(ledger), servers=stub.url, environ=ENV, until_idle=False).results)
                      == 4 or len(stub.requests) >= 4, 10.0)
    assert Counter(stub.flushed_ids()) == {f"sib{i}-{s}": 1 for i in range(2) for s in "ab"}
    assert records(ledger) == []


def test_a_guard_restart_takes_over_live_trainers_and_flushes_the_dead(stub: AgentServerStub, short_dir: Path,
                                                                       start_guard: StartGuard) -> None:
    ledger = short_dir / "ledger"
    env = {"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": SECRET}
    grace = 1.0  # (5 s by default)
    first = start_guard("--ledger", str(ledger), "--heartbeat", "1", "--takeover-grace", str(grace), **env)
    alive = Trainer(stub, f"""
        args = argparse.Namespace(session_server_instance_ids={{1: "long-a", 2: "long-b"}})
        dog = watchdog(args, guard={first.socket!r}, until_idle=False)
        print("ARMED", flush=True)
        time.sleep(120)  # one long rollout step: no refresh, no abort
    """)
    dying = Trainer(stub, f"""
        args = argparse.Namespace(session_server_instance_ids={{1: "dies-a", 2: "dies-b"}})
        dog = watchdog(args, guard={first.socket!r}, until_idle=False)
        print("ARMED", flush=True)
        time.sleep(120)
    """)
    alive.read("ARMED")
    dying.read("ARMED")
    assert wait_until(lambda: len(records(ledger)) == 2, 5.0)
    first.proc.kill()  # the sidecar restarts ...
    first.proc.wait()
    dying.proc.kill()  # ... and a trainer dies meanwhile
    dying.death()
    second = start_guard("--ledger", str(ledger), "--heartbeat", "1", "--takeover-grace", str(grace),
                         path=first.socket, **env)
    restarted = time.monotonic()

    def kept_by_second() -> bool:
        return any(record.get("watchdog_pid") == second.proc.pid and record.get("ids") == ["long-a", "long-b"]
                   for record in read_records(ledger))

    assert wait_until(kept_by_second, 15.0)  # the live trainer reconnected: its record taken over
    assert wait_until(lambda: sorted(stub.flushed_ids()) == ["dies-a", "dies-b"], grace + 1.0 + 2.0)
    assert time.monotonic() - restarted < grace + 1.0 + 2.0  # within the grace and a second (and a margin)
    # Past the grace and three heartbeats of the old record: the live trainer is never flushed.
    time.sleep(max(grace + 3 * 1.0 + 2.0 - (time.monotonic() - restarted), 0))
    assert sorted(stub.flushed_ids()) == ["dies-a", "dies-b"] and alive.proc.poll() is None
    alive.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 4, 3.0)
    assert Counter(stub.flushed_ids()) == {"dies-a": 1, "dies-b": 1, "long-a": 1, "long-b": 1}


# -- 4. a flush that failed is retried -----------------------------------------------------------------
def test_a_server_down_at_the_death_is_flushed_once_it_is_back(short_dir: Path,
                                                                 start_guard: StartGuard) -> None:
    first = AgentServerStub(secret=SECRET).start()
    port = int(first.url.rsplit(":", 1)[1])
    ledger = short_dir / "ledger"
    guard = start_guard("--ledger", str(ledger))
    trainer = guarded_trainer(first, guard)
    trainer.read("ARMED")
    first.stop()  # the agent server is down ...

    def marked_gone() -> bool:
        return any(record.get("gone") is True for record in read_records(ledger))

    with port_held(port):
        trainer.proc.kill()  # ... when the trainer dies
        trainer.death()
        assert wait_until(marked_gone, 15.0)  # any recover may take it meanwhile
        time.sleep(4.0)  # the server stays down for 4 s
    with AgentServerStub(secret=SECRET, port=port) as back:
        assert wait_until(lambda: len(back.requests) >= 3, 20.0)
        assert Counter(back.flushed_ids()) == dict.fromkeys(IDS, 1) and all(r.status == 200 for r in back.requests)
        assert wait_until(lambda: records(ledger) == [], 5.0)
    err = guard_pid_lines(guard)
    assert "retrying" in err and "flushed 3/3" in err


# -- 5, 6, 7. descriptors, memory, a slow disk -----------------------------------------------------------
IDLE_PEERS = textwrap.dedent("""
    import resource, socket, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, max(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
    peers = []
    for _ in range(int(sys.argv[2])):
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(sys.argv[1])  # blocking: waits for room in the guard's backlog
        peers.append(peer)
    print("OPEN", len(peers), flush=True)
    sys.stdin.readline()
""")


def test_a_full_fd_table_loses_no_flush(stub: AgentServerStub, short_dir: Path) -> None:
    path = str(short_dir / "guard.sock")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
    guard_proc = spawn([PYTHON, "-c", limit + "import sys; from swe_flush_sync._cli.main import main; "
                        "sys.exit(main(sys.argv[1:]))", "guard", "--socket", path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=subprocess_env(), start_new_session=True)
    assert read_until(guard_proc, lambda line: line.startswith("guarding"), []) is not None
    guard = GuardProcess(guard_proc, path, [])
    before = guarded_trainer(stub, guard)
    before.read("ARMED")
    flood = spawn([PYTHON, "-c", IDLE_PEERS, path, "1100"], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                  env=subprocess_env())
    opened = read_until(flood, lambda line: line.startswith("OPEN"), [], timeout=60)
    assert opened is not None and int(opened.split()[1]) >= 1000
    cpu = _cpu_seconds(guard_proc.pid)
    time.sleep(1.0)
    assert _cpu_seconds(guard_proc.pid) - cpu < 0.3  # not spinning on a listener it cannot serve
    before.proc.kill()
    assert wait_until(lambda: len(stub.requests) >= 3, 5.0)
    assert Counter(stub.flushed_ids()) == dict.fromkeys(IDS, 1) and all(r.status == 200 for r in stub.requests)
    after = Trainer(stub, f"""
        args = argparse.Namespace(session_server_instance_ids={{1: "after-a"}})
        dog = watchdog(args, guard={path!r}, until_idle=False)
        print("ARMED", dog.armed, flush=True)
        time.sleep(60)
    """)
    assert after.read("ARMED")[1] == "True"  # a new trainer still arms
    after.proc.kill()
    assert wait_until(lambda: "after-a" in stub.flushed_ids(), 5.0)
    assert flood.stdin is not None
    flood.stdin.write("\n")
    flood.stdin.flush()
    assert guard_proc.poll() is None


def test_a_guard_at_its_peer_limit_still_answers_its_status(short_dir: Path) -> None:
    """Every peer holds a trainer (the limit is 16 here): 1.2.0 closed every new connection, and a liveness
    probe (``swe-flush guard --status``) heard "no guard answers" from a full, healthy guard."""
    path = str(short_dir / "guard.sock")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (272, 272)); "  # 272 - 256 reserved
    guard_proc = spawn([PYTHON, "-c", limit + "import sys; from swe_flush_sync._cli.main import main; "
                        "sys.exit(main(sys.argv[1:]))", "guard", "--socket", path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=subprocess_env(), start_new_session=True)
    assert read_until(guard_proc, lambda line: line.startswith("guarding"), []) is not None
    peers = []
    try:
        for n in range(16):
            peer = connect(path)
            peer.sendall(state_line(a_state(trainer=f"{n:032x}", ids=[f"full-{n}"])))
            assert answer(peer).startswith(b"held"), n
            peers.append(peer)
        for _ in range(3):  # the status slots are given back as each probe ends
            status = guard_status(path)
            assert status is not None and status.trainers == 16, status
        late = connect(path)  # a trainer past the limit: closed unanswered, as before
        late.sendall(state_line(a_state(trainer="f" * 32, ids=["late"])))
        assert answer(late) == b""
        late.close()
    finally:
        for peer in peers:
            peer.close()
        guard_proc.kill()
        guard_proc.communicate(timeout=10)


def _cpu_seconds(pid: int) -> float:
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mib(pid: int) -> float:
    return proc_status(pid, "VmHWM") / 1024


def test_long_lines_from_many_peers_are_bounded(stub: AgentServerStub, start_guard: StartGuard) -> None:
    guard = start_guard()
    trainer = guarded_trainer(stub, guard)
    trainer.read("ARMED")
    chunk = b"x" * (1 << 20)
    peers = [connect(guard.socket) for _ in range(8)]

    def send(peer: socket.socket) -> None:
        try:
            for _ in range(24):  # 24 MiB each, never ended: 192 MiB in all, over the 128 MiB bound
                peer.sendall(chunk)
        except OSError:
            pass  # dropped by the guard

    senders = [threading.Thread(target=send, args=(peer,)) for peer in peers]
    for sender in senders:
        sender.start()
    trainer.proc.kill()
    died = trainer.death()
    assert wait_until(lambda: len(stub.requests) >= 3, 5.0)
    assert max(request.at for request in stub.requests) - died < 2.0
    for sender in senders:
        sender.join(30)
    assert _peak_rss_mib(guard.proc.pid) < 450  # 0.5.0: 3.2 GiB for 50 such peers
    for peer in peers:
        peer.close()
    err = guard_pid_lines(guard)
    assert "unfinished lines may hold" in err


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_a_slow_ledger_delays_no_other_flush(stub: AgentServerStub, short_dir: Path) -> None:
    ledger = short_dir / "ledger"
    path = str(short_dir / "guard.sock")
    traced = spawn(["strace", "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "-e", "trace=fsync",
                    "-e", "inject=fsync:delay_enter=2000000", PYTHON, "-m", "swe_flush_sync", "guard", "--socket",
                    path, "--ledger", str(ledger)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   env=subprocess_env(), start_new_session=True)
    line = read_until(traced, lambda text: text.startswith("guarding"), [])
    assert line is not None
    guard_pid = int(line.rsplit(" ", 1)[1].rstrip(")"))
    try:
        guard = GuardProcess(traced, path, [])
        slow = guarded_trainer(stub, guard)  # its record's fsyncs take 2 s each
        slow.read("ARMED")
        other = Trainer(stub, f"""
            args = argparse.Namespace(session_server_instance_ids={{1: "other-a"}})
            started = time.monotonic()
            dog = watchdog(args, guard={path!r}, until_idle=False)
            print("ARMED", round(time.monotonic() - started, 2), flush=True)
            time.sleep(60)
        """)
        assert float(other.read("ARMED")[1]) < 1.0  # its hand-over waits for no disk (for its record 0.25 s at most)
        other.proc.kill()
        died = other.death()
        assert wait_until(lambda: "other-a" in stub.flushed_ids(), 5.0)
        assert stub.requests[0].at - died < 0.5
    finally:
        if not gone(guard_pid):
            os.kill(guard_pid, signal.SIGKILL)  # the tracee first: a killed tracer would let it run on


# -- 8. exactly one guard per path ---------------------------------------------------------------------
RACE = textwrap.dedent("""
    import os, socket, sys
    from swe_flush_sync._guard.daemon import Guard, GuardError
    path = sys.argv[1]
    served = []
    for round_ in range(int(sys.argv[2])):
        stale = socket.socket(socket.AF_UNIX)
        if os.path.exists(path):
            os.unlink(path)
        stale.bind(path)
        stale.close()  # a guard died and left its socket
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        kids = []
        for _ in range(2):
            result_r, result_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.read(go_r, 1)
                try:
                    guard = Guard(path)
                    guard.bind()
                    os.write(result_w, b"1")
                except GuardError:
                    os.write(result_w, b"0")
                os.read(done_r, 1)  # the winner holds the path until both have tried
                os._exit(0)
            kids.append((pid, result_r))
        os.write(go_w, b"xx")
        wins = sum(os.read(result_r, 1) == b"1" for _, result_r in kids)
        os.write(done_w, b"xx")
        for pid, _ in kids:
            os.waitpid(pid, 0)
        served.append(wins)
    print("SERVED", *served, flush=True)
""")


def test_two_guards_raced_over_a_stale_socket_exactly_one_serves(short_dir: Path) -> None:
    out = subprocess.run([PYTHON, "-c", RACE, str(short_dir / "race.sock"), "40"], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    served = out.stdout.split()[1:]
    assert len(served) == 40 and set(served) == {"1"}, out.stdout


def test_a_guard_removes_only_its_own_socket(start_guard: StartGuard) -> None:
    guard = start_guard()
    os.unlink(guard.socket)  # someone put another socket at the path
    other = socket.socket(socket.AF_UNIX)
    other.bind(guard.socket)
    try:
        guard.proc.send_signal(signal.SIGTERM)
        assert guard.proc.wait(10) == 0
        assert os.path.exists(guard.socket)  # not ours any more: left alone
    finally:
        other.close()


def test_a_busy_guard_keeps_its_path(start_guard: StartGuard) -> None:
    guard = start_guard()
    os.kill(guard.proc.pid, signal.SIGSTOP)  # it answers no status probe now
    try:
        second = subprocess.run([PYTHON, "-m", "swe_flush_sync", "guard", "--socket", guard.socket],
                                capture_output=True, text=True, env=subprocess_env(), timeout=30)
        assert second.returncode == 2 and "already serving" in second.stderr
    finally:
        os.kill(guard.proc.pid, signal.SIGCONT)
    assert os.path.exists(guard.socket)


# -- the local watchdog's regression -------------------------------------------------------------------
def test_a_stopped_local_watchdog_costs_abort_no_waiting(stub: AgentServerStub) -> None:
    trainer = Trainer(stub, stdin=True, body="""
        dog = watchdog(args, until_idle=False)
        armed(dog)
        sys.stdin.readline()
        started = time.monotonic()
        for step in range(10):
            args.session_server_instance_ids = {1: f"stopped-{step}"}
            abort(args, until_idle=False, deadline=5)
        print("STEPS", round(time.monotonic() - started, 3), flush=True)
        time.sleep(60)
    """)
    pid = trainer.armed()
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: _state(pid) == "T", 2.0)
    trainer.go_on()
    assert float(trainer.read("STEPS")[1]) < 0.1 * 10  # 0.4.0: ~1 ms a step; 0.5.0: 0.5 s a step
    os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str:
    return proc_stat(pid)[0].decode()

