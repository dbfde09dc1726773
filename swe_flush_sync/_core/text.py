"""Showing untrusted text (instance ids, URLs) in messages and log lines without letting it
forge a line, move the cursor or break a strict UTF-8 handler."""

from __future__ import annotations

from typing import Final

_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
MAX_SHOWN: Final = 200


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` with control characters, escapes and lone surrogates written as ``\\n``, ``\\x1b``,
    ``\\udc80``; cut to ``limit`` characters (marked ``...``).

    Examples:
        ```python
        shown("a\\nCRITICAL ok\\x1b[2J")
        # 'a\\\\nCRITICAL ok\\\\x1b[2J'
        ```
    """
    out = []
    for ch in text[:limit]:
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out) + ("..." if len(text) > limit else "")
