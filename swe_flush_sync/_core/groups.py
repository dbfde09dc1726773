"""``flush_groups``: several sets of servers flushed at once, each set with the same ids and options
(a recover's records, a dead trainer's state, a guard's dead trainers)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from .flusher import Flusher
from .options import FlushOptions
from .report import FlushReport
from .resolve import normalize_instance_ids
from .threads import Runner, block_signals


def flush_groups(groups: Mapping[tuple[str, ...], Iterable[str]], options: FlushOptions,
                 workers: Runner | None = None) -> FlushReport:
    """Flush each set of servers' ids, logging nothing: every set at once on threads of its own, or
    one after another on ``workers`` (a guard's shared HTTP workers)."""
    started = time.monotonic()

    def flush_group(urls: tuple[str, ...], ids: Iterable[str]) -> FlushReport:
        with Flusher.from_options(urls, options) as flusher:
            return flusher._flush_ids(normalize_instance_ids(list(ids)), options.deadline, workers=workers)

    if workers is not None:
        reports = [flush_group(urls, ids) for urls, ids in groups.items()]
    else:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="swe-flush-group", initializer=block_signals) as pool:
            reports = list(pool.map(flush_group, groups.keys(), groups.values()))
    return FlushReport(results=tuple(result for report in reports for result in report.results),
                       elapsed=time.monotonic() - started)
