"""The ``swe-flush`` command line: flush instances from a shell, or ``swe-flush demo``.

Exit codes: 0 all flushed or nothing to do; 1 some target failed; 2 usage or configuration
error (one line on stderr, no traceback). The secret is read only from the environment or
``--secret-file``, never from a flag value (it would show in ``ps``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from . import __version__
from ._errors import ConfigError, FlushError
from ._auth import StaticBearer
from ._flusher import flush
from ._options import DEFAULT_DEADLINE
from ._lifecycle import abort
from ._report import FlushReport
from ._resolve import (
    PLURAL_ATTR,
    SINGULAR_ATTR,
    normalize_instance_ids,
    normalize_server_urls,
    resolve_bearer,
    resolve_instance_ids,
    resolve_server_urls,
)
from ._stub import AgentServerStub

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _flush_parser() -> _Parser:
    parser = _Parser(
        prog="swe-flush",
        allow_abbrev=False,
        description="Flush agent session-server instances on every agent server, in parallel. "
                    "`swe-flush demo` runs against an embedded stub server.",
        epilog="Environment: AGENT_SERVER_URL (or SWE_AGENT_URL), comma-separated; "
               "HARBOR_ADMIN_SECRET (or MILES_HARBOR_AUTH_TOKEN). "
               "Exit 0: all flushed or nothing to do; 1: a target failed; 2: usage or configuration error.",
    )
    parser.add_argument("--url", action="append", default=[], metavar="URL",
                        help="agent server URL (repeatable; default: from the environment)")
    parser.add_argument("--id", action="append", default=[], dest="ids", metavar="ID",
                        help="instance id to flush (repeatable)")
    parser.add_argument("--ids-json", metavar="PATH|-",
                        help="JSON file (or - for stdin): a list of ids, a port->id object, or an object "
                             f"holding {PLURAL_ATTR} / {SINGULAR_ATTR}")
    parser.add_argument("--secret-file", metavar="PATH", help="read the bearer secret from this file")
    # Refused on purpose, without echoing the value: a flag value shows in `ps`.
    parser.add_argument("--secret", "--admin-secret", "--token", dest="secret_flag", nargs="?", const="",
                        help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE, metavar="S",
                        help=f"seconds the whole flush may take (default {DEFAULT_DEADLINE:g})")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="requests in flight at once")
    parser.add_argument("--retries", type=int, default=3, metavar="N", help="retries per target (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--version", action="version", version=f"swe-flush {__version__}")
    return parser


def _demo_parser() -> _Parser:
    parser = _Parser(prog="swe-flush demo", allow_abbrev=False,
                     description="Start a stub agent server with in-flight trials and flush them all.")
    parser.add_argument("--instances", type=int, default=8, metavar="N", help="session-server instances (default 8)")
    parser.add_argument("--teardown", type=float, default=0.5, metavar="S",
                        help="seconds each flush waits for its trials' teardown (default 0.5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swe-flush`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    demo = bool(argv) and argv[0] == "demo"
    try:
        if demo:
            return _run_demo(_demo_parser().parse_args(argv[1:]))
        return _run_flush(_flush_parser().parse_args(argv))
    except (_UsageError, FlushError) as exc:
        prog = "swe-flush demo" if demo else "swe-flush"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run_flush(ns: argparse.Namespace) -> int:
    if ns.secret_flag is not None:
        raise ConfigError("the secret is never taken as a flag value (it would show in ps): "
                          "set HARBOR_ADMIN_SECRET or pass --secret-file PATH")
    urls = normalize_server_urls(ns.url, "--url") if ns.url else resolve_server_urls()
    if not urls:
        raise ConfigError("no agent server URL: pass --url or set AGENT_SERVER_URL")
    bearer = StaticBearer(_read_secret_file(ns.secret_file), source="--secret-file") if ns.secret_file \
        else resolve_bearer()
    ids = normalize_instance_ids([*ns.ids, *(_read_ids_json(ns.ids_json) if ns.ids_json else ())])
    report = flush(urls, ids, bearer=bearer, deadline=ns.deadline, max_workers=ns.workers, retries=ns.retries)
    _print_report(report, ns.json)
    return EXIT_OK if report.ok else EXIT_FAILED


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
    if isinstance(data, dict) and (PLURAL_ATTR in data or SINGULAR_ATTR in data):
        return resolve_instance_ids(data)
    if isinstance(data, (dict, list)):
        return normalize_instance_ids(data)
    raise ConfigError(f"--ids-json: {path} must hold a list of ids or an object, not {type(data).__name__}")


def _print_report(report: FlushReport, as_json: bool, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if as_json:
        print(json.dumps(report.to_dict(), indent=2), file=out)
        return
    rows = [("INSTANCE", "SERVER", "CANCELLED", "ATTEMPTS", "TIME", "RESULT")]
    for r in report.results:
        rows.append((r.instance_id, r.server_url, "-" if r.cancelled is None else str(r.cancelled),
                     str(r.attempts), f"{r.elapsed:.2f}s", "ok" if r.ok else f"FAILED: {r.error}"))
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5], file=out)
    print(report.summary() if report.results or report.error else "nothing to flush", file=out)


def _run_demo(ns: argparse.Namespace) -> int:
    if ns.instances < 1 or ns.teardown < 0:
        raise ConfigError("--instances must be >= 1 and --teardown >= 0")
    secret = secrets.token_urlsafe(16)
    ids = [f"demo-instance-{index}" for index in range(ns.instances)]
    with AgentServerStub(secret=secret, teardown=ns.teardown) as stub:
        for index, instance_id in enumerate(ids):
            stub.add_trials(instance_id, 2 + index % 3)
        # Trainer args as the framework fills them: a port -> id map plus the singular id.
        args = argparse.Namespace(
            session_server_instance_ids={8000 + index: instance_id for index, instance_id in enumerate(ids)},
            session_server_instance_id=ids[0],
        )
        report = abort(args, environ={"AGENT_SERVER_URL": stub.url, "HARBOR_ADMIN_SECRET": secret})
        left = sum(stub.trials(instance_id) for instance_id in ids)
    one_by_one = sum(result.elapsed for result in report.results)
    if ns.json:
        print(json.dumps({**report.to_dict(), "one_by_one_seconds": one_by_one, "trials_left": left}, indent=2))
    else:
        print(f"swe-flush demo: {len(ids)} session-server instances, {report.cancelled} in-flight trials, "
              f"{ns.teardown:g}s teardown each, on a stub agent server at {stub.url}\n")
        _print_report(report, False)
        print(f"\nwall time: {report.elapsed:.2f}s in parallel; one by one it would have taken "
              f"{one_by_one:.2f}s (the sum of each flush's own time), {one_by_one / max(report.elapsed, 1e-9):.1f}x "
              f"longer. Trials left running: {left}.")
    return EXIT_OK if report.ok and left == 0 else EXIT_FAILED
