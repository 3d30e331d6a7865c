"""A lean simulated fleet for ``bench/bench_fleet.py``: K workers' wire behaviour in one cheap loop.

Run: ``python bench/lean_sim.py --workers 2048 [--ranks 4] [--rate 20] [--protocol current]``.
The command line, the control protocol on stdin/stdout and the load model are those of
``bench/fleet_sim.py``; what differs is the cost. ``fleet_sim.py`` runs K real workers in one Trio
process and, at 2,048 workers, spends its whole core (and 120-280 ms per flip) before the
frontend has seen anything, so a benchmark measures the simulator. Here one ``selectors`` loop
over non-blocking sockets does only what reaches the wire: no Trio, no ``worker_ingress``, one
listener per worker on ``127.0.0.1`` (port 0), every message built from the
:mod:`shim_common.wire` types and encoded by :func:`shim_common.wire.encode`, so the bytes cannot
drift from the protocol; hellos and busy rules are computed once.

Rules, per simulated worker (the real worker's, ``worker_ingress/_events.py`` and
``docs/protocol.md``):

1. Websocket (RFC 6455, written by hand): an upgrade on ``/v1/events`` or ``/v1/requests`` is
   answered ``101`` (the request plane picks :data:`~shim_common.wire.SUBPROTOCOL_BATCH` when it
   is offered), any other path ``404``. Client frames must be masked, without reserved bits;
   fragmented messages are joined, several frames per read are taken in order; ping -> pong,
   close -> close back, a text message -> close 1003, an undecodable one -> 1007, a message over
   :data:`~shim_common.wire.MAX_MESSAGE_BYTES` -> 1009, bad framing -> 1002. Every connection is
   pinged every ``PING_INTERVAL`` s and dropped when a pong is ``PING_TIMEOUT`` s late.
2. Hello on both planes, by ``--protocol``: ``new`` lists what the real worker lists now
   (:data:`NEW_FEATURES`), ``current`` only :data:`~shim_common.wire.FEATURE_BUSY_EDGES`, ``v1``
   nothing and ``load_publish_interval`` 0. The engine's limits are fleet_sim's (1,000 KV blocks,
   block size 16, 8,192 batched tokens, 256 sequences, N unset so Q is 40,000).
3. Load: every rank changes ``--rate`` times a second, the workers spread over :data:`SLOTS` slots
   of the period (slots missed while the process was busy are ticked late, at most one period's
   worth, as in fleet_sim), each rank's blocks drawn from :data:`FREE_RANGE` or
   :data:`BUSY_RANGE` of the fleet's mode. A change takes the worker's next ``seq`` per rank.
   ``busy``/``free`` ticks every worker at once. The ingress gauges stay 0: a zero-work request
   starts and ends within one pass of the loop, before a publisher could see it.
4. Events, per subscriber (the :class:`~shim_common.wire.Mailbox` rule, latest wins): a batch
   holds the newest heartbeat and the newest load of each rank not yet taken, in ``seq`` order
   (a heartbeat newer than a rank's load makes it redundant). Subscribing sends the hello and a
   fresh heartbeat at once. A heartbeat every ``HEARTBEAT_INTERVAL`` s per worker. At most one
   batch every publish interval (0.1 s; ``new``: ``max(own, Subscribe.publish_interval)``;
   ``v1``: 0, so every change and heartbeat goes out at once, one batch each); with busy edges
   (``new``, ``current``) a change that turns a rank busy or free under the ``Subscribe``
   thresholds, compared with what that subscriber was last sent, waits only the edge gap
   (1/20 of the own interval). While a socket does not take a batch whole, nothing more is
   taken for it: what changes meanwhile is latest-wins, as the worker's blocked sender makes it.
5. Requests, like the zero-work instant engine behind an ungated worker: a bad body is
   ``Failed(bad_request)``; otherwise ``Started``, then the tokens (``max_tokens``, 16 when
   absent; for embeddings one 8-float vector per input), then ``End``. A pass of the loop makes
   at most :data:`TOKENS_PER_PASS` tokens of each request, as one chunk (the worker merges text
   chunks that queue up together); a request's last chunk leaves with its ``End``. A ``Cancel``
   read before a request ended (in the same read as its ``Generate`` included) ends it with
   ``Failed(cancelled)``; a reused id in flight closes with 1008; past the ungated worker's
   slots and queue places (50,000 in flight on one connection), ``Rejected(overloaded)``. With
   the batch subprotocol a pass's replies on one connection are one
   :class:`~shim_common.wire.Batch` message.
6. KV events (``--kv-blocks B``, protocol ``new`` only; docs/protocol.md, "KV events"): the hello
   also lists :data:`~shim_common.wire.FEATURE_KV_EVENTS`, and each rank's tick also stores one
   chain of ``B`` new block names (parent nil), evicting its oldest chain first once the rank
   holds ``KV_TOTAL_BLOCKS`` blocks: the steady churn of a full cache, one or two KV events per
   rank per tick, numbered per worker. A subscriber that sends ``Subscribe.kv_events`` gets a
   :class:`~shim_common.wire.KvSnapshot` (the worker's whole cache), then every event, in
   :class:`~shim_common.wire.KvBatch` messages that go out with its load batches (same
   interval, edges included); ``kv_snapshot`` asks for a fresh snapshot. Past max(1024, the
   worker's blocks) pending names, a subscriber's backlog is replaced by a snapshot, as the real
   worker does. Names are ``(worker * ranks + rank) << 32 | n``: distinct across the fleet.

Control, one command per line on stdin, one answer line per command on stdout (fleet_sim's):

- start-up: ``fleet-sim ready workers=K ports=P1,P2,...`` once every worker listens;
- ``busy`` / ``free``: flip the mode; answer ``ok busy T`` / ``ok free T``. ``T`` is the
  ``time.monotonic()`` at which every worker had its new load *and* every batch due at once
  (edges, ``v1``'s every change) had been written to its socket, so the simulator's whole share
  of a flip is before ``T`` (fleet_sim stamps before its workers send). With ``--paused`` the
  first one also starts the ticking. A line on stderr says how long the loads and the writes took.
- ``stats``: answer ``stats {json}``: ``generated`` load changes, ``load_events`` and
  ``heartbeats`` taken into batches, ``batches`` (event-plane messages), ``subscribers``
  connected, ``kv_events`` sent, ``kv_messages`` (``kv`` messages), ``kv_snapshots`` sent (of
  the events), and ``monotonic`` (``time.monotonic()``);
- ``quit`` or end of input: stop.

Left out, as no frontend of a benchmark needs them: the bearer token, TLS, the system port,
draining, the worker's cap on event subscribers.
The pieces, in ``bench/fleet/`` (this file is the loop and the control): ``lean_frames.py``
(rule 1's websocket), ``lean_workers.py`` (rules 2 and 3: the hello, the limits, the load; the
load model is both simulators', ``model.py``) and ``lean_planes.py`` (rule 1's upgrade, rules 4
to 6: the event and request planes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import json
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shim_common.wire import (
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    RankLoad,
)

if not __package__:
    # Run as ``python bench/lean_sim.py``: the package ``bench`` is in the folder above, as it is
    # for ``python -m bench.lean_sim``.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fleet.lean_planes import Connection, EventPlane, RequestPlane
from bench.fleet.lean_workers import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_SLOTS,
    KEEPALIVE_SWEEP,
    PUBLISH_INTERVAL,
    SimWorker,
    hello_of,
)
from bench.fleet.model import (
    BUSY_RANGE,
    FREE_RANGE,
    KV_TOTAL_BLOCKS,
    SLOTS,
    Counters,
    Protocol,
    set_up,
    simulator_parser,
)

__all__ = ["Fleet", "main"]

# ----------------------------------------------------------------------------- the loop


class _Listener:
    """A worker's listening socket: accepts connections for it."""

    def __init__(self, fleet: Fleet, worker: SimWorker) -> None:
        self.fleet = fleet
        self.worker = worker
        self.closed = False

    def on_readable(self) -> None:
        fleet = self.fleet
        for _ in range(64):
            try:
                sock, _address = self.worker.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, say: the client retries
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = Connection(fleet, sock, self.worker, fleet.now)
            fleet.connections.add(connection)
            fleet.selector.register(sock, selectors.EVENT_READ, connection)

    def on_writable(self) -> None:
        """Never registered for writing."""


class _Control:
    """Standard input: one command per line (see the module docstring)."""

    def __init__(self, fleet: Fleet, fd: int) -> None:
        self.fleet = fleet
        self.fd = fd
        self.closed = False
        self._buffer = b""

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.fleet.running = False
            return
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self.fleet.command(line.decode().strip())

    def on_writable(self) -> None:
        """Never registered for writing."""


class Fleet:
    """The simulated workers and the one loop that serves them all."""

    def __init__(
        self,
        workers: int,
        ranks: int,
        rate: float,
        prefix: str,
        paused: bool,
        protocol: Protocol,
        answer: Callable[[str], None],
        kv_blocks: int = 0,
    ) -> None:
        self.protocol = protocol
        #: Blocks per stored chain (rule 6; 0: no KV events), chains a rank holds at most, and
        #: the pending names past which a subscriber is sent a snapshot instead.
        self.kv_blocks = kv_blocks if protocol == "new" else 0
        self.kv_chains_per_rank = KV_TOTAL_BLOCKS // kv_blocks if kv_blocks else 0
        self.kv_backlog_limit = max(1024, KV_TOTAL_BLOCKS * ranks)
        self.ranks = ranks
        self.rate = rate
        self.answer = answer
        self.counters = Counters()
        self.publish_interval = 0.0 if protocol == "v1" else PUBLISH_INTERVAL
        self.selector = selectors.DefaultSelector()
        self.connections: set[Connection] = set()
        #: Request planes with requests in flight (stepped every pass).
        self.stepping: set[RequestPlane] = set()
        self.running = True
        self.busy = False
        self.now = time.monotonic()
        #: While a flip sets every load: the subscribers whose batch is due at once.
        self.due_now: list[EventPlane] | None = None
        self._timers: list[tuple[float, int, EventPlane]] = []
        self._timer_order = itertools.count()
        # One RankLoad per (rank, decode blocks): a load is picked, never built, on a tick.
        self._rank_loads = [
            [
                RankLoad(
                    dp_rank=rank,
                    active_decode_blocks=blocks,
                    active_prefill_tokens=0,
                    kv_used_blocks=blocks + 1,
                )
                for blocks in range(KV_TOTAL_BLOCKS)
            ]
            for rank in range(ranks)
        ]
        self.workers: list[SimWorker] = []
        for index in range(workers):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
            hello = hello_of(f"{prefix}-{index}", ranks, protocol, kv_events=bool(self.kv_blocks))
            worker = SimWorker(index, listener, hello, ranks)
            self.workers.append(worker)
            self.selector.register(listener, selectors.EVENT_READ, _Listener(self, worker))
        self._tick_shares = [self.workers[slot::SLOTS] for slot in range(SLOTS)]
        self._tick_seconds = 1.0 / rate / SLOTS if rate > 0 else 0.0
        self._tick_slot = 0
        self._tick_at: float | None = None if paused or rate <= 0 else self.now + self._tick_seconds
        self._heartbeat_shares = [
            self.workers[slot::HEARTBEAT_SLOTS] for slot in range(HEARTBEAT_SLOTS)
        ]
        self._heartbeat_seconds = HEARTBEAT_INTERVAL / HEARTBEAT_SLOTS
        self._heartbeat_slot = 0
        self._heartbeat_at = self.now + self._heartbeat_seconds
        self._keepalive_at = self.now + KEEPALIVE_SWEEP

    @property
    def ports(self) -> list[int]:
        return [worker.listener.getsockname()[1] for worker in self.workers]

    # -- bookkeeping of connections and timers

    def replace(self, old: Connection, new: Connection) -> None:
        """An upgraded connection takes over its socket from the one that read the upgrade."""
        self.connections.discard(old)
        old.closed = True
        self.connections.add(new)
        self.selector.modify(new.sock, selectors.EVENT_READ, new)

    def forget(self, connection: Connection) -> None:
        self.connections.discard(connection)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection.sock)
        if isinstance(connection, EventPlane):
            subscribers = connection.worker.subscribers
            if connection in subscribers:
                subscribers.remove(connection)

    def at(self, when: float, subscriber: EventPlane) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_order), subscriber))

    # -- load and heartbeats

    def tick(self, worker: SimWorker, low: int, span: int, wall: float, now: float) -> None:
        """Give every rank of ``worker`` a new load (different from its last) in the range."""
        step = worker.step = worker.step + 1
        ranks = self.ranks
        worker.loads = [self._rank_loads[rank][low + (step + rank) % span] for rank in range(ranks)]
        worker.load_seq = worker.seq + 1
        worker.seq += ranks
        worker.load_ts = wall
        self.counters.generated += ranks
        if self.kv_blocks:
            self._churn(worker)
        for subscriber in worker.subscribers:
            subscriber.changed(now)

    def _churn(self, worker: SimWorker) -> None:
        """Store one chain per rank, evicting the oldest first when the rank is full (rule 6)."""
        size = self.kv_blocks
        subscribers = [s for s in worker.subscribers if s.kv_on]
        for rank, chains in enumerate(worker.kv_chains):
            base = (worker.index * self.ranks + rank) << 32
            events: list[KvEvent] = []
            if chains[1] - chains[0] >= self.kv_chains_per_rank:
                start = base + chains[0] * size
                worker.kv_seq += 1
                events.append(
                    KvRemoved(
                        seq=worker.kv_seq, dp_rank=rank, blocks=list(range(start, start + size))
                    )
                )
                chains[0] += 1
            start = base + chains[1] * size
            worker.kv_seq += 1
            events.append(
                KvStored(
                    seq=worker.kv_seq,
                    dp_rank=rank,
                    parent=None,
                    blocks=list(range(start, start + size)),
                )
            )
            chains[1] += 1
            for subscriber in subscribers:
                for event in events:
                    subscriber.kv_event(event, size)

    def kv_snapshot(self, worker: SimWorker) -> KvSnapshot:
        """The worker's whole cache as of its last KV event (rule 6)."""
        size = self.kv_blocks
        ranks = []
        for rank, (oldest, following) in enumerate(worker.kv_chains):
            base = (worker.index * self.ranks + rank) << 32
            ranks.append(list(range(base + oldest * size, base + following * size)))
        return KvSnapshot(seq=worker.kv_seq, ranks=ranks)

    def _mode_range(self) -> tuple[int, int]:
        low_fraction, high_fraction = BUSY_RANGE if self.busy else FREE_RANGE
        low = int(low_fraction * KV_TOTAL_BLOCKS)
        span = max(2, int(high_fraction * KV_TOTAL_BLOCKS) - low)
        return low, span

    def flip(self, busy: bool) -> float:
        """Change the mode and give every worker a load of it now; return ``time.monotonic()``
        once the loads are set and the batches due at once are written."""
        began = time.monotonic()
        self.busy = busy
        low, span = self._mode_range()
        wall = time.time()
        self.now = began
        # Every load first, then the batches due at once, so the two costs can be told apart.
        self.due_now = []
        for worker in self.workers:
            self.tick(worker, low, span, wall, began)
        loaded = time.monotonic()
        due, self.due_now = self.due_now, None
        for subscriber in due:
            subscriber.send_pending(loaded)
        done = time.monotonic()
        if self._tick_at is None and self.rate > 0:
            self._tick_at = done + self._tick_seconds
        print(
            f"flip {'busy' if busy else 'free'}: {len(self.workers)} workers' loads in "
            f"{(loaded - began) * 1000:.1f} ms, then {len(due)} batches written in "
            f"{(done - loaded) * 1000:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        return done

    def _run_ticks(self, now: float) -> None:
        at = self._tick_at
        if at is None or now < at:
            return
        seconds = self._tick_seconds
        due = 1 + int((now - at) / seconds)
        self._tick_at = at + due * seconds
        low, span = self._mode_range()
        wall = time.time()
        for offset in range(min(due, SLOTS)):
            for worker in self._tick_shares[(self._tick_slot + offset) % SLOTS]:
                self.tick(worker, low, span, wall, now)
        self._tick_slot = (self._tick_slot + due) % SLOTS

    def _run_heartbeats(self, now: float) -> None:
        if now < self._heartbeat_at:
            return
        seconds = self._heartbeat_seconds
        due = 1 + int((now - self._heartbeat_at) / seconds)
        self._heartbeat_at += due * seconds
        wall = time.time()
        for offset in range(min(due, HEARTBEAT_SLOTS)):
            slot = (self._heartbeat_slot + offset) % HEARTBEAT_SLOTS
            for worker in self._heartbeat_shares[slot]:
                worker.heartbeat = worker.new_heartbeat(wall)
                for subscriber in worker.subscribers:
                    subscriber.schedule(now)
        self._heartbeat_slot = (self._heartbeat_slot + due) % HEARTBEAT_SLOTS

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            when, _, subscriber = heapq.heappop(timers)
            if subscriber.closed or subscriber.send_at != when:
                continue  # replaced by an earlier one, or gone
            subscriber.send_at = None
            subscriber.schedule(now)

    def _run_keepalive(self, now: float) -> None:
        if now < self._keepalive_at:
            return
        self._keepalive_at = now + KEEPALIVE_SWEEP
        for connection in list(self.connections):
            connection.keepalive(now)

    # -- control

    def command(self, command: str) -> None:
        if command in ("busy", "free"):
            applied = self.flip(command == "busy")
            self.answer(f"ok {command} {applied}")
        elif command == "stats":
            self.answer("stats " + json.dumps(self.stats()))
        elif command == "quit":
            self.running = False
        elif command:
            self.answer(f"error unknown command {command!r}")

    def stats(self) -> dict[str, float]:
        return {
            **dataclasses.asdict(self.counters),
            "subscribers": sum(len(worker.subscribers) for worker in self.workers),
            "monotonic": time.monotonic(),
        }

    # -- the loop

    def _timeout(self, now: float) -> float:
        if self.stepping:
            return 0.0
        deadline = min(self._heartbeat_at, self._keepalive_at)
        if self._tick_at is not None:
            deadline = min(deadline, self._tick_at)
        if self._timers:
            deadline = min(deadline, self._timers[0][0])
        return max(0.0, deadline - now)

    def serve(self, control_fd: int) -> None:
        """Run until ``quit`` or the end of the control input."""
        os.set_blocking(control_fd, False)
        self.selector.register(control_fd, selectors.EVENT_READ, _Control(self, control_fd))
        select = self.selector.select
        while self.running:
            now = time.monotonic()
            for key, mask in select(self._timeout(now)):
                handler = key.data
                self.now = time.monotonic()
                if mask & selectors.EVENT_READ and not handler.closed:
                    handler.on_readable()
                if mask & selectors.EVENT_WRITE and not handler.closed:
                    handler.on_writable()
            now = self.now = time.monotonic()
            self._run_ticks(now)
            self._run_heartbeats(now)
            self._run_timers(now)
            self._run_keepalive(now)
            for connection in list(self.stepping):
                connection.step()

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()
        for worker in self.workers:
            worker.listener.close()
        self.selector.close()


def main() -> None:
    parser = simulator_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="KV events (protocol new): each rank's tick stores a chain of this many blocks, "
        "evicting the oldest once full (0: no KV events)",
    )
    options = parser.parse_args()
    set_up(options)

    def answer(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    fleet = Fleet(
        options.workers,
        options.ranks,
        options.rate,
        options.id_prefix,
        options.paused,
        options.protocol,
        answer,
        kv_blocks=max(options.kv_blocks, 0),
    )
    # Few long-lived objects, but thousands of connections' worth: out of the collector's view.
    gc.freeze()
    answer(f"fleet-sim ready workers={len(fleet.workers)} ports={','.join(map(str, fleet.ports))}")
    try:
        fleet.serve(sys.stdin.fileno())
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
