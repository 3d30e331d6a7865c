"""Why a worker link's session failed, in words for the log and for the requests it fails.

A session ends by an exception group (its tasks run in one nursery): :func:`session_end_reason`
is the short reason each open request fails with, :func:`explain_failure` the log line's, which
also names what an operator should check for the usual set-up mistakes (a refused token, a
scheme that does not match what the worker serves, a certificate that does not verify).
"""

from __future__ import annotations

import ssl

import msgspec
import trio

from frontend_shim._connection import PlaneClosed, ProtocolError
from frontend_shim._websocket import HandshakeError, HandshakeRejected

__all__ = ["breaks_protocol", "explain_failure", "session_end_reason"]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _describe(exc: BaseException) -> str:
    parts = []
    for leaf in _leaves(exc):
        text = str(leaf) or type(leaf).__name__
        if isinstance(leaf, trio.BrokenResourceError) and leaf.__cause__ is not None:
            text = f"{text or 'broken connection'}: {leaf.__cause__}"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts)


def explain_failure(group: BaseException, *, tls: bool, connecting: bool) -> str:
    """What ended a session, plus what an operator should check for the usual set-up
    mistakes: a token the worker refused, and a URL whose scheme does not match what the worker
    serves (``connecting``: the session never came up)."""
    leaves = _leaves(group)
    if any(isinstance(leaf, HandshakeRejected) and leaf.status == 401 for leaf in leaves):
        return (
            "the worker refused the token (HTTP 401): DYN_WORKER_TOKEN here is unset or "
            "differs from the worker's"
        )
    text = _describe(group)
    if not connecting:
        return text
    ssl_errors = [leaf.__cause__ for leaf in leaves if isinstance(leaf.__cause__, ssl.SSLError)]
    if tls and ssl_errors:
        if any(isinstance(error, ssl.SSLCertVerificationError) for error in ssl_errors):
            return (
                f"the worker's certificate does not verify ({ssl_errors[0]}); check "
                "--tls-ca-path and the host name in the URL"
            )
        return f"TLS handshake failed ({ssl_errors[0]}): a worker serving plain ws://? TLS?"
    silent = (trio.TooSlowError, trio.BrokenResourceError, PlaneClosed)
    refused = any(isinstance(leaf, HandshakeRejected) for leaf in leaves)
    if (
        not tls
        and not refused
        and any(isinstance(leaf, (HandshakeError, *silent)) for leaf in leaves)
    ):
        return f"no websocket answer ({text}): a worker serving only wss://? TLS?"
    return text


def session_end_reason(exc: BaseException) -> str:
    """The reason the open requests of a session that ended by ``exc`` fail with."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    if not leaves:
        return "link stopped"
    return (
        _describe(BaseExceptionGroup("session", leaves))
        if len(leaves) > 1
        else _describe(leaves[0])
    )


def breaks_protocol(exc: BaseException) -> bool:
    """Whether a session ended by ``exc`` ended because the worker broke the protocol (a
    message that does not decode, or a :class:`ProtocolError`), not by a lost connection."""
    return any(isinstance(leaf, ProtocolError | msgspec.DecodeError) for leaf in _leaves(exc))
