"""The ``swe-flush`` command line: flush instances from a shell, ``demo``, ``stub``, ``recover``, ``guard``,
``doctor``.

Exit codes: 0 all flushed or nothing to do; 1 some target failed; 2 usage or configuration
error (one line on stderr, or one JSON object with ``--json``; no traceback); 130 interrupted
(Ctrl-C gives up the pairs in flight at once and prints the partial report). The secret is
read only from the environment or ``--secret-file``, never from a flag value (it would show in
``ps``); unknown options are named without their values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .._core.auth import StaticBearer
from .._core.errors import ConfigError, FlushError
from .._core.flusher import Flusher
from .._core.options import DEFAULT_DEADLINE
from .._core.report import FlushReport
from .._core.resolve import (
    PLURAL_ATTR,
    SINGULAR_ATTR,
    URL_ENV_VARS,
    normalize_instance_ids,
    normalize_server_urls,
    resolve_bearer,
    resolve_instance_ids,
    resolve_server_urls,
)
from .._core.text import shown
from .._guard.daemon import DEFAULT_DRAIN, DEFAULT_MAX_HELD, TAKEOVER_GRACE, guard_status, run_guard
from .._guard.metrics import parse_address
from .._process.record import DEFAULT_HEARTBEAT
from .._recover import recover
from .._version import __version__
from .._watchdog.guard_client import ImpostorError
from .command import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Command, Parser, UsageError, print_report

USAGE = """swe-flush [--url URL]... [--id ID]... [--ids-json PATH|-]
                 [--secret-file PATH] [--ca-bundle PATH]
                 [--client-cert PATH [--client-key PATH]] [--deadline S]
                 [--workers N] [--retries N] [--one-pass] [--json] [-q | -v]
       swe-flush demo [--instances N] [--teardown S] [--max-concurrent N]
                      [--until-idle] [--watchdog] [--json]
       swe-flush recover DIR [--url URL]... [--secret-file PATH]
                             [--ca-bundle PATH]
                             [--client-cert PATH [--client-key PATH]]
                             [--deadline S] [--workers N] [--retries N]
                             [--json] [-q | -v]
       swe-flush guard --socket PATH [--ledger DIR] [--drain S]
                       [--heartbeat S] [--takeover-grace S] [--max-held MIB]
                       [--metrics [HOST:]PORT] [-v]
       swe-flush guard --socket PATH --status
       swe-flush doctor [--url URL]... [--guard PATH] [--ledger DIR]
                        [--ca-bundle PATH]
                        [--client-cert PATH [--client-key PATH]] [--json]
       swe-flush stub [--host H] [--port P] [--teardown S]
                      [--max-concurrent N] [--secret-env VAR]"""
_OPTION_FLAGS = {"servers": "--url", "max_workers": "--workers", "deadline": "--deadline", "retries": "--retries",
                 "ca_bundle": "--ca-bundle", "client_cert's key": "--client-key", "client_cert": "--client-cert"}



def _flush_parser() -> Parser:
    parser = Parser(
        prog="swe-flush",
        usage=USAGE,
        parents=[_flush_options()],
        allow_abbrev=False,
        description="Flush agent session-server instances on every agent server, in parallel. "
                    "`swe-flush demo` runs against an embedded stub server; `swe-flush stub` serves one.",
        epilog="Environment: AGENT_SERVER_URL (or SWE_AGENT_URL), comma-separated; the bearer from "
               "HARBOR_ADMIN_SECRET, MILES_HARBOR_AUTH_TOKEN or AGENT_SERVER_AUTH_TOKEN, or scoped bearers from "
               "HARBOR_RUN_SECRET. Exit 0: all flushed or nothing to do; 1: a target failed; "
               "2: usage or configuration error; 130: interrupted.",
    )
    parser.add_argument("--url", action="append", default=[], metavar="URL",
                        help="agent server URL (repeatable; default: from the environment)")
    parser.add_argument("--id", action="append", default=[], dest="ids", metavar="ID",
                        help="instance id to flush (repeatable)")
    parser.add_argument("--ids-json", metavar="PATH|-",
                        help="JSON file (or - for stdin): a list of ids, a port->id object, or an object "
                             f"holding {PLURAL_ATTR} / {SINGULAR_ATTR}")
    # Refused on purpose, without echoing the value: a flag value shows in `ps`.
    parser.add_argument("--secret", "--admin-secret", "--token", dest="secret_flag", nargs="?", const="",
                        help=argparse.SUPPRESS)
    rounds = parser.add_mutually_exclusive_group()  # given both, neither silently wins
    rounds.add_argument("--one-pass", dest="until_idle", action="store_false",
                        help="flush each id once; by default each server is flushed again while its last round "
                             "cancelled something, so runs waiting for a slot never start after the flush")
    rounds.add_argument("--until-idle", dest="until_idle", action="store_true", help=argparse.SUPPRESS)  # 1.0's
    parser.set_defaults(until_idle=True)
    parser.add_argument("--version", action="version", version=f"swe-flush {__version__}")
    return parser


def _recover_parser() -> Parser:
    parser = Parser(prog="swe-flush recover", allow_abbrev=False, parents=[_flush_options()],
                     description="Flush the ids of every trainer in a watchdog ledger whose owner is gone "
                                 "(until idle), and remove the records that flushed.")
    parser.add_argument("ledger", metavar="DIR", help="the ledger directory (the watchdog's ledger option)")
    parser.hints = {"--ledger": "the ledger directory is positional: swe-flush recover DIR --url URL"}
    parser.add_argument("--url", action="append", default=[], metavar="URL",
                        help="an agent server a record may name (repeatable; default: AGENT_SERVER_URL); a "
                             "record naming any other server is left alone: the bearer goes only to these")
    return parser


def _flush_options() -> argparse.ArgumentParser:
    """The options ``swe-flush`` and ``swe-flush recover`` share (their parent parser)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--secret-file", metavar="PATH", help="read the bearer secret from this file")
    _add_tls(parent)
    parent.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE, metavar="S",
                        help=f"seconds the whole flush may take (default {DEFAULT_DEADLINE:g})")
    parent.add_argument("--workers", type=int, default=None, metavar="N", help="requests in flight at once")
    parent.add_argument("--retries", type=int, default=3, metavar="N", help="retries per target (default 3)")
    parent.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parent.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    parent.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-v: INFO, -vv: DEBUG)")
    return parent


def _guard_parser() -> Parser:
    parser = Parser(prog="swe-flush guard", allow_abbrev=False,
                     description="Listen on a Unix socket for trainers (watchdog(args, guard=PATH)); flush each "
                                 "trainer whose connection ends without a disarm. Run it outside the trainer's "
                                 "container (a sidecar). Its first line of output starts with 'guarding '.")
    parser.add_argument("--socket", required=True, metavar="PATH", help="the Unix socket to listen on (mode 0600)")
    parser.add_argument("--ledger", metavar="DIR",
                        help="keep each connected trainer's record there, and recover the records of gone owners "
                             "(servers and bearer from this process's environment)")
    parser.add_argument("--drain", type=float, default=DEFAULT_DRAIN, metavar="SECONDS",
                        help=f"after SIGTERM or SIGINT, watch the connected trainers this long (default "
                             f"{DEFAULT_DRAIN:g})")
    parser.add_argument("--metrics", metavar="[HOST:]PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to 127.0.0.1; "
                             "needs the metrics extra)")
    parser.add_argument("--max-held", type=int, default=DEFAULT_MAX_HELD >> 20, metavar="MIB",
                        help=f"memory all held trainer states may take, counted as twice their lines (default "
                             f"{DEFAULT_MAX_HELD >> 20}); past it a new or grown state is refused with the reason")
    parser.add_argument("--heartbeat", type=float, default=DEFAULT_HEARTBEAT, metavar="SECONDS",
                        help=f"seconds between two rewrites of a trainer's ledger record (default "
                             f"{DEFAULT_HEARTBEAT:g}); a record is stale after three")
    parser.add_argument("--takeover-grace", type=float, default=TAKEOVER_GRACE, metavar="SECONDS",
                        help=f"seconds a restarted guard waits before it recovers a predecessor's record of a "
                             f"trainer that holds no lock (default {TAKEOVER_GRACE:g}); it may reconnect meanwhile")
    parser.add_argument("--status", action="store_true",
                        help="print the guard's pid and how many trainers it holds (and 'draining' while it "
                             "drains); exit 1 when none answers")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-v: INFO, -vv: DEBUG)")
    return parser


def _run_guard(ns: argparse.Namespace) -> int:
    if ns.status:
        try:
            answer = guard_status(ns.socket)
        except ImpostorError as exc:
            print(f"not a guard: {exc}")
            return EXIT_FAILED
        if answer is None:
            print(f"no guard answers at {shown(ns.socket)}")
            return EXIT_FAILED
        print(f"guard pid {answer.pid}, {answer.trainers} trainers{', draining' if answer.draining else ''}")
        return EXIT_OK
    if not ns.drain >= 0:
        raise ConfigError("--drain must be a number of seconds, 0 or more")
    if not 1 <= ns.max_held <= 1 << 20:
        raise ConfigError("--max-held must be a number of MiB from 1 to 1048576")
    if not 0.1 <= ns.heartbeat <= 3600:
        raise ConfigError("--heartbeat must be a number of seconds from 0.1 to 3600")
    if not 0 <= ns.takeover_grace <= 3600:
        raise ConfigError("--takeover-grace must be a number of seconds from 0 to 3600")
    metrics = parse_address(ns.metrics) if ns.metrics is not None else None
    with _logging_to_stderr(_verbosity(ns.verbose)):
        return run_guard(ns.socket, ns.ledger, ns.drain, ns.heartbeat, metrics, max_held=ns.max_held << 20,
                         takeover_grace=ns.takeover_grace)


def _add_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ca-bundle", metavar="PATH",
                        help="CA certificates for https servers: a PEM file or a directory (default: "
                             "REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE or SSL_CERT_FILE, then the system store)")
    parser.add_argument("--client-cert", metavar="PATH",
                        help="client certificate (PEM, with its key unless --client-key is given)")
    parser.add_argument("--client-key", metavar="PATH", help="the client certificate's key (PEM)")


def _tls_options(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.client_key and not ns.client_cert:
        raise ConfigError("--client-key needs --client-cert")
    client_cert = (ns.client_cert, ns.client_key) if ns.client_key else ns.client_cert
    return {"ca_bundle": ns.ca_bundle, "client_cert": client_cert}


def _doctor_parser() -> Parser:
    parser = Parser(prog="swe-flush doctor", allow_abbrev=False,
                     description="Check this trainer's setup before the run: the servers (a /flush of an id that "
                                 "cannot exist, with the bearer), the guard, the container, the ledger, the limits "
                                 "and versions. One line per check (ok, warn, fail); exit 1 when any failed. Run it "
                                 "where the trainer runs, with the trainer's environment.")
    parser.add_argument("--url", action="append", metavar="URL",
                        help="an agent server (repeatable; default AGENT_SERVER_URL, else SWE_AGENT_URL)")
    parser.add_argument("--guard", metavar="PATH", help="the guard's socket (default SWE_FLUSH_GUARD)")
    parser.add_argument("--ledger", metavar="DIR", help="the ledger directory (default SWE_FLUSH_LEDGER)")
    _add_tls(parser)
    parser.add_argument("--json", action="store_true", help='print {"ok": ..., "checks": [...]} instead')
    return parser


def _run_doctor(ns: argparse.Namespace) -> int:
    from .doctor import failed, run_checks  # only this command needs it

    checks = run_checks(ns.url, ns.guard, ns.ledger, **_tls_options(ns))
    if ns.json:
        print(json.dumps({"ok": not failed(checks), "checks": [
            {"name": check.name, "status": check.status, "detail": check.detail} for check in checks]}, indent=2))
    else:
        for check in checks:
            print(check.line())
    return EXIT_FAILED if failed(checks) else EXIT_OK


def _command(name: str) -> Command:
    """The parser and runner of a subcommand (demo and stub are loaded only for themselves)."""
    if name in _DEMO_COMMANDS:
        from .demo import COMMANDS

        return COMMANDS[name]
    return _COMMANDS[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swe-flush`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and (argv[0] in _COMMANDS or argv[0] in _DEMO_COMMANDS) else None
    as_json = "--json" in argv
    try:
        parser, run = _command(command) if command else (_flush_parser, _run_flush)
        return run(parser().parse_args_naming_unknown(argv[1:] if command else argv))
    except (UsageError, FlushError) as exc:
        message = _name_flags(str(exc))
        if as_json:
            print(json.dumps({"ok": False, "error": message}))
        else:
            print(f"swe-flush{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _name_flags(message: str) -> str:
    """A ``FlushOptions`` message, with the option named by its CLI flag."""
    for option, flag in _OPTION_FLAGS.items():
        if message.startswith((option + " ", option + ":")):
            return flag + message[len(option):]
    return message


def _run_flush(ns: argparse.Namespace) -> int:
    if ns.secret_flag is not None:
        raise ConfigError("the secret is never taken as a flag value (it would show in ps): "
                          "set HARBOR_ADMIN_SECRET or pass --secret-file PATH")
    urls = normalize_server_urls(ns.url, "--url") if ns.url else resolve_server_urls()
    if not urls:
        raise ConfigError("no agent server URL: pass --url or set AGENT_SERVER_URL")
    bearer = StaticBearer(_read_secret_file(ns.secret_file), source="--secret-file") if ns.secret_file \
        else resolve_bearer()
    if any(not instance_id.strip() for instance_id in ns.ids):
        raise ConfigError("--id was given an empty value (an unset shell variable?): give the instance id")
    ids = normalize_instance_ids([*ns.ids, *(_read_ids_json(ns.ids_json) if ns.ids_json else ())])
    logging_context = _logging_to_stderr(_verbosity(ns.verbose)) if ns.verbose else contextlib.nullcontext()
    with logging_context, Flusher(urls, bearer=bearer, deadline=ns.deadline, max_workers=ns.workers,
                                  retries=ns.retries, until_idle=ns.until_idle, linger=0,
                                  **_tls_options(ns)) as flusher:
        report, interrupted = _flush_interruptibly(flusher, ids)
    print_report(report, ns.json, quiet=ns.quiet)
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if report.ok else EXIT_FAILED


@contextlib.contextmanager
def _logging_to_stderr(level: int) -> Iterator[None]:
    """The library's records at ``level`` and above on stderr, meanwhile."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("swe_flush_sync")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def _verbosity(verbose: int, default: int = logging.WARNING) -> int:
    """The level for ``-v`` (INFO), ``-vv`` (DEBUG), else ``default``."""
    return logging.DEBUG if verbose > 1 else logging.INFO if verbose else default


def _run_recover(ns: argparse.Namespace) -> int:
    if not os.path.exists(ns.ledger):
        raise ConfigError(f"recover: {shown(ns.ledger)} does not exist: give the ledger directory the watchdog or "
                          "guard was given (its ledger option, SWE_FLUSH_LEDGER or --ledger)")
    if not os.path.isdir(ns.ledger):
        raise ConfigError(f"recover: {shown(ns.ledger)} is a file, not the ledger directory")
    if not ns.url and not resolve_server_urls():
        raise ConfigError(f"recover: no agent server named: pass --url URL (or set {' or '.join(URL_ENV_VARS)}); "
                          "a server read from a ledger record never gets a bearer")
    bearer = StaticBearer(_read_secret_file(ns.secret_file), source="--secret-file") if ns.secret_file \
        else resolve_bearer()
    with _logging_to_stderr(_verbosity(ns.verbose)):  # a record moved aside is worth seeing, even without -v
        report = recover(ns.ledger, servers=ns.url or None, bearer=bearer, deadline=ns.deadline,
                         max_workers=ns.workers,
                         retries=ns.retries, **_tls_options(ns))
    print_report(report, ns.json, quiet=ns.quiet)
    return EXIT_OK if report.ok else EXIT_FAILED


def _flush_interruptibly(flusher: Flusher, ids: tuple[str, ...]) -> tuple[FlushReport, bool]:
    """Flush on a daemon thread; Ctrl-C gives the pairs in flight up at once: (report, interrupted).

    Waits on an Event, not ``Thread.join``: a join interrupted by Ctrl-C can mark a running
    thread as ended (CPython 3.11).
    """
    box: list[FlushReport] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(flusher.flush(ids))
        finally:
            done.set()

    threading.Thread(target=run, name="swe-flush-cli", daemon=True).start()
    interrupted = False
    while not done.is_set():
        try:
            done.wait(0.05)
        except KeyboardInterrupt:
            interrupted = True
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C changes nothing, even at exit
            flusher.abandon_in_flight("interrupted")
    return box[0], interrupted


def _read_secret_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            secret = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--secret-file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not secret:
        raise ConfigError(f"--secret-file: {path} is empty")
    return secret


def _read_ids_json(path: str) -> tuple[str, ...]:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--ids-json: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--ids-json: {path} is not valid JSON ({exc})") from None
    shapes = (f'a list of ids (["a", "b"]), an object of port -> id ({{"8000": "a"}}), or an object holding '
              f'{PLURAL_ATTR} and/or {SINGULAR_ATTR}')
    try:
        if isinstance(data, dict) and (PLURAL_ATTR in data or SINGULAR_ATTR in data):
            return resolve_instance_ids(data)
        if isinstance(data, (dict, list)):
            return normalize_instance_ids(data)
    except ConfigError as exc:
        raise ConfigError(f"--ids-json: {shown(path)} must hold {shapes}; every id a string ({exc})") from None
    raise ConfigError(f"--ids-json: {shown(path)} must hold {shapes}, not a JSON {type(data).__name__}")



_COMMANDS: dict[str, Command] = {"recover": (_recover_parser, _run_recover), "guard": (_guard_parser, _run_guard),
                                 "doctor": (_doctor_parser, _run_doctor)}
_DEMO_COMMANDS = ("demo", "stub")  # in demo: only they need the stub server
