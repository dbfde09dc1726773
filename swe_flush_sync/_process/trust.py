"""Which files may be believed: OpenSSH's StrictModes rules for the ledger.

A URL read from a file that someone else could have written must never receive a secret read
from the environment. A ledger directory, and each record in it, must be owned by this user (or
root) and writable by no group or other user; what a record says is then this user's word. This
module imports only the standard library.
"""

from __future__ import annotations

import os
import stat


def ownership_problem(info: os.stat_result) -> str | None:
    """What makes a file or directory with ``info`` untrustworthy to this user, or None.

    Examples:
        ```python
        ownership_problem(os.stat("/"))  # owned by root, writable by root only
        ```
    """
    if info.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def directory_problem(path: str) -> str | None:
    """What makes the directory ``path`` untrustworthy (or not a directory), or None when it may be believed."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or type(exc).__name__})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    return ownership_problem(info)
