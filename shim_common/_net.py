"""Small network helpers both sides use: URL host formatting, reconnect backoff, and telling
when the process has run out of descriptors."""

from __future__ import annotations

import errno
import logging
import os
import random
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
]

# What accept() and connect() fail with when the process (or the system) has no descriptor or
# socket buffer left: a condition that closing idle connections can cure.
_OUT_OF_DESCRIPTORS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def out_of_descriptors(exc: OSError) -> bool:
    """Whether ``exc`` says the process ran out of file descriptors (or socket memory)."""
    return exc.errno in _OUT_OF_DESCRIPTORS


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
