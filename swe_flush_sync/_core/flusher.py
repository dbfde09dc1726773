"""``Flusher``: one future per (server, id) pair, a deadline kept by the calling thread, single flight.

Pairs go to the Flusher's ``Workers`` interleaved across servers, as its threads take them (a pass
larger than the window is fed by the calling thread, which then waits for room); the calling
thread waits on a queue of its own and reports what is unfinished at the deadline. A request still
unanswered then lingers (up to ``linger`` s): a later flush of the pair joins it rather than
cancel the server's teardown a second time. Only the sending call holds a request's
``CancelToken``; a joiner never gives it up. Lingering requests never keep a fresh pair from
a worker: the oldest are given up to make room. With ``until_idle``, each server's pairs are
flushed in rounds until a round cancels nothing. Signal and exit hooks pass their own ``Workers``
(threads started when they were installed); a forked child forgets the parent's pools and workers.

Signal safety: a signal handler may flush while the thread it interrupted is inside a flush of the
same Flusher. No lock lies on the way to the workers (see ``threads``): the in-flight map is kept
with single ``dict`` operations (``setdefault`` claims a pair, ``pop`` forgets one), each atomic, so
an interrupted call never leaves it half changed; a call waits for answers on its own
``SimpleQueue``. A signal handler never waits on a request that the call it interrupted claimed and
has yet to hand to a worker (another thread's, it joins). What this gives up: two calls that find a
pair's old request finished at the very same moment may both send it (a ``pop`` and a
``setdefault`` apart), and so may a handler and the call it interrupted.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from . import live
from .auth import check_token
from .cancel import CancelToken
from .errors import ConfigError, FlushError
from .logs import WORKER_THREAD_PREFIX, install_urllib3_filter, log_report
from .options import FlushOptions, check_seconds
from .outcome import Outcome
from .report import FlushReport, FlushResult, collector_paused, never_sent
from .resolve import normalize_instance_ids, normalize_server_urls, resolve_bearer
from .threads import Inbox, Runner, Workers
from .transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import OptionKwargs

Pair = tuple[str, str]  # (server url, instance id)
Call = Callable[[], FlushResult]  # one request, bound to its pair and token
# Sending stops when the time left is what reporting takes: a result made for each pair still unsent,
# then the report of every pair sent; the wait for answers ends when the time left is what that report
# takes (the requests still out are given up after it, so that no woken worker slows it). Each is
# measured in CPU seconds of the calling thread a pair whenever a call does it (each new measurement
# weighing MEASURE_WEIGHT), which the size of a call and passing stalls barely change, and scaled by how
# much longer than its CPU time this call's own set-up took: the share of a core the trainer's other
# threads and the host leave the call now. Until a call has measured them, each is FIRST_REPORT_FACTOR
# times what setting a pair up took, at most FIRST_REPORT_MAX, and the report's is counted for every
# pair (a fresh process's first call also pays for what it imports).
FIRST_REPORT_FACTOR: Final = 2.0
FIRST_REPORT_MAX: Final = 5e-6  # a loaded 2-core host measured 3-5 µs (a first call's set-up, slowed by
# the trainer's other threads, once guessed past a whole 5 s deadline at 100,000 ids)
MEASURE_WEIGHT: Final = 0.5
TIMED_SET_UP: Final = 1e-3  # CPU seconds a set-up takes to tell the host's slowdown: a shorter one (under
# about 2,000 pairs) preempted once would scale the costs a hundredfold, cutting a small call's wait for answers
QUEUED_PER_WORKER: Final = 2  # pairs handed to the workers ahead of each worker thread
MAX_ROUNDS: Final = 64  # passes per pair at most with until_idle (the deadline usually ends them first)


class _Pending(NamedTuple):
    """A request some call sent for a pair: its future, and the sender's cancel token."""

    future: Outcome[FlushResult]
    token: CancelToken


@dataclass(slots=True, eq=False)
class _Track:
    """One pair within one call: what it waits on now, and the passes answered so far."""

    pair: Pair
    pending: _Pending | None = None
    joined: bool = False  # ``pending`` was sent by another call
    passes: list[FlushResult] = field(default_factory=list)
    final: FlushResult | None = None  # set when the pair needs no more passes


class _Costs(NamedTuple):
    unsent: float  # seconds a result for a pair left unsent takes to make (CPU seconds, in ``_measured``)
    report: float  # seconds a sent pair takes to report (one never sent is reported as it is made)
    guessed: bool  # nothing measured yet: the report's guess is counted for every pair, sent or not


class _Call(NamedTuple):
    """One flush call: its pairs, when it ends, whether it repeats until idle, who runs its requests."""

    tracks: dict[Pair, _Track]
    started: float
    deadline_at: float
    until_idle: bool
    workers: Runner
    hook: bool  # a signal or exit hook's call: nothing lingering is given up for room
    rounds: dict[str, int]  # per server, the rounds started
    by_server: dict[str, list[_Track]]  # the tracks of each server
    waiting: dict[str, int]  # per server still going, the answers its round still waits for
    answers: Inbox[str]  # this call's own: the server of each request answered (its callbacks put)
    costs: _Costs  # seconds a result for an unsent pair, and a sent pair's report, are expected to take now
    made: list[float]  # [CPU seconds making results for unsent pairs, how many] once a pass stops early


class Flusher:
    """Flushes instance ids on agent servers in parallel, within a deadline; reusable.

    Keeps one ``requests.Session`` (pool sized to the workers) and its worker threads
    across calls: build it once, call ``flush`` every step. Thread-, fork- and signal-safe (a signal
    handler may flush while the thread it interrupted is inside ``flush``); a context manager.

    Args:
        server_urls: an agent server URL, a comma-separated list, or a sequence of URLs.
        **options: the options of ``FlushOptions`` (``deadline``: 10 s by default, ``linger``,
            ``until_idle``, ``admin_secret``/``bearer``, ...); a misspelt one is a ``TypeError``.
            Neither ``admin_secret`` nor ``bearer``: the environment's bearer, as every entry point
            reads it (``HARBOR_ADMIN_SECRET`` and its fallbacks, then ``HARBOR_RUN_SECRET``); none
            there: no ``Authorization`` header.

    Raises:
        ConfigError: an option, or the environment's secret, is invalid; the message names it.

    Examples:
        ```python
        with Flusher("http://agent:8000", admin_secret=secret) as flusher:
            report = flusher.flush(["inst-1", "inst-2"], deadline=5)
        ```
    Not guaranteed: a worker blocked in a DNS lookup or a TCP connect can outlive the deadline
    by the resolver's timeout or ``connect_timeout``; its pair is already reported.
    """

    def __init__(self, server_urls: str | Sequence[str], **options: Unpack[OptionKwargs]) -> None:
        flush_options = FlushOptions(**options)
        if flush_options.admin_secret is None and flush_options.bearer is None:  # the one bearer rule
            flush_options = dataclasses.replace(flush_options, bearer=resolve_bearer())
        self._setup(normalize_server_urls(server_urls), flush_options)

    @classmethod
    def from_options(cls, server_urls: str | Sequence[str], options: FlushOptions) -> Flusher:
        """A Flusher for ``server_urls`` with ready-made ``options``."""
        flusher = cls.__new__(cls)
        flusher._setup(normalize_server_urls(server_urls), options)
        return flusher

    def _setup(self, urls: tuple[str, ...], options: FlushOptions) -> None:
        self._urls = urls
        self._options = options
        self._bearer = options.bearer_provider
        self._inflight: dict[Pair, _Pending] = {}  # single ``dict`` operations only (see the module docstring)
        self._transport: Transport | None = None
        self._workers = Workers(WORKER_THREAD_PREFIX, options.workers)
        self._closed = False
        self._live_key = live.register(self)

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The agent servers this Flusher posts to."""
        return self._urls

    @property
    def options(self) -> FlushOptions:
        """The validated options."""
        return self._options

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def flush(self, instance_ids: str | Iterable[str] | Mapping[Any, str], *,
              deadline: float | None = None, until_idle: bool | None = None) -> FlushReport:
        """POST ``/flush`` for every (server, id) pair in parallel, within ``deadline`` plus a few ms.

        A pair whose earlier request is still in flight is not sent again: this call waits on it
        and reports its answer with ``joined=True``.

        Args:
            instance_ids: an id, an iterable of ids, or a Mapping whose values are ids (deduplicated;
                None and "" dropped).
            deadline: seconds for this call; the Flusher's default when None.
            until_idle: repeat each server's rounds until idle in this call (see ``FlushOptions``);
                the Flusher's default when None. A one-pass call and an until-idle call share the
                Flusher's requests in flight: either joins the other's.

        Returns:
            A ``FlushReport``, one result per pair, server-major; unfinished pairs fail saying so.

        Raises:
            ConfigError: a bad id or deadline. FlushError: the Flusher is closed.
        """
        started = time.monotonic()
        ids = normalize_instance_ids(instance_ids)
        budget = self._options.deadline if deadline is None else check_seconds(deadline, "deadline")
        if until_idle is not None and not isinstance(until_idle, bool):
            raise ConfigError(f"until_idle must be a bool, not {type(until_idle).__name__}")
        return self._flush_ids(ids, budget, until_idle=until_idle, started=started, log=True)  # counted from the call

    def _flush_ids(self, ids: tuple[str, ...], budget: float, *, until_idle: bool | None = None,
                   workers: Runner | None = None, started: float | None = None, log: bool = False) -> FlushReport:
        """``flush`` of validated ids, ``budget`` seconds from ``started`` (default: now), logging the report
        if ``log``; ``workers`` (the signal and exit hooks' threads) run the requests instead of the
        Flusher's own, and nothing lingering is given up for room."""
        started = time.monotonic() if started is None else started
        setting_up, set_up_cpu = time.monotonic(), time.thread_time()
        tracks = {pair: _Track(pair) for pair in ((url, i) for i in ids for url in self._urls)}  # interleaved
        repeat = self._options.until_idle if until_idle is None else until_idle
        by_server: dict[str, list[_Track]] = {url: [] for url in self._urls} | _by_server(list(tracks.values()))
        set_up_cpu = max(time.thread_time() - set_up_cpu, 1e-9)
        slowdown = max((time.monotonic() - setting_up) / set_up_cpu, 1.0) if set_up_cpu >= TIMED_SET_UP else 1.0
        guess = min(FIRST_REPORT_FACTOR * slowdown * set_up_cpu / max(len(tracks), 1), FIRST_REPORT_MAX)
        costs = _Costs(slowdown * _measured.unsent if _measured.unsent else guess,
                       slowdown * _measured.report if _measured.report else guess, not _measured.report)
        call = _Call(tracks, started, started + budget, repeat, workers or self._workers, workers is not None,
                     dict.fromkeys(self._urls, 1), by_server, {}, Inbox(), costs, [0.0, 0])
        if not call.tracks:
            report = FlushReport(elapsed=time.monotonic() - started)
            if log:
                log_report(report)
            return report
        # Each server's round is counted down by its answers: a server's next round never waits for
        # another server, and no answer costs a scan of every pair.
        try:
            if not self._send_pass(list(call.tracks.values()), call):
                raise FlushError("this Flusher is closed")
            while call.waiting:  # until the time left is what the report takes, while the workers still wait
                left = call.deadline_at - time.monotonic() - call.costs.report * _reported(call)
                if left <= 0:
                    break
                try:
                    url = call.answers.get(timeout=left)
                except queue.Empty:
                    break
                call.waiting[url] -= 1
                if not call.waiting[url]:
                    del call.waiting[url]
                    self._end_round_if_answered(url, call)
        except BaseException:  # Ctrl-C or any other exception here: give up what this call sent, re-raise
            for track in call.tracks.values():
                if track.pending is not None and not track.joined:
                    _give_up(track.pending, "interrupted")
            raise
        reporting = time.thread_time()
        giving_up: list[_Pending] = []  # given up once reported and logged: no woken worker slows either
        try:
            with collector_paused():
                results = tuple(self._result(track, call, giving_up) if track.final is None else track.final
                                for url in self._urls for track in call.by_server[url])
            report = FlushReport(results=results, elapsed=time.monotonic() - started)
            if log:
                log_report(report)
        finally:
            for pending in giving_up:
                _give_up(pending, "deadline passed")  # (a token cancelled already keeps its first reason)
        sent = max(len(results) - call.made[1], 1)
        _measured.report = _measured.weigh(_measured.report, (time.thread_time() - reporting) / sent)
        if call.made[1]:
            _measured.unsent = _measured.weigh(_measured.unsent, call.made[0] / call.made[1])
        return report

    def _end_round_if_answered(self, url: str, call: _Call) -> None:
        """All pairs of ``url`` in this round are answered: end them, or start the next round."""
        going = [t for t in call.by_server[url] if t.final is None]
        for track in going:
            if track.pending is not None:
                track.passes.append(_answer(track, track.pending))
                track.pending = None
        counting = [t for t in going if t.passes[-1].ok and t.passes[-1].cancelled is not None]
        counted = set(map(id, counting))
        cut = call.until_idle and time.monotonic() >= call.deadline_at  # a pass failed at the deadline: not idle
        for track in going:  # a failed pass, or a server that does not count, ends the pair
            if id(track) not in counted or not call.until_idle:
                track.final = _merged(track.passes, idle=False if cut and not track.passes[-1].ok else None)
        if not counting or not call.until_idle:
            return
        busy = any(t.passes[-1].cancelled for t in counting)
        if busy and call.rounds[url] < MAX_ROUNDS and time.monotonic() < call.deadline_at:
            call.rounds[url] += 1
            self._send_pass(counting, call)  # (a closed Flusher sends nothing: the pairs end with this round)
            return
        for track in counting:  # idle: the round cancelled nothing; else the cap or the deadline stopped it
            track.final = _merged(track.passes, idle=not busy)

    def _send_pass(self, tracks: list[_Track], call: _Call) -> bool:
        """Join or send one pass of each track; False if the Flusher is closed. Pairs go out as the
        workers take them, at most ``QUEUED_PER_WORKER`` a worker queued ahead, so that what the
        deadline finds unsent was never prepared and ends at once saying so (as does a pair without
        a bearer). Sending stops when the time left is what reporting the pairs still unsent takes.
        Each server's round is then counted down by its answers."""
        if self._closed:
            return False
        self._forget_finished()  # answered requests are not joined: their pairs are sent afresh
        fresh = [track for track in tracks if not self._joined(track)]
        if not call.hook:  # the hooks gave every lingering request up already
            self._make_room(len(fresh))
        transport = self._transport_now()
        room: Inbox[None] = Inbox()  # C-level: a Ctrl-C in a wait leaves no lock held
        for _ in range(QUEUED_PER_WORKER * self._options.workers):
            room.put(None)
        sent, why = 0, "deadline passed"
        for track in fresh:
            unsent = len(fresh) - sent
            reported = len(call.tracks) if call.costs.guessed else len(call.tracks) - unsent
            left = call.deadline_at - time.monotonic() - call.costs.report * reported - call.costs.unsent * unsent
            if sent and left <= 0:
                break
            try:
                room.get(timeout=max(left, 0.0))
            except queue.Empty:
                break
            if self._closed:
                why = "the Flusher was closed"
                break
            sent += 1
            try:
                authorization = self._authorization(track.pair[1])
            except ConfigError as exc:
                room.put(None)
                track.final = _merged([*track.passes, FlushResult(*track.pair, ok=False, error=str(exc))], idle=None)
                continue
            token = CancelToken(call.deadline_at, call.deadline_at + self._options.linger)
            mine = _Pending(Outcome(), token)
            pending = self._inflight.setdefault(track.pair, mine)  # one atomic step: claim the pair, or join
            if pending is not mine and not _joinable(pending):
                pending = mine  # claimed by the call a signal handler interrupted, never sent: sent again here
            track.pending, track.joined = pending, pending is not mine
            if track.joined:  # another call sent the pair meanwhile
                room.put(None)
                continue
            mine.future.add_done_callback(lambda _: room.put(None))
            post = functools.partial(transport.post, *track.pair, authorization, token)
            if not call.workers.run(mine.future, post, track.pair[0]):
                token.cancel("the Flusher was closed")  # (closed meanwhile by another thread)
            token.handed = True
        if sent < len(fresh):  # stopped: what still waits for a worker is never sent
            for track in fresh[:sent]:  # (first, so that the workers go quiet before the bookkeeping below)
                if track.pending is not None and not track.joined and track.pending.future.cancel():
                    track.pending.token.cancel(why)
        idle = False if call.until_idle else None
        waited = time.monotonic() - call.started  # how long the pairs never sent were kept waiting
        error = f"{why} before it was sent"
        making = time.thread_time()
        with collector_paused():
            for url, never_tracks in _by_server(fresh[sent:]).items():  # never prepared, never sent
                nevers = never_sent(url, [t.pair[1] for t in never_tracks], elapsed=waited, error=error, idle=idle)
                for track, never in zip(never_tracks, nevers, strict=True):
                    track.final = _merged([*track.passes, never], idle=idle) if track.passes else never
        call.made[0] += time.thread_time() - making
        call.made[1] += len(fresh) - sent
        for url in dict.fromkeys(t.pair[0] for t in tracks):
            waiting = [t.pending.future for t in call.by_server[url] if t.final is None and t.pending is not None]
            call.waiting[url] = len(waiting) or 1
            if not waiting:  # nothing to wait for: the round is answered now
                call.answers.put(url)
            for future in waiting:
                future.add_done_callback(lambda _, url=url: call.answers.put(url))  # type: ignore[misc]
        return True

    def _joined(self, track: _Track) -> bool:
        """Single flight: join the pair's request still out, if an earlier call sent one."""
        pending = self._inflight.get(track.pair)
        if pending is None or not _joinable(pending):
            return False
        track.pending, track.joined = pending, True
        return True

    def _forget(self, pair: Pair, pending: _Pending) -> None:
        """Drop ``pending`` from the in-flight map, and nothing that replaced it meanwhile."""
        taken = self._inflight.pop(pair, None)
        if taken is not None and taken is not pending:  # another call's, put there since: put it back
            self._inflight.setdefault(pair, taken)

    def _forget_finished(self) -> None:
        """Drop answered requests from the in-flight map; give up those past their linger."""
        now = time.monotonic()
        for pair, pending in list(self._inflight.items()):
            if pending.future.done():
                self._forget(pair, pending)
            elif pending.token.linger_until <= now:  # a peer that trickles bytes for ever
                _give_up(pending, "linger ran out")
                self._forget(pair, pending)

    def _make_room(self, needed: int) -> None:
        """Give up the oldest lingering requests until ``needed`` fresh pairs each find a worker."""
        now = time.monotonic()
        lingering = sorted((p for p in list(self._inflight.items()) if p[1].token.deadline_at <= now),
                           key=lambda item: item[1].token.deadline_at)
        for pair, pending in lingering[:max(len(self._inflight) + needed - self._options.workers, 0)]:
            _give_up(pending, "given up to make room for fresh pairs")
            self._forget(pair, pending)

    def _authorization(self, instance_id: str) -> str | None:
        if self._bearer is None:
            return None
        try:
            token = self._bearer(instance_id)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's provider; its message could hold anything
            raise ConfigError(f"the bearer provider raised {type(exc).__name__}") from None
        return "Bearer " + check_token(token, "the bearer provider's token")

    def _result(self, track: _Track, call: _Call, giving_up: list[_Pending]) -> FlushResult:
        """The pair's result at the end of the call; a pass still out is reported unfinished (and put in
        ``giving_up`` when it is given up rather than left in flight)."""
        if track.final is not None:
            return track.final
        idle = False if call.until_idle else None
        pending = track.pending
        if pending is None:  # answered, but its server's round was cut by the deadline
            return _merged(track.passes, idle=idle)
        if pending.future.done():
            return _merged([*track.passes, _answer(track, pending)], idle=idle)
        token = pending.token
        reason = token.reason if token.cancelled.is_set() else "deadline passed"
        if track.joined:  # not ours to give up: the call that sent it keeps it
            error = f"{reason} while waiting on the request an earlier call sent"
        elif pending.future.cancel():  # never started
            error = f"{reason} before it was sent"
        elif token.cancelled.is_set() or self._options.linger == 0:
            giving_up.append(pending)
            error = f"{reason} while in flight"
        else:
            token.start_lingering()
            error = f"deadline passed while in flight (left in flight for up to {self._options.linger:g}s)"
        spent = time.monotonic() - call.started - sum(p.elapsed for p in track.passes)  # passes add up to the call
        unfinished = FlushResult(*track.pair, ok=False, attempts=token.attempts, error=error, joined=track.joined,
                                 elapsed=max(spent, 0.0))
        return _merged([*track.passes, unfinished], idle=idle)

    def _transport_now(self) -> Transport:
        transport = self._transport
        if transport is None:  # two calls at once may both build one: the last is kept, the other ends with its call
            install_urllib3_filter()
            transport = self._transport = Transport(self._urls, self._options)
        return transport

    def warm_up(self) -> None:
        """Build the pool and a request now, so that nothing is imported lazily later."""
        self._transport_now().prepare(self._urls[0], "warm-up", None)

    def abandon_in_flight(self, reason: str) -> None:
        """Give up every request in flight or lingering now (sockets shut down). Lock-free."""
        for pending in list(self._inflight.values()):
            _give_up(pending, reason)

    def close(self) -> None:
        """Give up every request in flight, release the pool and the workers; never waits (a flush
        running in another thread returns at once, its pairs failed)."""
        if self._closed:
            return
        self._closed = True
        transport, self._transport = self._transport, None
        self._workers.stop()
        self.abandon_in_flight("the Flusher was closed")
        self._inflight.clear()
        live.unregister(self._live_key)
        if transport is not None:
            transport.close()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's pool, workers and sockets are not ours."""
        self._inflight = {}
        self._transport = None
        self._workers.forget_after_fork()

    def __enter__(self) -> Flusher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Flusher(server_urls={self._urls!r}, options={self._options!r})"


def _by_server(tracks: list[_Track]) -> dict[str, list[_Track]]:
    grouped: dict[str, list[_Track]] = {}
    for track in tracks:
        grouped.setdefault(track.pair[0], []).append(track)
    return grouped


def _reported(call: _Call) -> int:
    """The pairs the call's report is expected to cost: every pair until a report was measured, else
    those sent (the measured cost is a sent pair's share of the whole report)."""
    return len(call.tracks) if call.costs.guessed else max(len(call.tracks) - int(call.made[1]), 1)


def _joinable(pending: _Pending) -> bool:
    """May this call wait on that request? Yes, unless this thread's own call claimed it and has not
    handed it to a worker yet: then this is a signal handler that interrupted that call, which cannot
    go on to hand it over while the handler waits. (Another thread's call hands it over in a moment.)"""
    token = pending.token
    return token.handed or token.claimer != threading.get_ident() or pending.future.done()


def _give_up(pending: _Pending, reason: str) -> None:
    pending.future.cancel()
    pending.token.cancel(reason)


def _answer(track: _Track, pending: _Pending) -> FlushResult:
    """The result of the track's finished request; one cancelled before it started, as a failure."""
    future, token = pending.future, pending.token
    if future.cancelled():
        return FlushResult(*track.pair, ok=False, error=f"{token.reason} before it was sent", joined=track.joined)
    result = future.result()  # Transport.post returns failures; an exception here is a bug, and raises
    return dataclasses.replace(result, joined=True) if track.joined else result


def _merged(passes: list[FlushResult], *, idle: bool | None) -> FlushResult:
    """One result of a pair's passes: the last one's outcome, counts summed over all of them."""
    if len(passes) == 1 and idle is None:
        return passes[0]
    counts = [p.cancelled for p in passes if p.cancelled is not None]
    return dataclasses.replace(
        passes[-1], cancelled=sum(counts) if counts else None, attempts=sum(p.attempts for p in passes),
        elapsed=sum(p.elapsed for p in passes), passes=sum(p.passes for p in passes), idle=idle,
        joined=all(p.joined for p in passes))


def flush(server_urls: str | Sequence[str], instance_ids: str | Iterable[str] | Mapping[Any, str],
          **options: Unpack[OptionKwargs]) -> FlushReport:
    """One-shot flush: build a ``Flusher``, flush ``instance_ids``, close it; returns the ``FlushReport``.

    Arguments as for ``Flusher`` and ``Flusher.flush``; ``linger`` defaults to 0 here (the pool
    closes with the call). Raises ``ConfigError`` on bad URLs, ids or options.

    Examples:
        ```python
        flush("http://agent:8000", ["inst-1"], deadline=5).raise_for_failures()
        ```
    """
    options.setdefault("linger", 0.0)
    with Flusher(server_urls, **options) as flusher:
        return flusher.flush(instance_ids)


class _measured:
    """What this host was last measured to take, in CPU seconds of the calling thread: a result made
    for an unsent pair, the report of a pair sent."""

    unsent: float | None = None
    report: float | None = None

    @staticmethod
    def weigh(before: float | None, measured: float) -> float:
        return measured if before is None else before + MEASURE_WEIGHT * (measured - before)
