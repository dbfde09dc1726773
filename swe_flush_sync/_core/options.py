"""``FlushOptions``: every tunable of a flush, validated once, immutable, shared by every entry point."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, TypedDict

from .auth import BearerProvider, ScopedBearer, StaticBearer
from .errors import ConfigError
from .tls import check_client_cert, check_path

DEFAULT_DEADLINE: Final = 10.0
"""Seconds a flush may take when no ``deadline`` is given (every entry point's default)."""
DEFAULT_RETRIES: Final = 3
DEFAULT_MAX_WORKERS: Final = 256
DEFAULT_CONNECT_TIMEOUT: Final = 3.0
DEFAULT_BACKOFF_FACTOR: Final = 0.2
DEFAULT_LINGER: Final = 120.0
MAX_SECONDS: Final = 3600.0
MAX_RETRIES: Final = 100
MAX_WORKERS: Final = 4096
MAX_BACKOFF_FACTOR: Final = 60.0


def check_seconds(value: object, name: str, *, allow_zero: bool = False) -> float:
    """``value`` as a float in (0, 3600] (``[0, 3600]`` with ``allow_zero``), else ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, not {type(value).__name__}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not low_ok or value > MAX_SECONDS:
        low = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {low} and <= {MAX_SECONDS:g} seconds, got {value!r}")
    return float(value)


def _check_count(value: object, name: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, not {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class FlushOptions:
    """How a flush runs. Validated on construction; compare and hash by value.

    Attributes:
        deadline: seconds a flush call may take before it returns (default 10, at most 3600).
        retries: retries after the first attempt on connection errors and 429/5xx (so at most
            ``retries + 1`` attempts); 0 disables retrying. At most 100.
        max_workers: pairs in flight at once; None: one per pair, up to 256.
        connect_timeout: seconds one TCP connect may take (also clamped to the time left).
        backoff_factor: exponential backoff base in seconds, with as much jitter; 0 to 60.
        linger: seconds a request still unanswered at the deadline stays in flight in the
            background, so that the server's teardown is not cut short and a later flush of
            the same pair joins it instead of sending again (default 120; 0 cuts it at the
            deadline).
        until_idle: flush each server's ids in rounds until a round cancels nothing: after a
            round in which any of a server's ids answered ``cancelled`` > 0, every id of that
            server is flushed again (slots are shared, so one id's flush lets another id's
            queued runs start), until a round answers 0 for all, the deadline, or
            64 rounds. A pass starts only after the pair's previous answer. A
            server that does not say ``cancelled`` gets one pass. Default False: one pass.
        admin_secret: a static bearer secret; shorthand for ``bearer=StaticBearer(secret)``.
        bearer: a bearer provider (instance id -> token), e.g. ``ScopedBearer``; at most one
            of ``admin_secret`` and ``bearer``. Neither: every entry point (``flush``, ``Flusher``,
            ``abort``, the hooks, ``watchdog``, ``recover``, the CLI) uses the environment's
            bearer (``resolve_bearer``), and without one sends no ``Authorization`` header.
        ca_bundle: the CA certificates that https servers are verified against: a PEM file or a
            directory of them (default: ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` or
            ``SSL_CERT_FILE``, then the system store). Verification is never turned off.
        client_cert: a client certificate for servers that require one: a PEM holding the
            certificate and its unencrypted key, or a (certificate, key) pair of paths.
        ledger: a directory where a ``watchdog`` keeps a record of the trainer's servers and
            ids for ``recover()`` after a lost pod or node (default: ``SWE_FLUSH_LEDGER``).
            Accepted by every entry point, so one set of options covers a trainer; only the
            watchdog writes there.

    Raises:
        ConfigError: a value is of the wrong type or out of range; the message names it.
    """

    deadline: float = DEFAULT_DEADLINE
    retries: int = DEFAULT_RETRIES
    max_workers: int | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR
    linger: float = DEFAULT_LINGER
    until_idle: bool = False
    admin_secret: str | None = None
    bearer: BearerProvider | None = None
    ca_bundle: str | None = None
    client_cert: str | tuple[str, str] | None = None
    ledger: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline", check_seconds(self.deadline, "deadline"))
        _check_count(self.retries, "retries", 0, MAX_RETRIES)
        if self.max_workers is not None:
            _check_count(self.max_workers, "max_workers", 1, MAX_WORKERS)
        object.__setattr__(self, "connect_timeout", check_seconds(self.connect_timeout, "connect_timeout"))
        factor = self.backoff_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor <= MAX_BACKOFF_FACTOR:
            raise ConfigError(f"backoff_factor must be a number from 0 to {MAX_BACKOFF_FACTOR:g}, got {factor!r}"
                              if isinstance(factor, (int, float)) else
                              f"backoff_factor must be a number, not {type(factor).__name__}")
        object.__setattr__(self, "backoff_factor", float(factor))
        object.__setattr__(self, "linger", check_seconds(self.linger, "linger", allow_zero=True))
        if not isinstance(self.until_idle, bool):
            raise ConfigError(f"until_idle must be a bool, not {type(self.until_idle).__name__}")
        if self.admin_secret == "":
            object.__setattr__(self, "admin_secret", None)
        if self.admin_secret is not None:
            if self.bearer is not None:
                raise ConfigError("give admin_secret or bearer, not both")
            StaticBearer(self.admin_secret)  # validates it without ever showing it
        if self.bearer is not None and not callable(self.bearer):
            raise ConfigError(f"bearer must be a callable instance_id -> token, not {type(self.bearer).__name__}")
        if self.ca_bundle is not None:
            check_path(self.ca_bundle, "ca_bundle", directory_ok=True)
        object.__setattr__(self, "client_cert", check_client_cert(self.client_cert))
        if self.ledger is not None and (not isinstance(self.ledger, str) or not self.ledger.strip()
                                        or "\0" in self.ledger):
            raise ConfigError("ledger must be a directory path (a non-empty str)")

    @property
    def bearer_provider(self) -> BearerProvider | None:
        """The provider the flush uses: ``bearer``, or a ``StaticBearer`` of ``admin_secret``."""
        return StaticBearer(self.admin_secret) if self.admin_secret is not None else self.bearer

    @property
    def workers(self) -> int:
        """The worker count: ``max_workers`` or the default."""
        return DEFAULT_MAX_WORKERS if self.max_workers is None else self.max_workers

    def __repr__(self) -> str:
        secret = "None" if self.admin_secret is None else "'***'"
        bearer = "None" if self.bearer is None else (
            repr(self.bearer) if isinstance(self.bearer, (StaticBearer, ScopedBearer)) else type(self.bearer).__name__)
        return (f"FlushOptions(deadline={self.deadline:g}, retries={self.retries}, max_workers={self.max_workers}, "
                f"connect_timeout={self.connect_timeout:g}, backoff_factor={self.backoff_factor:g}, "
                f"linger={self.linger:g}, until_idle={self.until_idle}, admin_secret={secret}, bearer={bearer}, "
                f"ca_bundle={self.ca_bundle!r}, client_cert={self.client_cert!r}, ledger={self.ledger!r})")


class RecoverOptionKwargs(TypedDict, total=False):
    """The keyword options of ``recover``: those of ``FlushOptions`` but ``linger`` and ``ledger``.

    Each entry point takes its set as ``**options: Unpack[...]``, so a misspelt one is a
    ``TypeError`` at the call and a mypy error; ``FlushOptions`` validates the values.
    Keep the keys equal to ``FlushOptions``' fields (a test pins them).
    """

    deadline: float
    retries: int
    max_workers: int | None
    connect_timeout: float
    backoff_factor: float
    until_idle: bool
    admin_secret: str | None
    bearer: BearerProvider | None
    ca_bundle: str | None
    client_cert: str | tuple[str, str] | None


class HookOptionKwargs(RecoverOptionKwargs, total=False):
    """The keyword options of the signal and exit hooks and ``watchdog``: all but ``linger``."""

    ledger: str | None


class OptionKwargs(HookOptionKwargs, total=False):
    """The keyword options of ``Flusher``, ``flush``, ``abort`` and ``abort_async``."""

    linger: float
