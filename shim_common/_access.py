"""Who may talk to a process: bearer tokens and TLS, shared by the worker and the frontend.

Rules:

1. A token comes from the environment only (``DYN_WORKER_TOKEN``, ``DYN_ADMIN_TOKEN``, the
   frontend's ``DYN_GATEWAY_TOKEN``), never from a flag, so it does not show in ``ps``. Unset
   means no check. Set, it must be non-empty visible ASCII without spaces (what fits a
   ``Bearer`` credential); anything else stops the process at start-up, and the message names
   the variable but never repeats the value.
2. :func:`bearer_matches` compares in constant time (:func:`hmac.compare_digest`), so the time a
   refusal takes says nothing about how much of a guess was right. Tokens are kept out of
   ``repr`` of the settings that carry them, out of logs and out of metrics.
3. TLS material is checked at start-up: a certificate without its key (or the reverse), a file
   that cannot be read or a pair that does not load is an error naming the flag.
4. A server does each TLS handshake in the connection's own task, bounded in time; a failed or
   late handshake is counted and closes that connection only (:func:`accept_tls`,
   :class:`HandshakeFirstListener`).
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Final

import trio

from shim_common._cli import CliError

__all__ = [
    "ADMIN_TOKEN_ENV",
    "WORKER_TOKEN_ENV",
    "HandshakeFirstListener",
    "TLSFiles",
    "accept_tls",
    "bearer_matches",
    "check_ca_file",
    "client_context",
    "server_context",
    "token_from_env",
]

logger = logging.getLogger(__name__)

WORKER_TOKEN_ENV: Final = "DYN_WORKER_TOKEN"
ADMIN_TOKEN_ENV: Final = "DYN_ADMIN_TOKEN"


# ----------------------------------------------------------------------------- tokens


def token_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Read a bearer token from the environment (rule 1).

    Returns:
        The token, or ``None`` when the variable is unset.

    Raises:
        CliError: set but empty, or with a character a bearer credential cannot carry.
    """
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return None
    if not raw:
        raise CliError(f"{name} is set but empty; unset it to run without a token.")
    if not all("!" <= char <= "~" for char in raw):
        raise CliError(
            f"{name} holds a space, a control or a non-ASCII character; a bearer token must "
            "be visible ASCII (the value is not shown)."
        )
    return raw


def bearer_matches(authorization: bytes | None, token: bytes) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <token>`` (rule 2).

    The scheme is matched in any case, as RFC 9110 asks; the credential byte for byte, in
    constant time.
    """
    if authorization is None:
        return False
    scheme, _, credential = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(credential.strip(), token)


# ----------------------------------------------------------------------------- TLS material


class TLSFiles:
    """A certificate and key path as given, checked together (rule 3).

    Args:
        cert_path: the PEM certificate chain, or ``None``.
        key_path: its PEM private key, or ``None``.
        cert_flag: how the certificate is named in messages, e.g. ``"--tls-cert-path"``.
        key_flag: the same for the key.

    Raises:
        CliError: one given without the other, a file that cannot be read, or a pair that
            does not load.
    """

    def __init__(
        self,
        cert_path: str | None,
        key_path: str | None,
        *,
        cert_flag: str = "--tls-cert-path (DYN_TLS_CERT_PATH)",
        key_flag: str = "--tls-key-path (DYN_TLS_KEY_PATH)",
    ) -> None:
        if (cert_path is None) != (key_path is None):
            given, missing = (cert_flag, key_flag) if key_path is None else (key_flag, cert_flag)
            raise CliError(f"{given} needs {missing} too (a certificate and its key).")
        self.cert_path = cert_path
        self.key_path = key_path
        if cert_path is not None and key_path is not None:
            _check_readable(cert_flag, cert_path)
            _check_readable(key_flag, key_path)
            try:
                server_context(cert_path, key_path)
            except (ssl.SSLError, OSError) as exc:
                raise CliError(
                    f'Invalid value "{cert_path}" for {cert_flag} with "{key_path}" for '
                    f"{key_flag}: the certificate and key do not load ({_ssl_reason(exc)})."
                ) from None

    @property
    def enabled(self) -> bool:
        """Whether a certificate and key were given."""
        return self.cert_path is not None


def check_ca_file(flag: str, path: str) -> None:
    """Check that a CA bundle can be read and holds at least one certificate.

    Raises:
        CliError: naming ``flag``.
    """
    _check_readable(flag, path)
    try:
        client_context(path)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise CliError(
            f'Invalid value "{path}" for {flag}: not a PEM bundle of certificates '
            f"({_ssl_reason(exc)})."
        ) from None


def _check_readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise CliError(
            f'Invalid value "{path}" for {flag}: cannot read it ({exc.strerror or exc}).'
        ) from None


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    return str(exc) or type(exc).__name__


def server_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """A server-side TLS context with the given certificate chain and key (TLS 1.2 or later).

    Raises:
        ssl.SSLError, OSError: the files do not load.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    # Both servers speak HTTP/1.1 only (the websocket upgrade is HTTP/1.1 too).
    context.set_alpn_protocols(["http/1.1"])
    return context


def client_context(ca_path: str | None = None, *, also_trust: str | None = None) -> ssl.SSLContext:
    """A client-side TLS context that verifies servers and their host names.

    Args:
        ca_path: a PEM bundle to trust; ``None``: the system's trust store.
        also_trust: a certificate file whose certificates are trusted as they are, even when
            none of them is a CA (``--local-workers`` children present the frontend's own
            certificate: the frontend trusts it without a CA bundle).

    Raises:
        ssl.SSLError, OSError: a file does not load.
    """
    context = ssl.create_default_context(cafile=ca_path)
    if also_trust is not None:
        context.load_verify_locations(cafile=also_trust)
        # Lets a certificate in the store be an anchor although it is not self-signed.
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


# ----------------------------------------------------------------------------- TLS servers


async def accept_tls(
    stream: trio.abc.Stream,
    context: ssl.SSLContext,
    handshake_timeout: float,
    on_failure: Callable[[BaseException], None],
) -> trio.SSLStream[trio.abc.Stream] | None:
    """Do the server side of a TLS handshake on an accepted stream, bounded in time.

    Returns:
        The TLS stream, or ``None`` when the handshake failed or was late: then the failure has
        been passed to ``on_failure`` (to be counted) and the stream closed.
    """
    tls = trio.SSLStream(stream, context, server_side=True, https_compatible=True)
    failure: BaseException | None = None
    with trio.move_on_after(handshake_timeout) as scope:
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            failure = exc
    if scope.cancelled_caught:
        failure = trio.TooSlowError(f"no TLS handshake within {handshake_timeout} s")
    if failure is None:
        return tls
    logger.debug("TLS handshake failed: %s", _describe_tls_failure(failure))
    on_failure(failure)
    await trio.aclose_forcefully(stream)
    return None


def _describe_tls_failure(exc: BaseException) -> str:
    cause = exc.__cause__
    return f"{exc or type(exc).__name__}" + (f": {cause}" if cause is not None else "")


class _HandshakeFirst(trio.abc.Stream):
    """A server TLS stream whose first read or write first does the handshake, bounded.

    A failed or late handshake is reported, the transport closed, and the read or write
    raises :class:`trio.BrokenResourceError`: the peer sees the connection closed at once
    rather than after the websocket library's own opening timeout.
    """

    def __init__(
        self,
        tls: trio.SSLStream[trio.SocketStream],
        timeout: float,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self._tls = tls
        self._timeout = timeout
        self._on_failure = on_failure
        self._ready = False
        self._failed: BaseException | None = None

    @property
    def transport_stream(self) -> trio.SocketStream:
        """The TCP stream under the TLS layer (as :class:`trio.SSLStream` names it)."""
        return self._tls.transport_stream

    def __repr__(self) -> str:
        try:
            host, port, *_ = self._tls.transport_stream.socket.getpeername()
        except OSError:
            return "<TLS peer>"
        return f"{host}:{port} (TLS)"

    async def _handshake(self) -> None:
        if self._ready:
            return
        if self._failed is None:
            failure: BaseException | None = None
            with trio.move_on_after(self._timeout) as scope:
                try:
                    # Safe to call from a reader and a writer at once: the second waits.
                    await self._tls.do_handshake()
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    failure = exc
            if failure is None and not scope.cancelled_caught:
                self._ready = True
                return
            if self._failed is None:  # the first caller to fail reports it
                self._failed = failure or trio.TooSlowError(
                    f"no TLS handshake within {self._timeout} s"
                )
                logger.debug(
                    "TLS handshake with %r failed: %s", self, _describe_tls_failure(self._failed)
                )
                self._on_failure(self._failed)
                await trio.aclose_forcefully(self._tls.transport_stream)
        raise trio.BrokenResourceError("TLS handshake failed") from self._failed

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        await self._handshake()
        return await self._tls.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._handshake()
        await self._tls.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._tls.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        if self._ready:
            await self._tls.aclose()
        else:
            await trio.aclose_forcefully(self._tls.transport_stream)


class HandshakeFirstListener(trio.abc.Listener[trio.abc.Stream]):
    """Wraps a TCP listener: each accepted stream is TLS, its handshake done on first use.

    For servers that read through a library (trio-websocket): the handshake then runs in the
    connection's task, bounded by ``timeout``, and its failure is counted (``on_failure``).

    Attributes:
        transport_listener: the TCP listener underneath.
    """

    def __init__(
        self,
        transport_listener: trio.SocketListener,
        context: ssl.SSLContext,
        *,
        timeout: float,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.transport_listener = transport_listener
        self._context = context
        self._timeout = timeout
        self._on_failure = on_failure

    async def accept(self) -> trio.abc.Stream:
        transport = await self.transport_listener.accept()
        tls = trio.SSLStream(transport, self._context, server_side=True, https_compatible=True)
        return _HandshakeFirst(tls, self._timeout, self._on_failure)

    async def aclose(self) -> None:
        await self.transport_listener.aclose()
