"""``flush_groups``: several sets of servers flushed at once, each set with the same ids and options
(a recover's records, a dead trainer's state, a guard's dead trainers)."""

from __future__ import annotations

import contextlib
import functools
import queue
import time
from collections.abc import Iterable, Mapping
from typing import Final

from .flusher import Flusher
from .options import FlushOptions
from .outcome import Outcome
from .report import FlushReport, never_sent
from .resolve import normalize_instance_ids
from .threads import Inbox, Runner, Workers

GROUP_WAIT_MARGIN: Final = 5.0  # seconds past a group's deadline and linger before its report is taken as lost


def flush_groups(groups: Mapping[tuple[str, ...], Iterable[str]], options: FlushOptions,
                 workers: Runner | None = None) -> FlushReport:
    """Flush each set of servers' ids, logging nothing: every set at once on threads of its own, or
    one after another on ``workers`` (a guard's shared HTTP workers). No lock lies on the way (the
    groups' threads are ``Workers``, the wait an ``Inbox``): a signal handler may recover meanwhile."""
    started = time.monotonic()
    sets = [(urls, normalize_instance_ids(list(ids))) for urls, ids in groups.items()]

    def flush_group(urls: tuple[str, ...], ids: tuple[str, ...]) -> FlushReport:
        with Flusher.from_options(urls, options) as flusher:
            return flusher._flush_ids(ids, options.deadline, workers=workers)

    if workers is not None or len(sets) <= 1:
        reports = [flush_group(urls, ids) for urls, ids in sets]
    else:
        runner, done = Workers("swe-flush-group", len(sets)), Inbox[None]()
        futures: list[Outcome[FlushReport]] = []
        for urls, ids in sets:
            future: Outcome[FlushReport] = Outcome()
            future.add_done_callback(lambda _: done.put(None))
            runner.run(future, functools.partial(flush_group, urls, ids))
            futures.append(future)
        runner.stop()  # its threads end once their group is flushed
        with contextlib.suppress(queue.Empty):  # each group ends by its deadline (a flush's promise): a bug's margin
            for _ in futures:
                done.get(options.deadline + GROUP_WAIT_MARGIN)
        reports = [future.result() if future.done() else _unfinished(urls, ids, time.monotonic() - started)
                   for future, (urls, ids) in zip(futures, sets, strict=True)]
    return FlushReport(results=tuple(result for report in reports for result in report.results),
                       elapsed=time.monotonic() - started)


def _unfinished(urls: tuple[str, ...], ids: tuple[str, ...], elapsed: float) -> FlushReport:
    return FlushReport(results=tuple(result for url in urls for result in never_sent(
        url, list(ids), elapsed=elapsed, error="the flush did not end", idle=None)), elapsed=elapsed)
