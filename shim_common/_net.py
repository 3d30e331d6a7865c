"""Small network helpers both sides use: URL host formatting, reconnect backoff, telling when
the process has run out of descriptors, and stopping a listener from completing handshakes."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import socket
import struct
import sys
from typing import Final

import trio

__all__ = [
    "CLOSE_BATCH",
    "RELEASE_SECONDS",
    "Backoff",
    "DescriptorLimitLog",
    "base_url",
    "host_for_url",
    "out_of_descriptors",
    "stop_completing_handshakes",
]

# What accept() and connect() fail with when the process (or the system) has no descriptor or
# socket buffer left: a condition that closing idle connections can cure.
_OUT_OF_DESCRIPTORS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def out_of_descriptors(exc: OSError) -> bool:
    """Whether ``exc`` says the process ran out of file descriptors (or socket memory)."""
    return exc.errno in _OUT_OF_DESCRIPTORS


# A classic BPF socket filter that drops every TCP segment with SYN set and ACK clear (a new
# connection's first segment) and keeps every other. On a listening socket the kernel runs it
# on each segment before the TCP state machine, with the TCP header at offset 0, so the
# listener completes no new handshake while the ones under way (their final ACK) and the
# connections already in its backlog are untouched.
_TCP_FLAGS_OFFSET: Final = 13
_SYN_ACK_MASK: Final = 0x12  # SYN | ACK
_SYN_ALONE: Final = 0x02
_DROP_NEW_CONNECTIONS: Final = (
    (0x30, 0, 0, _TCP_FLAGS_OFFSET),  # ldb [13]
    (0x54, 0, 0, _SYN_ACK_MASK),  # and #0x12
    (0x15, 0, 1, _SYN_ALONE),  # jeq #0x02: drop, else keep
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: keep the whole segment
)
_SO_ATTACH_FILTER: Final = getattr(socket, "SO_ATTACH_FILTER", 26)


def stop_completing_handshakes(listening: trio.socket.SocketType) -> bool:
    """Make ``listening`` ignore new connection attempts; ``False`` where that cannot be done.

    Closing a listener resets every connection the kernel completed and nobody accepted yet: its
    client saw the connection open, sent a request, and gets no answer. A server that stops
    calls this, takes its backlog, then closes: a client that tried meanwhile had its opening
    segment ignored, and its retry finds the port closed (a refused connection, which it can
    take elsewhere). Linux only (a BPF socket filter); elsewhere the close keeps its small race.
    """
    if not sys.platform.startswith("linux"):
        return False
    program = b"".join(struct.pack("HBBI", *op) for op in _DROP_NEW_CONNECTIONS)
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("HL", len(_DROP_NEW_CONNECTIONS), ctypes.addressof(buffer))
    try:
        listening.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


#: Idle connections closed at once to make room when the process is out of descriptors.
CLOSE_BATCH: Final = 16
#: After closing idle connections: time for their tasks to release the descriptors.
RELEASE_SECONDS: Final = 0.001


class DescriptorLimitLog:
    """Logs running out of descriptors at a bounded rate: the first time, then at most once per
    ``interval`` seconds with what happened since (a server or a fleet at the limit would
    otherwise log per attempt).

    Args:
        logger: Where the warning goes.
        action: What failed, for the message ("accept", "connecting to a worker").
        interval: The least time between two lines (Trio seconds).
    """

    def __init__(self, logger: logging.Logger, action: str, interval: float = 10.0) -> None:
        self._logger = logger
        self._action = action
        self._interval = interval
        self._last = -float("inf")
        self._failures = 0
        self._closed = 0

    def note(self, exc: OSError, closed: int) -> None:
        """One failure, after which ``closed`` idle connections were closed to make room."""
        self._failures += 1
        self._closed += closed
        now = trio.current_time()
        if now - self._last < self._interval:
            return
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._logger.warning(
            "%s failed with %s (%s) %d times since the last report; closed %d idle"
            " connections to make room",
            self._action,
            code,
            os.strerror(exc.errno or 0),
            self._failures,
            self._closed,
        )
        self._last = now
        self._failures = self._closed = 0


def host_for_url(host: str) -> str:
    """``host`` as it appears in a URL or a ``Host`` header: an IPv6 literal in brackets.

    ``"::1"`` becomes ``"[::1]"``; names, IPv4 addresses and already bracketed literals are
    returned unchanged.
    """
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def base_url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with ``host`` formatted by :func:`host_for_url`."""
    return f"{scheme}://{host_for_url(host)}:{port}"


class Backoff:
    """Capped exponential backoff with jitter; pure, so tests can check its sequence.

    The n-th delay since the last :meth:`reset` (n = 0, 1, ...) is drawn uniformly from
    ``[(1 - jitter) * d, d]`` where ``d = min(cap, initial * 2**n)``.

    Args:
        initial: The first delay (seconds), > 0.
        cap: The largest delay (seconds), >= ``initial``.
        jitter: The share of each delay that is random, in [0, 1]; 0 gives exact doubling.
        rng: The random source (a seeded one in tests).

    Raises:
        ValueError: for bounds out of range.
    """

    def __init__(
        self, *, initial: float, cap: float, jitter: float = 0.0, rng: random.Random | None = None
    ) -> None:
        if not 0.0 < initial <= cap:
            raise ValueError(f"backoff needs 0 < initial <= cap, got {initial} and {cap}")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"backoff jitter must be in [0, 1], got {jitter}")
        self._initial = initial
        self._cap = cap
        self._jitter = jitter
        self._rng = rng if rng is not None else random.Random()
        self._attempt = 0

    def next_delay(self) -> float:
        """The delay before the next attempt (seconds); each call counts one attempt."""
        # Cap the exponent so 2**n never overflows a float on a link that is down for days.
        ceiling = min(self._cap, self._initial * 2.0 ** min(self._attempt, 64))
        self._attempt += 1
        if self._jitter == 0.0:
            return ceiling
        return ceiling * (1.0 - self._jitter * self._rng.random())

    def reset(self) -> None:
        """Start again from the initial delay (after a success)."""
        self._attempt = 0
