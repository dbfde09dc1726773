"""``recover``: flush the ids of trainers that died with their watchdog (a lost pod or node).

A watchdog armed with a ledger keeps one JSON record of its trainer's servers and ids there
(``_process.record``). At start-up, ``recover(ledger)`` flushes, in one parallel
call, the ids of every record whose owner is gone, then removes each record whose pairs all
flushed. A record is claimed by renaming it before it is flushed, so two recovers at once never
flush the same record twice. A record that cannot be read is moved aside (``*.bad``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final

from ._core.errors import ConfigError
from ._core.groups import flush_groups
from ._core.logs import log_report
from ._core.options import DEFAULT_DEADLINE, FlushOptions
from ._core.report import FlushReport
from ._core.resolve import (
    URL_ENV_VARS,
    normalize_server_urls,
    redact_url,
    resolve_bearer,
    resolve_server_urls,
)
from ._core.text import shown
from ._core.threads import Runner
from ._process.liveness import remove_if_free
from ._process.proc import Place, alive, process_start_time
from ._process.record import RECORD_SUFFIX, BadRecord, Record, UntrustedRecord
from ._process.trust import directory_problem

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._core.options import RecoverOptionKwargs

log = logging.getLogger(__name__)

DYING_GRACE: Final = 1.0  # seconds past its trainer's deadline a running watchdog is left to flush its record
DYING_POLL: Final = 0.05  # seconds between two looks at such a record
WATCHDOG_FLUSHING: Final = "its watchdog is flushing it"  # why such a record is left alone meanwhile
DISARMED: Final = "its trainer disarmed: removed, not flushed"  # a record whose lock says so
CLAIM_MARK: Final = ".claim-"  # <record>.json.claim-<host>.<pid>.<start>: being recovered
BAD_SUFFIX: Final = ".bad"
STALE_CLAIM: Final = 600.0  # seconds after which a claim made on another host is taken over


def _claim_owner_gone(name: str, here: Place, now: float, path: str) -> bool:
    """For a claim file: has the ``recover`` that claimed it died before finishing?"""
    try:
        host, namespace, pid_text, started_text = name.rpartition(CLAIM_MARK)[2].rsplit(".", 3)
        pid, started = int(pid_text), int(started_text)
    except ValueError:
        return False
    if host == here.host and namespace == str(here.pid_ns):
        return not alive(pid, started)
    try:
        return now - os.stat(path).st_mtime > STALE_CLAIM
    except OSError:
        return False


Judge = Callable[[Record, bool], bool]
"""Given a record and whether ``owner_gone`` says its owner is gone: may it be flushed? (a guard's rule)"""


class _Ledger:
    """The ledger directory as this ``recover`` sees it, and the servers it may send a bearer to."""

    def __init__(self, folder: str, servers: tuple[str, ...], judge: Judge | None = None) -> None:
        self.folder = folder
        self.servers = frozenset(servers)
        self.judge = judge
        self.left_alone: dict[str, int] = {}  # why -> records not flushed nor moved for that reason (errors)
        self.listed: dict[str, str] = {}  # record name -> why it was left alone (alive, too: not an error)
        self.dying: dict[str, float] = {}  # record name -> until when its running watchdog is left to flush it
        self._warned: set[str] = set()  # records warned about (once, whatever the passes)
        self.moved_aside = 0
        self.here = Place.here()
        started = process_start_time(os.getpid()) or 0
        self.claim = f"{CLAIM_MARK}{self.here.host}.{self.here.pid_ns}.{os.getpid()}.{started}"

    def candidates(self, now: float) -> list[tuple[str, Record]]:
        """Claim (rename) every usable record whose owner is gone; (claimed path, record) each. A record
        whose trainer is dead but whose watchdog runs is left to it until ``dying`` says (a recover
        without a guard's ``judge`` then waits for it: ``wait_for_dying``)."""
        claimed = []
        self.listed.clear()
        self.left_alone.clear()  # (a second pass counts them again)
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if name.startswith(".") or name.endswith(BAD_SUFFIX):
                continue
            if CLAIM_MARK in name:
                if not _claim_owner_gone(name, self.here, now, path):
                    continue
                original = name.partition(CLAIM_MARK)[0]
            elif name.endswith(RECORD_SUFFIX):
                original = name
            else:
                continue
            record = self._readable(path)
            if record is None:
                continue
            if CLAIM_MARK not in name and record.disarmed():  # its trainer disarmed: nothing to flush
                with contextlib.suppress(OSError):
                    os.unlink(path)
                _, trainer_lock = record.locks()
                if trainer_lock is not None:
                    remove_if_free(trainer_lock)
                self.listed[name] = DISARMED
                continue
            if CLAIM_MARK not in name and not self._gone(record, now, name):
                continue  # a live trainer's record: left alone
            if not self._servers_given(record, name):
                continue
            mine = os.path.join(self.folder, original + self.claim)
            try:
                os.rename(path, mine)  # atomic: of two recovers, one wins and the other finds nothing
            except FileNotFoundError:
                continue
            record = self._readable(mine)  # as it was when claimed: the latest ids
            if record is not None and self._servers_given(record, name):
                claimed.append((mine, record))
            elif os.path.exists(mine):
                with contextlib.suppress(OSError):
                    os.rename(mine, os.path.join(self.folder, original))
        return claimed

    def _gone(self, record: Record, now: float, name: str) -> bool:
        kept = record.why_kept(self.here, now)
        gone = kept is None
        if self.judge is not None:
            return self.judge(record, gone)
        if not gone and record.dying(self.here):  # its watchdog's flush (or death) gets its moment
            until = self.dying.setdefault(name, time.monotonic() + (record.deadline or DEFAULT_DEADLINE) + DYING_GRACE)
            if time.monotonic() < until:
                self.listed[name] = WATCHDOG_FLUSHING
                return False
            return True
        if not gone:
            self.listed[name] = kept or ""
        return gone

    def wait_for_dying(self) -> None:
        """Until no record's watchdog still has its moment (each record's deadline plus ``DYING_GRACE``),
        said first (a stopped watchdog's record makes recover wait all of it)."""
        waiting = sorted(name for name, why in self.listed.items() if why == WATCHDOG_FLUSHING)
        longest = max((self.dying[name] for name in waiting), default=time.monotonic()) - time.monotonic()
        log.warning("recover: waiting up to %.1f s for the watchdog(s) of %d record(s) whose trainer died, flushing "
                    "it now (%s); a record still there then is flushed here", max(longest, 0.0), len(waiting),
                    ", ".join(shown(name) for name in waiting[:3]) + (", ..." if len(waiting) > 3 else ""))
        while any(why == WATCHDOG_FLUSHING for why in self.listed.values()):
            time.sleep(DYING_POLL)
            self.listed = {name: why for name, why in self.listed.items()
                           if why != WATCHDOG_FLUSHING or self._still_dying(name)}

    def _still_dying(self, name: str) -> bool:
        try:
            record = Record.read(os.path.join(self.folder, name))
        except (OSError, BadRecord, UntrustedRecord):
            return False  # flushed and removed by its watchdog, or claimed
        return record.dying(self.here) and time.monotonic() < self.dying.get(name, 0.0)

    def _readable(self, path: str) -> Record | None:
        """The record at ``path`` if this recover may believe it; else None, said once."""
        try:
            return Record.read(path)
        except FileNotFoundError:
            return None  # another recover claimed it a moment ago
        except UntrustedRecord as exc:
            self._warn(os.path.basename(path), "ledger record %s %s; left alone", shown(os.path.basename(path)), exc)
            why = "another user could have written" if "symbolic" not in str(exc) else "a symbolic link"
            self._leave_alone(why)
            self.listed[os.path.basename(path)] = f"not trusted: {why} it"
            return None
        except BadRecord as exc:
            self._set_aside(path, str(exc))
            self.moved_aside += 1
            return None

    def _servers_given(self, record: Record, name: str) -> bool:
        """Does the record of a gone owner name only servers this recover may send a bearer to? Else said."""
        foreign = [url for url in record.urls if url not in self.servers]
        if foreign:
            self._warn(name, "ledger record %s names %d server(s) recover was not given (%s); left alone: a "
                       "bearer goes only to the servers the recovering side names", shown(name), len(foreign),
                       redact_url(foreign[0]))
            self._leave_alone("naming a server recover was not given")
            self.listed[name] = f"its trainer is gone, but it names a server not given ({redact_url(foreign[0])})"
        return not foreign

    def _warn(self, name: str, message: str, *args: object) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning(message, *args)

    def _leave_alone(self, why: str) -> None:
        self.left_alone[why] = self.left_alone.get(why, 0) + 1

    def skipped(self) -> str | None:
        """What this recover did not flush and why, for ``report.error``; None when it skipped nothing."""
        parts = []
        if self.left_alone:
            reasons = ", ".join(f"{count} {why}" for why, count in sorted(self.left_alone.items()))
            parts.append(f"left {sum(self.left_alone.values())} record(s) alone ({reasons})")
        if self.moved_aside:
            parts.append(f"moved {self.moved_aside} unreadable record(s) aside to *{BAD_SUFFIX}")
        return "; ".join(parts) or None

    def _set_aside(self, path: str, why: str) -> str:
        """Move ``path`` to ``*.bad`` with one warning; the name it now has."""
        name = os.path.basename(path).partition(CLAIM_MARK)[0]
        aside = os.path.join(self.folder, name + BAD_SUFFIX)
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        log.warning("ledger record %s %s; moved aside to %s", shown(os.path.basename(path)), why,
                    shown(os.path.basename(aside)))
        return os.path.basename(aside)

    def settle(self, claimed: list[tuple[str, Record]], report: FlushReport) -> list[str]:
        """Remove each claimed record that flushed (aside, if ids were set aside), give back the others;
        a line per record set aside."""
        ok = {(result.server_url, result.instance_id) for result in report.results if result.ok}
        set_aside = []
        for path, record in claimed:
            original = path.partition(self.claim)[0]
            try:
                if not all((url, instance_id) in ok for url in record.urls for instance_id in record.ids):
                    os.rename(path, original)
                elif record.set_aside is None:
                    os.unlink(path)
                    _, trainer_lock = record.locks()
                    if trainer_lock is not None:
                        remove_if_free(trainer_lock)
                else:
                    aside = self._set_aside(path, record.set_aside)
                    set_aside.append(f"ledger record {shown(os.path.basename(original))}: {record.set_aside}, "
                                     f"kept as {shown(aside)}")
            except OSError as exc:
                log.warning("ledger record %s could not be settled: %s", shown(os.path.basename(path)),
                            exc.strerror or type(exc).__name__)
        return set_aside


def recover(ledger: str, *, servers: str | Iterable[str] | None = None, environ: Mapping[str, str] | None = None,
            **options: Unpack[RecoverOptionKwargs]) -> FlushReport:
    """Flush the ids of every trainer in ``ledger`` that is gone; remove the records that flushed.

    Call it at start-up, before arming the watchdog, with the ledger on storage that outlives the
    pod (the checkpoint volume). The bearer (from ``environ``) goes only to ``servers``: a record
    naming another server is left alone with a warning. The directory and each record must be
    owned by this user (or root) and writable by no one else (OpenSSH's StrictModes rules).

    An owner is gone when its keeper marked it so; when the lock files of a guard's record prove it;
    when, in this host, boot and PID namespace, its trainer is dead (a zombie
    counts) and its watchdog or guard is not alive; anywhere else, when its heartbeat is older
    than three intervals (30 s by default). A record whose trainer is dead here but whose watchdog
    still runs (flushing it, or killed with it and not gone yet) is left to that watchdog for its
    deadline plus 1 s, then flushed if it is still there. The pairs of every gone record are flushed in one
    parallel call (until idle by default); a record whose pairs all flushed is removed, the others
    stay for the next ``recover``. Two recovers never flush the same record (each claims it by a
    rename). A record that cannot be read is moved aside to ``*.bad`` with a warning; values in
    its ids that are not text are set aside the same way once its other ids flushed.

    Args:
        ledger: the ledger directory. Missing or empty: nothing to do.
        servers: the agent server URLs a record may name (a str, comma-separated, or a list);
            default: the environment's (``AGENT_SERVER_URL``, else ``SWE_AGENT_URL``).
        environ: the environment to read the servers and bearer from instead of ``os.environ``
            (the records hold no secret).
        **options: as for ``abort`` but ``linger`` and ``ledger``; ``until_idle`` defaults to True.

    Returns:
        The ``FlushReport`` of every pair flushed (empty when nothing was to do). A ledger that
        cannot be listed or may not be trusted, ids set aside, records left alone (another user
        could have written them, or they name a server not given) and records moved aside are
        counted in ``report.error`` (so ``report.ok`` is False and ``swe-flush recover`` exits 1).
        Records of live owners are not: leaving them is the rule. Every record left alone is
        listed in ``report.left_alone`` with the reason.

    Raises:
        ConfigError: ``ledger`` is not a path, no server is named, or a bad option. Never for a
            bad ledger.

    Examples:
        ```python
        recover("/checkpoints/swe-flush-ledger", servers="http://agent:8000").ok
        ```
    """
    options.setdefault("until_idle", True)
    return recover_with(ledger, servers, environ, FlushOptions(**options, linger=0.0))


def recover_with(ledger: str, servers: str | Iterable[str] | None, environ: Mapping[str, str] | None,
                 flush_options: FlushOptions, judge: Judge | None = None,
                 on_claimed: Callable[[list[Record]], None] | None = None, quiet: bool = False,
                 workers: Runner | None = None) -> FlushReport:
    """``recover`` with built options and a guard's hooks: ``judge`` of which records are gone,
    ``on_claimed`` told which records were flushed and settled, ``quiet`` (no log) and ``workers``."""
    report = _recover(ledger, servers, environ, flush_options, judge, on_claimed, workers)
    if not quiet and (report.results or report.error):
        log_report(report)
    return report


def _recover(ledger: str, servers: str | Iterable[str] | None, environ: Mapping[str, str] | None,
             flush_options: FlushOptions, judge: Judge | None,
             on_claimed: Callable[[list[Record]], None] | None, workers: Runner | None) -> FlushReport:
    if not isinstance(ledger, str) or not ledger.strip() or "\0" in ledger:
        raise ConfigError("ledger must be a directory path (a non-empty str)")
    env = os.environ if environ is None else environ
    urls = normalize_server_urls(servers, "servers") if servers is not None else resolve_server_urls(env)
    if not urls:
        raise ConfigError(f"recover: no agent server named (pass servers= or set {' or '.join(URL_ENV_VARS)}); "
                          "a server read from a ledger record never gets a bearer")
    started = time.monotonic()
    if not os.path.isdir(ledger):
        return FlushReport(elapsed=time.monotonic() - started)
    problem = directory_problem(ledger)
    if problem is not None:
        return FlushReport(elapsed=time.monotonic() - started,
                           error=f"the ledger directory {shown(ledger)} {problem}: nothing in it was flushed or moved")
    try:
        book = _Ledger(ledger, urls, judge)
        claimed = book.candidates(time.time())
        if judge is None and WATCHDOG_FLUSHING in book.listed.values():
            book.wait_for_dying()
            claimed += book.candidates(time.time())
    except OSError as exc:
        return FlushReport(elapsed=time.monotonic() - started,
                           error=f"the ledger cannot be read: {exc.strerror or type(exc).__name__}")
    left_alone = tuple(f"{name}: {why}" for name, why in sorted(book.listed.items()))
    if not claimed:
        return FlushReport(elapsed=time.monotonic() - started, error=book.skipped(), left_alone=left_alone)
    if flush_options.bearer_provider is None:
        flush_options = dataclasses.replace(flush_options, bearer=resolve_bearer(env))
    groups: dict[tuple[str, ...], dict[str, None]] = {}
    for _, record in claimed:
        groups.setdefault(record.urls, {}).update(dict.fromkeys(record.ids))
    report = flush_groups(groups, flush_options, workers)
    set_aside = book.settle(claimed, report)
    if on_claimed is not None:
        on_claimed([record for _, record in claimed])  # after the flush and the records settled
    skipped = book.skipped()
    return FlushReport(results=report.results, elapsed=time.monotonic() - started,
                       error="; ".join([*set_aside, *([skipped] if skipped else [])]) or None, left_alone=left_alone)
