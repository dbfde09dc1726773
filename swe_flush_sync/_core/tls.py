"""TLS for agent servers behind https: the trust store and client certificate, and what a TLS
failure means.

Verification is never turned off. A certificate or TLS protocol failure is final (retrying
cannot change it) and is told in a few words; a TLS failure caused by a reset, an EOF or a
timeout is a dropped connection, retried as one.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Final

from .errors import ConfigError
from .text import shown

CA_BUNDLE_ENV_VARS: Final = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")
_HOSTNAME_MISMATCH: Final = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_ALERTS: Final = {  # OpenSSL reasons of the server's refusals
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server requires a client certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust the client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the server refused the client certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the server refused the client certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the server says the client certificate has expired",
}
_NOT_FINAL: Final = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
                     ssl.SSLWantWriteError)


def check_path(value: object, name: str, *, directory_ok: bool = False) -> str:
    """``value`` if it names a readable file (or directory), else ``ConfigError`` naming ``name``."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ConfigError(f"{name} must be a file path (a non-empty str)")
    if directory_ok and os.path.isdir(value):
        if not os.access(value, os.R_OK | os.X_OK):
            raise ConfigError(f"{name}: the directory is not readable")
        return value
    try:
        with open(value, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the file {shown(value)}: {exc.strerror or type(exc).__name__}; give "
                          "the path of a readable PEM file") from None
    return value


def check_client_cert(value: object) -> str | tuple[str, str] | None:
    """A PEM holding the certificate and its key, or (certificate, key); checked for readability."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ConfigError("client_cert must be a path or a (certificate, key) pair of paths")
        return check_path(value[0], "client_cert"), check_path(value[1], "client_cert's key")
    return check_path(value, "client_cert")


def ssl_context(ca_bundle: str | None, client_cert: str | tuple[str, str] | None,
                before_handshake: Callable[[socket.socket], None] | None = None,
                environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """A verifying context: ``ca_bundle``, else the first CA variable set, else the system store;
    with the client certificate loaded (an encrypted key is refused, never prompted for).
    ``before_handshake`` is given each socket before its handshake starts (so that it can be shut
    down mid-handshake: the socket a connection held until then is detached by the wrap)."""
    env = os.environ if environ is None else environ
    source = "ca_bundle"
    if ca_bundle is None:
        source, ca_bundle = next(((var, env[var]) for var in CA_BUNDLE_ENV_VARS if env.get(var, "").strip()),
                                 (source, None))
    if ca_bundle is not None:
        check_path(ca_bundle, source, directory_ok=True)
    try:
        if ca_bundle is None:
            context = ssl.create_default_context()
        elif os.path.isdir(ca_bundle):
            context = ssl.create_default_context(capath=ca_bundle)
        else:
            context = ssl.create_default_context(cafile=ca_bundle)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{source}: not a PEM CA bundle ({_reason(exc)})") from None
    if client_cert is not None:
        cert, key = client_cert if isinstance(client_cert, tuple) else (client_cert, None)
        try:
            context.load_cert_chain(cert, key, password=lambda: b"")
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"client_cert: not a PEM certificate with its unencrypted key ({_reason(exc)})") from None
    if before_handshake is not None:
        context.sslsocket_class = _socket_class(before_handshake)  # the documented way to a custom SSLSocket
    return context


def _socket_class(before_handshake: Callable[[socket.socket], None]) -> type[ssl.SSLSocket]:
    class _SSLSocket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            before_handshake(self)
            super().do_handshake(block)

    return _SSLSocket


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return reason.lower().replace("_", " ") if isinstance(reason, str) else type(exc).__name__


def tls_failure(exc: BaseException | None) -> str | None:
    """Why a TLS handshake failed for good (certificate or protocol), or None: not such a failure."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ssl.SSLCertVerificationError):
            if exc.verify_code in _HOSTNAME_MISMATCH:
                return "certificate verify failed: hostname mismatch"
            return f"certificate verify failed: {(exc.verify_message or 'unknown reason').rstrip('.')}"
        if isinstance(exc, _NOT_FINAL):
            return None
        if isinstance(exc, ssl.SSLError):
            reason = exc.reason if isinstance(exc.reason, str) else None
            if reason is None:
                return None
            return _ALERTS.get(reason) or f"handshake failed ({reason.lower().replace('_', ' ')})"
        inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
        exc = getattr(exc, "reason", None) if isinstance(getattr(exc, "reason", None), BaseException) else \
            inner or exc.__cause__ or exc.__context__
        seen += 1
    return None
