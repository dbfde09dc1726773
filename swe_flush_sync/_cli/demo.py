"""``swe-flush demo`` and ``swe-flush stub``: the commands that run the embedded stub agent server,
loaded only for them."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time

from .._core.errors import ConfigError, FlushError
from .._core.text import shown
from .._hooks import abort
from .._stub import AgentServerStub
from .command import EXIT_FAILED, EXIT_OK, Command, Parser, print_report


def demo_parser() -> Parser:
    parser = Parser(prog="swe-flush demo", allow_abbrev=False,
                     description="Start a stub agent server with in-flight trials and flush them all.")
    parser.add_argument("--instances", type=int, default=8, metavar="N", help="session-server instances (default 8)")
    parser.add_argument("--teardown", type=float, default=0.5, metavar="S",
                        help="seconds each flush waits for its trials' teardown (default 0.5)")
    _add_max_concurrent(parser)
    _add_until_idle(parser)
    parser.add_argument("--watchdog", action="store_true",
                        help="instead: a trainer process arms a watchdog and is killed with SIGKILL; "
                             "show what the watchdog flushed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def _add_until_idle(parser: Parser) -> None:
    parser.add_argument("--until-idle", action="store_true",
                        help="flush each server again while its last round cancelled something (runs "
                             "waiting for a slot start when one is freed)")


def _add_max_concurrent(parser: Parser) -> None:
    parser.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                        help="stub server: trials running at once; more runs wait for a slot (default: no limit)")


def stub_parser() -> Parser:
    parser = Parser(prog="swe-flush stub", allow_abbrev=False,
                     description="Serve the stub agent server in the foreground until Ctrl-C; "
                                 "its first line of output is its URL.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default 0: a free one)")
    parser.add_argument("--teardown", type=float, default=0.0, metavar="S",
                        help="seconds each flush waits for its trials' teardown (default 0)")
    _add_max_concurrent(parser)
    parser.add_argument("--secret-env", metavar="VAR",
                        help="require the bearer secret held by this environment variable")
    return parser


def run_stub(ns: argparse.Namespace) -> int:
    secret = None
    if ns.secret_env:
        secret = os.environ.get(ns.secret_env)
        if not secret:
            raise ConfigError(f"--secret-env: {shown(ns.secret_env, 60)} is not set")
    if ns.teardown < 0 or not 0 <= ns.port <= 65535:
        raise ConfigError("--teardown must be >= 0 and --port from 0 to 65535")
    _check_max_concurrent(ns.max_concurrent)
    try:
        stub = AgentServerStub(secret=secret, teardown=ns.teardown, host=ns.host, port=ns.port,
                               max_concurrent=ns.max_concurrent).start()
    except OSError as exc:
        raise ConfigError(f"cannot serve on {shown(ns.host, 60)}:{ns.port}: {exc.strerror or exc}") from None
    print(stub.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        stub.stop()


def _check_max_concurrent(value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError("--max-concurrent must be >= 1")


def run_demo(ns: argparse.Namespace) -> int:
    if ns.instances < 1 or ns.teardown < 0:
        raise ConfigError("--instances must be >= 1 and --teardown >= 0")
    _check_max_concurrent(ns.max_concurrent)
    if ns.watchdog:
        return _run_watchdog_demo(ns)
    secret = secrets.token_urlsafe(16)
    ids = [f"demo-instance-{index}" for index in range(ns.instances)]
    with AgentServerStub(secret=secret, teardown=ns.teardown, max_concurrent=ns.max_concurrent) as stub:
        for index, instance_id in enumerate(ids):
            stub.add_trials(instance_id, 2 + index % 3)
        # Trainer args as the framework fills them: a port -> id map plus the singular id.
        args = argparse.Namespace(
            session_server_instance_ids={8000 + index: instance_id for index, instance_id in enumerate(ids)},
            session_server_instance_id=ids[0],
        )
        report = abort(args, environ={"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": secret},
                       until_idle=ns.until_idle)
        left = sum(stub.trials(instance_id) for instance_id in ids) + stub.waiting()
    one_by_one = sum(result.elapsed for result in report.results)
    if ns.json:
        print(json.dumps({**report.to_dict(), "one_by_one_seconds": one_by_one, "trials_left": left}, indent=2))
    else:
        slots = "" if ns.max_concurrent is None else f" ({ns.max_concurrent} run at once, the rest wait for a slot)"
        print(f"swe-flush demo: {len(ids)} session-server instances, {report.cancelled} trials cancelled{slots}, "
              f"{ns.teardown:g}s teardown each, on a stub agent server at {stub.url}\n")
        print_report(report, False)
        print(f"\nwall time: {report.elapsed:.2f}s in parallel; one by one it would have taken "
              f"{one_by_one:.2f}s (the sum of each flush's own time), {one_by_one / max(report.elapsed, 1e-9):.1f}x "
              f"longer. Trials left running or waiting: {left}.")
        if left and report.ok and not ns.until_idle:
            print("(runs that waited for a slot took the slots the flush freed: one pass leaves them running; "
                  "--until-idle flushes again until a round cancels nothing. Exit status 1.)")
    return EXIT_OK if report.ok and left == 0 else EXIT_FAILED


_DEMO_TRAINER = """
import sys
from swe_flush_sync import watchdog
ids = sys.argv[1:]
dog = watchdog({"session_server_instance_ids": ids}, deadline=10)
print(dog.pid, flush=True)
sys.stdin.read()  # a trainer at work, until it is killed
"""


def _run_watchdog_demo(ns: argparse.Namespace) -> int:
    """A trainer process arms a watchdog, is killed with SIGKILL; the watchdog flushes its trials."""
    secret = secrets.token_urlsafe(16)
    ids = [f"demo-instance-{index}" for index in range(ns.instances)]
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with AgentServerStub(secret=secret, teardown=ns.teardown, max_concurrent=ns.max_concurrent) as stub:
        for index, instance_id in enumerate(ids):
            stub.add_trials(instance_id, 2 + index % 3)
        started = sum(stub.trials(instance_id) for instance_id in ids) + stub.waiting()
        env = {**os.environ, "AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": secret,
               "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
        trainer = subprocess.Popen([sys.executable, "-c", _DEMO_TRAINER, *ids], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        assert trainer.stdout is not None and trainer.stderr is not None
        watchdog_pid = trainer.stdout.readline().strip()
        if not watchdog_pid.isdigit():
            trainer.kill()
            trainer.communicate()
            raise FlushError("the demo trainer could not arm its watchdog")
        trainer.kill()  # SIGKILL: no Python runs in the trainer any more
        trainer.wait()
        killed = time.monotonic()
        said = trainer.stderr.read()  # end-of-file once the watchdog, which inherited it, has exited
        ended = time.monotonic() - killed
        trainer.stdin.close()  # type: ignore[union-attr]
        trainer.stdout.close()
        trainer.stderr.close()
        flushed = len(stub.flushed_ids())
        left = sum(stub.trials(instance_id) for instance_id in ids) + stub.waiting()
    summary = said.strip().splitlines()[-1] if said.strip() else "(the watchdog said nothing)"
    if ns.json:
        print(json.dumps({"trainer_pid": trainer.pid, "watchdog_pid": int(watchdog_pid), "watchdog_said": summary,
                          "flush_requests": flushed, "trials_started": started, "trials_left": left,
                          "watchdog_exited_after_seconds": ended}, indent=2))
    else:
        print(f"swe-flush demo --watchdog: a trainer (pid {trainer.pid}) ran {started} trials on "
              f"{len(ids)} session-server instances at {stub.url}, armed a watchdog (pid {watchdog_pid}) "
              f"and was killed with SIGKILL.\n\n{summary}\n\nThe watchdog sent {flushed} flush requests "
              f"and exited {ended:.2f}s after the kill. Trials left running or waiting: {left}.")
    return EXIT_OK if left == 0 and "trainer gone; flushed" in summary else EXIT_FAILED


COMMANDS: dict[str, Command] = {"demo": (demo_parser, run_demo), "stub": (stub_parser, run_stub)}
