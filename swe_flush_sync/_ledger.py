"""``recover``: flush the ids of trainers that died with their watchdog (a lost pod or node).

A watchdog armed with a ledger keeps one JSON record of its trainer's servers and ids there
(``_watchdog_process`` writes it). At start-up, ``recover(ledger)`` flushes, in one parallel
call, the ids of every record whose owner is gone, then removes each record whose pairs all
flushed. A record is claimed by renaming it before it is flushed, so two recovers at once never
flush the same record twice. A record that cannot be read is moved aside (``*.bad``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ._errors import ConfigError
from ._flusher import Flusher
from ._logs import log_report
from ._options import FlushOptions
from ._report import FlushReport, FlushResult
from ._resolve import normalize_instance_ids, normalize_server_urls, resolve_bearer
from ._text import shown
from ._watchdog_process import RECORD_SUFFIX, RECORD_VERSION, boot_id, host_name, process_start_time

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._options import RecoverOptionKwargs

log = logging.getLogger(__name__)

CLAIM_MARK: Final = ".claim-"  # <record>.json.claim-<host>.<pid>.<start>: being recovered
BAD_SUFFIX: Final = ".bad"
MAX_RECORD_BYTES: Final = 1 << 20
MAX_ID_LENGTH: Final = 1024
STALE_HEARTBEATS: Final = 3  # an owner elsewhere is gone when its heartbeat is older than this many intervals
STALE_CLAIM: Final = 600.0  # seconds after which a claim made on another host is taken over


class BadRecord(Exception):
    """A ledger record that cannot be used; the message says why (never its content)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One trainer's record: where its ids live and how to tell whether it is gone."""

    urls: tuple[str, ...]
    ids: tuple[str, ...]
    host: str
    pid: int
    start_time: int | None
    boot_id: str | None
    heartbeat: float
    heartbeat_interval: float

    def owner_gone(self, here: str, boot: str | None, now: float) -> bool:
        """Same host and boot: the pid is dead or another process; elsewhere: a stale heartbeat."""
        if self.host == here and boot is not None and self.boot_id == boot:
            return process_start_time(self.pid) != self.start_time
        return now - self.heartbeat > STALE_HEARTBEATS * self.heartbeat_interval


def read_record(path: str) -> Record:
    """Parse and check the record at ``path``; ``BadRecord`` saying what is wrong."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise BadRecord(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecord(f"is larger than {MAX_RECORD_BYTES} bytes")
    try:
        raw = json.loads(data)
    except ValueError:
        raise BadRecord("is not JSON") from None
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
        raise BadRecord(f"is not a version {RECORD_VERSION} record")
    try:
        ids = normalize_instance_ids(_field(raw, "ids", list))
        if any(len(instance_id) > MAX_ID_LENGTH for instance_id in ids):
            raise BadRecord(f"holds an id longer than {MAX_ID_LENGTH} characters")
        return Record(urls=normalize_server_urls(_field(raw, "urls", list), "the record's urls"), ids=ids,
                      host=_field(raw, "host", str), pid=_field(raw, "pid", int),
                      start_time=_field(raw, "start_time", (int, type(None))),
                      boot_id=_field(raw, "boot_id", (str, type(None))),
                      heartbeat=float(_field(raw, "heartbeat", (int, float))),
                      heartbeat_interval=float(_field(raw, "heartbeat_interval", (int, float))))
    except ConfigError as exc:
        raise BadRecord(str(exc)) from None


def _field(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRecord(f"has no valid {name!r}")
    return value


def _claim_owner_gone(name: str, here: str, now: float, path: str) -> bool:
    """For a claim file: has the ``recover`` that claimed it died before finishing?"""
    try:
        host, pid_text, started_text = name.rpartition(CLAIM_MARK)[2].rsplit(".", 2)
        pid, started = int(pid_text), int(started_text)
    except ValueError:
        return False
    if host == here:
        return process_start_time(pid) != started
    try:
        return now - os.stat(path).st_mtime > STALE_CLAIM
    except OSError:
        return False


class _Ledger:
    """The ledger directory as this ``recover`` sees it."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.here = host_name()
        self.boot = boot_id()
        started = process_start_time(os.getpid()) or 0
        self.claim = f"{CLAIM_MARK}{self.here}.{os.getpid()}.{started}"

    def candidates(self, now: float) -> list[tuple[str, Record]]:
        """Claim every record whose owner is gone; its (claimed path, record). Bad records are moved aside."""
        claimed = []
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
            try:
                record = read_record(path)
            except BadRecord as exc:
                self._set_aside(path, str(exc))
                continue
            if CLAIM_MARK not in name and not record.owner_gone(self.here, self.boot, now):
                continue  # a live trainer's record: left alone
            mine = os.path.join(self.folder, original + self.claim)
            try:
                os.rename(path, mine)  # atomic: of two recovers, one wins and the other finds nothing
            except FileNotFoundError:
                continue
            try:
                claimed.append((mine, read_record(mine)))  # as it was when claimed: the latest ids
            except BadRecord as exc:
                self._set_aside(mine, str(exc))
        return claimed

    def _set_aside(self, path: str, why: str) -> None:
        name = os.path.basename(path).partition(CLAIM_MARK)[0]
        aside = os.path.join(self.folder, name + BAD_SUFFIX)
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        log.warning("ledger record %s %s; moved aside to %s", shown(os.path.basename(path)), why,
                    shown(os.path.basename(aside)))

    def settle(self, claimed: list[tuple[str, Record]], report: FlushReport) -> None:
        """Remove each claimed record whose pairs all flushed; give the others back for a later recover."""
        ok = {(result.server_url, result.instance_id) for result in report.results if result.ok}
        for path, record in claimed:
            try:
                if all((url, instance_id) in ok for url in record.urls for instance_id in record.ids):
                    os.unlink(path)
                else:
                    os.rename(path, path.partition(self.claim)[0])
            except OSError as exc:
                log.warning("ledger record %s could not be settled: %s", shown(os.path.basename(path)),
                            exc.strerror or type(exc).__name__)


def recover(ledger: str, *, environ: Mapping[str, str] | None = None,
            **options: Unpack[RecoverOptionKwargs]) -> FlushReport:
    """Flush the ids of every trainer in ``ledger`` that is gone; remove the records that flushed.

    Call it at start-up, before arming the watchdog, with the ledger on storage that outlives the
    pod (the checkpoint volume). An owner is gone when, on this host and boot, its pid is dead or
    another process; elsewhere, when its heartbeat is older than three intervals (30 s by
    default). Records of live owners are left alone. The pairs of every gone record are flushed
    in one parallel call (until idle by default); a record whose pairs all flushed is removed,
    the others stay for the next ``recover``. Two recovers at once never flush the same record
    (each claims a record by renaming it). A record that cannot be read is moved aside to
    ``*.bad`` with one warning naming the file.

    Args:
        ledger: the ledger directory. Missing or empty: nothing to do.
        environ: the environment to read the bearer from instead of ``os.environ`` (the records
            hold none).
        **options: as for ``abort`` but ``linger`` and ``ledger``; ``until_idle`` defaults to True.

    Returns:
        The ``FlushReport`` of every pair flushed (empty when nothing was to do). A ledger that
        cannot be listed is reported in ``report.error``.

    Raises:
        ConfigError: ``ledger`` is not a path, or a bad option. Never for a bad ledger.

    Example:
        >>> recover("/checkpoints/swe-flush-ledger").ok  # doctest: +SKIP
    """
    if not isinstance(ledger, str) or not ledger.strip() or "\0" in ledger:
        raise ConfigError("ledger must be a directory path (a non-empty str)")
    options.setdefault("until_idle", True)
    flush_options = FlushOptions(**options, linger=0.0)
    started = time.monotonic()
    if not os.path.isdir(ledger):
        return FlushReport(elapsed=time.monotonic() - started)
    try:
        book = _Ledger(ledger)
        claimed = book.candidates(time.time())
    except OSError as exc:
        report = FlushReport(elapsed=time.monotonic() - started,
                             error=f"the ledger cannot be read: {exc.strerror or type(exc).__name__}")
        log_report(report)
        return report
    if not claimed:
        return FlushReport(elapsed=time.monotonic() - started)
    if flush_options.bearer_provider is None:
        flush_options = dataclasses.replace(flush_options, bearer=resolve_bearer(os.environ if environ is None
                                                                                 else environ))
    report = _flush_records([record for _, record in claimed], flush_options)
    book.settle(claimed, report)
    report = FlushReport(results=report.results, elapsed=time.monotonic() - started)
    log_report(report)
    return report


def _flush_records(records: list[Record], options: FlushOptions) -> FlushReport:
    """One parallel flush of every record's pairs: one call per distinct set of servers, all at once."""
    groups: dict[tuple[str, ...], dict[str, None]] = {}
    for record in records:
        groups.setdefault(record.urls, {}).update(dict.fromkeys(record.ids))

    def flush_group(urls: tuple[str, ...], ids: dict[str, None]) -> FlushReport:
        with Flusher.from_options(urls, options) as flusher:
            return flusher._flush_ids(tuple(ids), options.deadline)  # logged once, by recover

    with ThreadPoolExecutor(len(groups), thread_name_prefix="swe-flush-recover") as pool:
        reports = list(pool.map(flush_group, groups.keys(), groups.values()))
    results: tuple[FlushResult, ...] = tuple(result for report in reports for result in report.results)
    return FlushReport(results=results)
