"""A client's half-close, told from a close: what the reader of a connection does after EOF.

An EOF after whole requests only is a half-close (``shutdown(SHUT_WR)``): the connection answers
what it received (:mod:`shim_common._http_connection`, rule 3; :mod:`shim_common._http_cycle`,
rule 7), as nginx and h11-based servers do. But a TCP server cannot tell a half-close from a
close: both are a FIN. A client that closed both ways, during a long prefill that writes nothing,
would then hold its request (and its worker slot) until the first write that fails. So the
reader finds out, by the rules here.

Rules:

1. The probe. While the answer to the request in flight has not begun and that request is
   HTTP/1.1, one ``100 Continue`` is written, without waiting (RFC 9110 15.2: a client must
   accept an interim answer it did not ask for; it is also the one a client that sent
   ``Expect: 100-continue`` waits for, so none is sent after it). What the kernel does not take
   of it is owed: the connection's next write sends it first, so bytes never interleave
   (:meth:`~shim_common._socket_io.ConnectionIO.send_interim`); a socket full to the brim, or a
   write under way, puts the probe off to the next look. A
   client that closed both ways has no socket left to take it: its kernel answers with a reset.
2. The look. The socket's pending error (``SO_ERROR``) is read 2 ms after the EOF, then four
   times later each time, up to once a second, for :data:`HALF_CLOSE_WATCH` seconds: the reset
   shows there (``EPIPE`` on Linux) while reads still find a clean EOF. When it shows, the
   client is gone: the reader cancels the connection as for any departure. A probe is made once,
   for the first request found in flight without an answer; a request that starts later is
   answered, and a write to a client gone fails at once.
3. No probe where none may be written: over TLS (the reader cannot write past the stream the
   main task owns) and to an HTTP/1.0 client (RFC 9110: no 1xx to it). There a close during a
   silent request is noticed at the first write that fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

from shim_common._http_cycle import SEND_RESPONSE, Cycle
from shim_common._http_parser import RequestHead
from shim_common._socket_io import ConnectionIO

__all__ = ["HALF_CLOSE_WATCH", "watch_half_closed"]

#: Seconds after the EOF the reader looks for the reset of a client that closed both ways (rule
#: 2): a reset arrives a round trip after the probe, milliseconds on a LAN.
HALF_CLOSE_WATCH: Final = 5.0
#: The interim answer a client that closed both ways answers with a reset (rule 1).
PROBE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Seconds before the first look (rule 2).
FIRST_LOOK: Final = 0.002


async def watch_half_closed(
    cycle: Cycle,
    io: ConnectionIO,
    in_flight: Callable[[], RequestHead | None],
) -> bool:
    """Probe the request in flight and look for the reset of a client that closed both ways.

    Args:
        cycle: The connection's cycle (whether the answer has begun).
        io: The connection's reads and writes.
        in_flight: The request being handled, if any.

    Returns:
        ``False`` when the reset came (the client is gone), ``True`` when the look is over.
    """
    probed = False
    pause = FIRST_LOOK
    watch_until = trio.current_time() + HALF_CLOSE_WATCH
    # Bounded: a look at most every second until the watch ends.
    while trio.current_time() < watch_until:
        request = in_flight()
        if (
            not probed
            and cycle.ours == SEND_RESPONSE
            and request is not None
            and request.http_version >= b"1.1"
        ):
            try:
                probed = io.send_interim(PROBE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            if probed:
                cycle.waiting_for_continue = False  # the probe is the 100 it waited for
        if probed and io.pending_error():
            return False
        await trio.sleep(pause)
        pause = min(pause * 4, 1.0)
    return True
