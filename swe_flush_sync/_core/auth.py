"""Bearer providers: what ``Authorization: Bearer <token>`` a flush of one instance id sends.

A provider is any callable ``instance_id -> token``. Two are built in:

- ``StaticBearer``: one shared secret for every id (``HARBOR_ADMIN_SECRET`` and its fallbacks).
- ``ScopedBearer``: a per-instance token derived from a master secret (``HARBOR_RUN_SECRET``),
  lowercase hex of HMAC-SHA256(key=master, msg=``SCOPED_CONTEXT + id``); the server accepts
  only that token for that id.

Neither ever shows its secret in a repr, a message or a comparison failure.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from .errors import ConfigError
from .text import shown

BearerProvider = Callable[[str], str]
"""Any callable taking an instance id and returning the bearer token to send for it."""

SCOPED_CONTEXT: Final = b"miles-harbor-flush-session-v1\x00session:"
SCOPED_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MIN_MASTER_SECRET: Final = 32
MAX_MASTER_SECRET: Final = 4096


def check_token(token: object, source: str) -> str:
    """``token`` if it can travel in an HTTP header (printable ASCII), else ``ConfigError``."""
    if not isinstance(token, str):
        raise ConfigError(f"{source} must be a str, not {type(token).__name__}")
    if not token or not (token.isascii() and token.isprintable()):  # printable ASCII: " " to "~"
        raise ConfigError(f"{source} must be non-empty printable ASCII (it is sent in an HTTP header)")
    return token


@dataclass(frozen=True, slots=True)
class StaticBearer:
    """The same bearer secret for every instance id.

    Args:
        secret: the token sent as ``Authorization: Bearer <secret>`` (printable ASCII).
        source: where the secret came from, named in errors (never its value).
    """

    secret: str
    source: str = field(default="admin_secret", compare=False)

    def __post_init__(self) -> None:
        check_token(self.secret, self.source)

    def __call__(self, instance_id: str) -> str:
        return self.secret

    def __repr__(self) -> str:
        return f"StaticBearer('***', source={self.source!r})"


@dataclass(frozen=True)
class ScopedBearer:
    """Per-instance bearers derived from a master secret; each computed once per id.

    Args:
        master_secret: 32 to 4,096 characters, no CR or LF; the HMAC-SHA256 key (UTF-8).
        source: where the secret came from, named in errors (never its value).

    Raises:
        ConfigError: the master secret is too short, too long, or holds CR/LF.

    Calling it with an id that is not 1-128 letters, digits, ``.``, ``_`` or ``-`` (starting with a
    letter or digit) raises ``ConfigError``: such a pair fails and is never sent.

    Examples:
        ```python
        ScopedBearer("m" * 32)("inst-1")[:12]
        # '4aa20b800cd4'
        ```
    """

    master_secret: str
    source: str = field(default="master_secret", compare=False)
    _tokens: dict[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        secret = self.master_secret
        if not isinstance(secret, str):
            raise ConfigError(f"{self.source} must be a str, not {type(secret).__name__}")
        if not MIN_MASTER_SECRET <= len(secret) <= MAX_MASTER_SECRET:
            raise ConfigError(f"{self.source} must be {MIN_MASTER_SECRET} to {MAX_MASTER_SECRET} characters "
                              f"long, got {len(secret)}")
        if "\r" in secret or "\n" in secret:
            raise ConfigError(f"{self.source} must not hold CR or LF")

    def __call__(self, instance_id: str) -> str:
        token = self._tokens.get(instance_id)
        if token is None:
            if not SCOPED_ID_PATTERN.fullmatch(instance_id):
                raise ConfigError(f"instance id {shown(instance_id)} cannot have a scoped bearer: ids must "
                                  f"match {SCOPED_ID_PATTERN.pattern}")
            token = hmac.new(self.master_secret.encode(), SCOPED_CONTEXT + instance_id.encode(),
                             hashlib.sha256).hexdigest()
            self._tokens[instance_id] = token  # one dict store: atomic, and the same value from any thread
        return token

    def __repr__(self) -> str:
        return f"ScopedBearer('***', source={self.source!r})"
