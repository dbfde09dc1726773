"""``swe-flush doctor``: will it work here? Checks a trainer's setup before the run.

Run where the trainer runs, with the trainer's environment. Each check gives one line, ``ok``,
``warn`` or ``fail``, and a failing line says what to change. The servers are checked for real:
a ``/flush`` of an id that cannot exist (``cancelled: 0``) proves the server is reachable (TCP
and TLS with the configured CA bundle and client certificate) and takes the bearer, without
ever showing the bearer.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import resource
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from .._core.errors import ConfigError
from .._core.flusher import Flusher
from .._core.options import FlushOptions
from .._core.resolve import (
    RUN_SECRET_ENV_VAR,
    SECRET_ENV_VARS,
    URL_ENV_VARS,
    normalize_server_urls,
    redact_url,
    resolve_bearer,
    resolve_server_urls,
)
from .._core.text import shown
from .._guard.daemon import guard_status
from .._process.trust import directory_problem
from .._watchdog.api import GUARD_ENV_VAR, LEDGER_ENV_VAR
from .._watchdog.guard_client import ImpostorError, connect_to_guard

Status = Literal["ok", "warn", "fail"]
PROBE_DEADLINE: Final = 5.0  # seconds the /flush of each server may take
MIN_FILES: Final = 2048  # a soft descriptor limit below this is warned about
_INITS: Final = ("init", "systemd", "tini", "dumb-init", "catatonit", "docker-init", "s6-svscan", "runit", "pause")


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the doctor's answer."""

    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


def run_checks(urls: list[str] | None = None, guard: str | None = None, ledger: str | None = None,
               environ: Mapping[str, str] | None = None, **tls: Any) -> list[Check]:
    """Every check, in the order a user fixes them: servers, bearer, each server, guard, container,
    ledger, limits, versions. ``tls``: ``ca_bundle`` and ``client_cert``, as for ``flush``."""
    env = os.environ if environ is None else environ
    checks: list[Check] = []
    servers = _servers(urls, env, checks)
    bearer = _bearer(env, checks)
    bearer_failed = checks[-1].status == "fail"  # a server's 401 then follows from it: said so, not advised again
    sources = _bearer_sources(env)
    for url in servers:
        checks.append(_server(url, bearer, tls, bearer_failed, sources))
    guard_path = guard if guard is not None else (env.get(GUARD_ENV_VAR) or "").strip() or None
    guarded = _guard(guard_path, checks, "--guard" if guard is not None else GUARD_ENV_VAR)
    checks.append(_container(guarded))
    checks.append(_ledger(ledger if ledger is not None else (env.get(LEDGER_ENV_VAR) or "").strip() or None,
                          "--ledger" if ledger is not None else LEDGER_ENV_VAR))
    checks.append(_files())
    checks.extend(_versions())
    return checks


def _servers(urls: list[str] | None, env: Mapping[str, str], checks: list[Check]) -> tuple[str, ...]:
    try:
        if urls:
            servers, source = normalize_server_urls(urls, "--url"), "--url"
        else:
            servers = resolve_server_urls(env)
            source = next((name for name in URL_ENV_VARS if (env.get(name) or "").strip()), "")
    except ConfigError as exc:
        checks.append(Check("servers", "fail", f"{exc}"))
        return ()
    if not servers:
        checks.append(Check("servers", "fail", f"no agent server configured: set {URL_ENV_VARS[0]} (comma-separated "
                                               "URLs, one per node) or pass --url"))
        return ()
    checks.append(Check("servers", "ok", f"{len(servers)} from {source}: "
                                         f"{', '.join(redact_url(url) for url in servers)}"))
    return servers


def _bearer(env: Mapping[str, str], checks: list[Check]) -> Any:
    try:
        provider = resolve_bearer(env)
    except ConfigError as exc:
        checks.append(Check("bearer", "fail", str(exc)))
        return None
    sources = _bearer_sources(env)
    source = sources[0] if sources else None
    also = f" (it takes priority over {', '.join(sources[1:])}, also set)" if len(sources) > 1 else ""
    if provider is None:
        checks.append(Check("bearer", "warn", f"none set ({', '.join((*SECRET_ENV_VARS, RUN_SECRET_ENV_VAR))} "
                                              "unset): only a server without auth accepts /flush"))
    elif source == RUN_SECRET_ENV_VAR:
        checks.append(Check("bearer", "ok", f"scoped: one bearer per instance, derived from {source}{also}"))
    else:
        checks.append(Check("bearer", "ok", f"static, from {source}{also}"))
    return provider


def _bearer_sources(env: Mapping[str, str]) -> list[str]:
    """The bearer variables set, the one in use (the first, by priority) first."""
    return [name for name in (*SECRET_ENV_VARS, RUN_SECRET_ENV_VAR) if (env.get(name) or "").strip()]


def _server(url: str, bearer: Any, tls: Mapping[str, Any], bearer_failed: bool = False,
            sources: list[str] | None = None) -> Check:
    """One ``/flush`` of an id no trainer has: reachable, TLS, and the bearer, in one request."""
    name = f"server {redact_url(url)}"
    probe = f"swe-flush-doctor-{secrets.token_hex(8)}"  # the scoped bearers' id format
    try:
        options = FlushOptions(deadline=PROBE_DEADLINE, retries=0, until_idle=False, linger=0.0, bearer=bearer, **tls)
        with Flusher.from_options(url, options) as flusher:  # this bearer exactly (None: none, not the environment's)
            report = flusher.flush([probe])
    except ConfigError as exc:
        return Check(name, "fail", str(exc))
    [result] = report.results
    if result.ok:
        said = "" if result.cancelled is None else f", cancelled {result.cancelled}"
        return Check(name, "ok", f"reachable; /flush of an unknown id answered {result.status_code}{said}: the "
                                 "bearer is accepted")
    if result.status_code in (401, 403) and bearer_failed:
        return Check(name, "fail", f"/flush answered {result.status_code}: no bearer was sent, because the bearer "
                                   "check above failed; fix that first")
    if result.status_code in (401, 403) and bearer is None:
        return Check(name, "fail", f"/flush answered {result.status_code} and no bearer is set: set "
                                   f"{SECRET_ENV_VARS[0]} to the server's secret (or {RUN_SECRET_ENV_VAR} for scoped "
                                   "bearers)")
    if result.status_code in (401, 403) and sources and len(sources) > 1:
        return Check(name, "fail", f"/flush answered {result.status_code}: the server refuses the bearer from "
                                   f"{sources[0]}, which takes priority over {', '.join(sources[1:])} (also set): "
                                   f"if {sources[1]} is the right one, unset {sources[0]}; else set {sources[0]} to "
                                   "the server's secret")
    if result.status_code in (401, 403):
        return Check(name, "fail", f"/flush answered {result.status_code}: the server refuses the bearer; set the "
                                   f"one it expects ({SECRET_ENV_VARS[0]}, or {RUN_SECRET_ENV_VAR} for scoped "
                                   "bearers)")
    if result.status_code == 404:
        return Check(name, "fail", "/flush answered 404: no such endpoint at this URL; check the host, port and "
                                   "path prefix")
    if result.status_code is not None and 200 <= result.status_code < 300:
        return Check(name, "fail", f"this URL does not look like an agent server: {result.error}; check the host, "
                                   "port and path prefix")
    if result.status_code is not None:
        return Check(name, "fail", f"/flush answered {result.status_code}: {result.error or 'not 2xx'}; see the "
                                   "server's log for this request")
    return Check(name, "fail", f"not reachable: {result.error or 'no answer'}; {_advice(url, result.error or '')}")


def _advice(url: str, error: str) -> str:
    """What to change when a server does not answer, from what went wrong."""
    if "certificate" in error:
        return ("pass --ca-bundle PATH (or set REQUESTS_CA_BUNDLE) to the CA that signed the server's certificate, "
                "or fix the certificate")
    if error.startswith("TLS error"):
        return "check that the server speaks TLS here, and the TLS options (--ca-bundle, --client-cert)"
    if url.startswith("http://") and ("dropped" in error or "reset" in error):
        return "if the server speaks https, use https:// in the URL"
    if "refused" in error:
        return "nothing listens there: start the agent server, or fix the host and port in the URL"
    return "check that the agent server runs and that this URL reaches it from here"


def _guard(path: str | None, checks: list[Check], source: str) -> bool:
    if path is None:
        checks.append(Check("guard", "ok", f"none configured ({GUARD_ENV_VAR} unset): watchdog() starts a local "
                                           "watchdog"))
        return False
    try:
        with connect_to_guard(path, 2.0):
            pass
    except ImpostorError as exc:
        checks.append(Check("guard", "fail", f"{exc}; run the guard as this user or root"))
        return False
    except OSError as exc:
        checks.append(Check("guard", "fail", f"no guard answers at {shown(path)} (from {source}: "
                                             f"{exc.strerror or exc}); start `swe-flush guard --socket {shown(path)}` "
                                             f"outside the container first, or fix {source}"))
        return False
    status = guard_status(path)
    if status is None:
        checks.append(Check("guard", "fail", f"something listens at {shown(path)} but does not answer as a guard"))
        return False
    if status.draining:
        checks.append(Check("guard", "ok", f"pid {status.pid} answers at {shown(path)}, as an allowed uid, and is "
                                           f"draining: it holds {status.trainers} trainer(s) and arms new ones "
                                           "until a successor takes the path, then hands them over"))
        return True
    checks.append(Check("guard", "ok", f"pid {status.pid} answers at {shown(path)}, as an allowed uid; it holds "
                                       f"{status.trainers} trainer(s)"))
    return True


def _container(guarded: bool) -> Check:
    """What a local watchdog survives here: PID 1's death and a group OOM kill take it along."""
    if guarded:
        return Check("container", "ok", "a guard outside the container covers PID 1's death and group OOM kills")
    init = _comm(1)
    if os.getpid() == 1 or init.startswith("python"):
        who = "this process" if os.getpid() == 1 else f"{init!r}, likely the trainer"
        return Check("container", "fail", f"PID 1 of this PID namespace is {who}: when it dies the kernel kills "
                                          "every process here, a local watchdog included; run `swe-flush guard` "
                                          f"outside the container and set {GUARD_ENV_VAR}")
    if _oom_group():
        return Check("container", "warn", "an OOM kill takes this whole cgroup (memory.oom.group is 1), a local "
                                          f"watchdog included; a guard outside the container ({GUARD_ENV_VAR}) "
                                          "covers it")
    known = "an init" if init in _INITS else "not this process"
    return Check("container", "ok", f"PID 1 is {init!r} ({known}): a local watchdog outlives the trainer")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def _oom_group() -> bool:
    """Is this process's cgroup (v2) killed whole on OOM?"""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            path = next((line.split("::", 1)[1].strip() for line in handle if line.startswith("0::")), None)
        if path is None:
            return False
        with open(f"/sys/fs/cgroup{path.rstrip('/')}/memory.oom.group", encoding="ascii") as handle:
            return handle.read().strip() == "1"
    except OSError:
        return False


def _ledger(folder: str | None, source: str) -> Check:
    if folder is None:
        return Check("ledger", "ok", f"none configured ({LEDGER_ENV_VAR} unset): a lost pod or node is not recovered "
                                     "by recover()")
    name = f"ledger {shown(folder)}"
    if not os.path.exists(folder):
        try:  # as the watchdog or guard would make it (an access() check means nothing to root)
            os.makedirs(folder, mode=0o700)
        except OSError as exc:
            return Check(name, "fail", f"missing (from {source}), and it cannot be made ({exc.strerror or exc}): make "
                                       f"it, owned by this user, or fix {source}")
        return Check(name, "ok", f"was missing (from {source}); made it here, mode 0700")
    problem = directory_problem(folder)
    if problem is not None:
        return Check(name, "fail", f"the directory (from {source}) {problem}; recover() would not trust it: make it "
                                   "owned by this user and writable by no one else (chmod 700)")
    if not os.access(folder, os.W_OK | os.X_OK):
        return Check(name, "fail", f"not writable by this user (from {source}): chown it to this user")
    return Check(name, "ok", "owned by this user (or root), writable by no one else, writable here")


def _files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < MIN_FILES:
        return Check("open files", "warn", f"soft limit {soft} (hard {hard}): a flush opens up to 256 sockets at once "
                                           f"besides the trainer's own files; raise it (ulimit -n {min(hard, 65536)})")
    return Check("open files", "ok", f"soft limit {soft}")


def tested_pythons() -> list[tuple[int, int]]:
    """The Python versions this package is tested on: its classifiers, read from its installed metadata
    (one list, so the check below and the package's page cannot drift); empty when not installed."""
    try:
        classifiers = importlib.metadata.metadata("swe_flush_sync").get_all("Classifier") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = (re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", classifier) for classifier in classifiers)
    return sorted((3, int(match.group(1))) for match in found if match)


def _versions() -> list[Check]:
    python = platform.python_version()
    tested = tested_pythons()
    if sys.version_info[:2] in tested:
        checks = [Check("python", "ok", python)]
    else:
        span = f"3.{tested[0][1]} to 3.{tested[-1][1]}" if tested else "unknown: the package's metadata is missing"
        checks = [Check("python", "warn", f"{python} (tested: {span})")]
    for name, floor, ceiling in (("requests", (2, 30), (99,)), ("urllib3", (2, 0), (3,))):
        version = importlib.metadata.version(name)
        parts = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
        fine = floor <= parts < ceiling
        checks.append(Check(name, "ok" if fine else "warn", version if fine else f"{version} (outside the declared "
                                                                                 "range)"))
    return checks


def failed(checks: list[Check]) -> bool:
    """Did any check fail?"""
    return any(check.status == "fail" for check in checks)

