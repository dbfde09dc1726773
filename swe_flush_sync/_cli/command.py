"""What the command line's modules share: a subcommand's shape, the exit codes, the parser that
raises instead of exiting, and the report as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TextIO

from .._core.report import FlushReport
from .._core.text import shown

Command = tuple[Callable[[], "Parser"], Callable[[argparse.Namespace], int]]  # a subcommand's parser and runner
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A command line argparse refuses; the message says why."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises ``UsageError`` instead of exiting, and names unknown options
    without their values."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hints: dict[str, str] = {}  # an option people try -> what to do instead

    def parse_args_naming_unknown(self, argv: list[str]) -> argparse.Namespace:
        """``parse_args``, but unknown options are named without their values (they may be secrets), with a
        hint for an option people try that does not exist; a hinted option is checked before the
        positionals, so the hint comes first."""
        tried = sorted({token.split("=", 1)[0] for token in argv if token.split("=", 1)[0] in self.hints})
        if tried:
            raise UsageError(f"unrecognized option(s): {', '.join(tried)} (values are never shown); "
                              + "; ".join(self.hints[flag] for flag in tried))
        ns, unknown = self.parse_known_args(argv)
        if unknown:
            flags = sorted({token.split("=", 1)[0] for token in unknown if token.startswith("-")})
            extra = len([token for token in unknown if not token.startswith("-")])
            named = f"unrecognized option(s): {', '.join(shown(flag, 40) for flag in flags)}" if flags else ""
            values = f"{extra} unexpected argument(s)" if extra else ""
            raise UsageError("; ".join(part for part in (named, values) if part) + " (values are never shown)")
        return ns


def print_report(report: FlushReport, as_json: bool, out: TextIO | None = None, *, quiet: bool = False) -> None:
    out = out or sys.stdout
    if as_json:
        print(json.dumps(report.to_dict(), indent=2), file=out)
        return
    rows = [("INSTANCE", "SERVER", "CANCELLED", "PASSES", "IDLE", "ATTEMPTS", "TIME", "RESULT")]
    for r in () if quiet else report.results:
        rows.append((shown(r.instance_id, 80), shown(r.server_url), "-" if r.cancelled is None else str(r.cancelled),
                     str(r.passes), {True: "yes", False: "no", None: "-"}[r.idle], str(r.attempts),
                     f"{r.elapsed:.2f}s", "ok" if r.ok else f"FAILED: {shown(r.error or '')}"))
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            cells = "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
            print(f"{cells}  {row[-1]}", file=out)
    print(report.summary() if report.results or report.error or report.left_alone else "nothing to flush", file=out)
