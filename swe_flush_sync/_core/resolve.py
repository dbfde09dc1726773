"""Resolution of what to flush: instance ids from trainer args, server URLs and the secret.

Owns the environment variable names, URL validation and the redaction of URL userinfo.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

from .auth import ScopedBearer, StaticBearer
from .errors import ConfigError
from .text import shown

PLURAL_ATTR: Final = "session_server_instance_ids"
SINGULAR_ATTR: Final = "session_server_instance_id"

URL_ENV_VARS: Final = ("AGENT_SERVER_URL", "SWE_AGENT_URL")
SECRET_ENV_VARS: Final = ("HARBOR_ADMIN_SECRET", "MILES_HARBOR_AUTH_TOKEN", "AGENT_SERVER_AUTH_TOKEN")
RUN_SECRET_ENV_VAR: Final = "HARBOR_RUN_SECRET"

_MISSING: Final = object()


def resolve_instance_ids(args: Any) -> tuple[str, ...]:
    """Return the deduplicated session-server instance ids held by trainer ``args``.

    Reads ``session_server_instance_ids`` first (a Mapping such as port -> id, whose VALUES are
    the ids, or any iterable of ids), then the singular ``session_server_instance_id``.

    Args:
        args: any object with those attributes (an ``argparse.Namespace``) or a Mapping with
            those keys. One of the two must be present; either may be None.

    Returns:
        The ids in first-seen order, duplicates removed; None and "" are skipped.

    Raises:
        ConfigError: neither name is present, reading one raised, the plural value is not a
            Mapping or iterable, or an id is not a str.

    Examples:
        ```python
        resolve_instance_ids({"session_server_instance_ids": {8000: "a", 8001: "b"},
                              "session_server_instance_id": "a"})
        # ('a', 'b')
        ```
    """
    ids, bad = split_instance_ids(args)
    if bad:
        raise ConfigError(f"{bad[0].field} holds an id of type {bad[0].kind} ({bad[0].value}); ids must be str")
    return ids


class BadId(NamedTuple):
    """An id of ``args`` that is not a str: where it is (``field``, and its ``key`` in the plural map)."""

    field: str
    key: str | None  # the map's key (repr) or the iterable's index; None for the singular field
    kind: str  # its type's name
    value: str  # its repr, cut to 40 characters

    def why(self) -> str:
        where = self.field if self.key is None else f"{self.field}[{self.key}]"
        article = "an" if self.kind[:1] in tuple("aeiou") else "a"
        return f"{where} is {article} {self.kind} ({self.value}), not a str: not flushed"


def split_instance_ids(args: Any) -> tuple[tuple[str, ...], tuple[BadId, ...]]:
    """``resolve_instance_ids``, with each id that is not a str set aside instead of raised: the good
    ids (deduplicated, first-seen order) and the bad ones, each naming where it was.

    Raises:
        ConfigError: neither name is present, reading one raised, or the plural value is not a
            Mapping or iterable.
    """
    plural, singular = _read_field(args, PLURAL_ATTR), _read_field(args, SINGULAR_ATTR)
    if plural is _MISSING and singular is _MISSING:
        raise ConfigError(f"args has neither {PLURAL_ATTR!r} nor {SINGULAR_ATTR!r} (got {type(args).__name__})")
    ids: dict[str, None] = {}
    bad: list[BadId] = []
    if plural is not _MISSING and plural is not None:
        values = _iter_plural(plural)
        for value in values:  # no object made per id: a trainer may hand thousands over every step
            if isinstance(value, str):
                if value:
                    ids[value] = None
            elif value is not None:
                bad.append(BadId(PLURAL_ATTR, None, type(value).__name__, f"{value!r:.40}"))
        if bad:  # (rare) where each one was: its key in the map, or its index
            keys = list(plural) if isinstance(plural, Mapping) else range(len(values))
            bad = [BadId(PLURAL_ATTR, f"{key!r:.40}", type(value).__name__, f"{value!r:.40}")
                   for key, value in zip(keys, values, strict=False)
                   if not isinstance(value, str) and value is not None]
    if singular is not _MISSING and singular is not None and singular != "":
        if isinstance(singular, str):
            ids[singular] = None
        else:
            bad.append(BadId(SINGULAR_ATTR, None, type(singular).__name__, f"{singular!r:.40}"))
    return tuple(ids), tuple(bad)


def normalize_instance_ids(instance_ids: str | Iterable[str] | Mapping[Any, str]) -> tuple[str, ...]:
    """Ids given directly to ``flush``: one str, a Mapping (values) or an iterable; deduplicated."""
    ids: dict[str, None] = {}
    values = (instance_ids,) if isinstance(instance_ids, str) else _iter_plural(instance_ids, "instance_ids")
    for value in values:
        _add_id(ids, value, "instance_ids")
    return tuple(ids)


def _read_field(args: Any, name: str) -> Any:
    """One field of ``args`` by key or attribute, ``_MISSING`` when absent."""
    try:
        if isinstance(args, Mapping):
            return args.get(name, _MISSING)
        return getattr(args, name, _MISSING)
    except Exception as exc:  # noqa: BLE001 - a property or __getattr__ that raises
        raise ConfigError(f"reading {name!r} from args raised {type(exc).__name__}") from None


def _iter_plural(value: Any, name: str = PLURAL_ATTR) -> list[Any]:
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"{name} must be a mapping of port -> id or an iterable of ids, "
            f"not {type(value).__name__}"
        )
    try:
        return list(value)
    except Exception as exc:  # noqa: BLE001 - a user iterable that raises
        raise ConfigError(f"iterating {name} raised {type(exc).__name__}") from None


def _add_id(ids: dict[str, None], value: Any, name: str) -> None:
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise ConfigError(f"{name} holds an id of type {type(value).__name__} ({value!r:.40}); ids must be str")
    ids[value] = None


def resolve_server_urls(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Return the agent server URLs configured in the environment.

    ``AGENT_SERVER_URL`` is read, else ``SWE_AGENT_URL``; a blank value counts as unset. A
    value may hold several URLs separated by commas (one agent server per node).

    Args:
        environ: the mapping to read; ``os.environ`` by default.

    Returns:
        The URLs, each without trailing ``/``, duplicates removed, order kept; ``()`` if unset.

    Raises:
        ConfigError: a URL is not an absolute http(s) URL with a host, or carries
            credentials, a query or a fragment. The message names the variable and shows
            the URL with any ``user:pass@`` replaced by ``***@``.

    Examples:
        ```python
        resolve_server_urls({"AGENT_SERVER_URL": "http://node1:8000/, http://node2:8000"})
        # ('http://node1:8000', 'http://node2:8000')
        ```
    """
    env = os.environ if environ is None else environ
    for var in URL_ENV_VARS:
        value = env.get(var)
        if value is not None and value.strip():
            return normalize_server_urls(value, var)
    return ()


def resolve_bearer(environ: Mapping[str, str] | None = None) -> StaticBearer | ScopedBearer | None:
    """The bearer provider the environment configures, or None (no ``Authorization`` header).

    In order, a blank value counting as unset: ``HARBOR_ADMIN_SECRET``,
    ``MILES_HARBOR_AUTH_TOKEN``, ``AGENT_SERVER_AUTH_TOKEN`` (static bearers), then
    ``HARBOR_RUN_SECRET`` (a master secret: scoped per-instance bearers).

    Raises:
        ConfigError: the secret found is not valid; the message names the variable, never
            its value.

    Examples:
        ```python
        resolve_bearer({"HARBOR_ADMIN_SECRET": "s3cret"})
        # StaticBearer('***', source='HARBOR_ADMIN_SECRET')
        ```
    """
    env = os.environ if environ is None else environ
    for var in SECRET_ENV_VARS:
        value = env.get(var)
        if value is not None and value.strip():
            return StaticBearer(value.strip(), source=var)
    master = env.get(RUN_SECRET_ENV_VAR)
    if master is not None and master.strip():
        return ScopedBearer(master, source=RUN_SECRET_ENV_VAR)
    return None


def resolve_server_list(environ: Mapping[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``resolve_server_urls`` that skips the bad entries of a list instead of raising: the good
    URLs, and for each entry skipped what is wrong with it (naming the variable and the entry)."""
    for var in URL_ENV_VARS:
        value = environ.get(var)
        if value is not None and value.strip():
            good: dict[str, None] = {}
            skipped: list[str] = []
            for piece in filter(None, (piece.strip() for piece in value.split(","))):
                try:
                    good[_check_url(piece, var)] = None
                except ConfigError as exc:
                    skipped.append(str(exc))
            return tuple(good), tuple(skipped)
    return (), ()


def normalize_server_urls(urls: str | Iterable[str], source: str = "server_urls") -> tuple[str, ...]:
    """Validate and normalise URLs (a comma-separated str or an iterable of str) named ``source``."""
    if isinstance(urls, str):
        pieces = urls.split(",")
    elif isinstance(urls, Iterable) and not isinstance(urls, bytes):
        pieces = []
        for url in urls:
            if not isinstance(url, str):
                raise ConfigError(f"{source} holds a value of type {type(url).__name__}; URLs must be str")
            pieces.extend(url.split(","))
    else:
        raise ConfigError(f"{source} must be a str or a sequence of str, not {type(urls).__name__}")
    result: dict[str, None] = {}
    for piece in pieces:
        piece = piece.strip()
        if piece:
            result[_check_url(piece, source)] = None
    if not result:
        raise ConfigError(f"{source}: no URL given")
    return tuple(result)


def _check_url(url: str, source: str) -> str:
    """``url`` without trailing ``/`` if it is ``http(s)://host[:port][/path]``, else ``ConfigError``.

    A refused URL is shown by its scheme and host only (``redact_url``): whatever else it
    holds may be a password.
    """
    refused = f"{source}: {redact_url(url)}"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ConfigError(f"{refused} must start with http:// or https:// (for example http://agent-server:8000)")
    if "@" in rest:
        raise ConfigError(f"{refused} carries credentials (an '@' after the scheme); put the secret in "
                          f"{SECRET_ENV_VARS[0]} instead")
    if any(not ch.isprintable() or ch.isspace() for ch in url):
        raise ConfigError(f"{refused} contains white space or control characters")
    if "?" in rest or "#" in rest:
        raise ConfigError(f"{refused} must not have a query or fragment")
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{refused} is not a valid URL (host and port)") from None
    if not parts.hostname:
        raise ConfigError(f"{refused} has no host")
    return url.rstrip("/")


def redact_url(url: str) -> str:
    """A URL as typed, escaped, with what may be secret hidden: ``***@`` for credentials (whatever
    stood before the last ``@``), ``***`` for each query value and the fragment. A mistyped value
    is shown whole the same way, quoted: ``'http//127.0.0.1:9'``.

    Examples:
        ```python
        redact_url("http://admin:pa55/x@host:9/path?token=abc")
        # 'http://***@host:9/path?token=***'
        ```
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    rest, hashed, fragment = rest.partition("#")
    rest, asked, query = rest.partition("?")
    if asked:
        rest += "?" + "&".join(name + ("=***" if has_value else "")
                               for name, has_value, _ in (item.partition("=") for item in query.split("&")))
    shown_url = shown(f"{scheme}{sep}{rest}{'#***' if hashed and fragment else hashed}", 200)
    return shown_url if sep else f"'{shown_url}'"
