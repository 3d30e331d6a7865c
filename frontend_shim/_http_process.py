"""One HTTP process of a frontend of several (``--processes N``): the port, the API, the relay.

Started by the host process (:mod:`frontend_shim._processes`) as
``python -m frontend_shim._http_process --channel FD --board FD --processes N``, with its end of
the host's channel and the shed board's memory file inherited. It serves the same API as a
frontend of one process, with these differences:

1. Its picks are the host's (:class:`~frontend_shim._host_client.RemotePicture`); the fast shed
   reads the host's board, ``/v1/models``, ``/health`` and ``GET /busy_threshold`` the host's
   overview, and ``POST /busy_threshold`` is made at the host, which passes it to every
   process and worker.
2. Its worker links open the request planes only: the host follows the events, once.
3. It listens on the frontend's port with ``SO_REUSEPORT``, beside its siblings: the kernel
   spreads new connections over them. Where that option is missing (or
   ``DYN_FRONTEND_PORT_SHARING=inherit``), the host listens and every process accepts from
   the host's socket, which it inherits (the process that is free first takes a connection).
4. ``/metrics`` is the whole frontend's: the host merges every process's samples with its own
   (:mod:`frontend_shim._metrics_merge`).
5. SIGTERM (forwarded by the host) drains it as it drains a frontend of one process; a host
   that goes away stops it at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import prometheus_client
import trio

from frontend_shim import _host_wire as msg
from frontend_shim._admin import AdminRoutes
from frontend_shim._api import FrontendAPI
from frontend_shim._app import (
    EXIT_ANSWER_SECONDS,
    drain,
    loop_guard,
    tokenizer_of,
    worker_pool,
)
from frontend_shim._host_channel import Channel
from frontend_shim._host_client import HostClient, HostGone, HostView, RemotePicture
from frontend_shim._link_directory import LinkDirectory
from frontend_shim._metrics import FrontendMetrics
from frontend_shim._metrics_merge import families_of
from frontend_shim._request_class import ClassPolicy
from frontend_shim._shed_board import ShedBoard
from shim_common._access import server_context
from shim_common._httpserver import HTTPLimits, IdleConnections, Shutdown, serve_http_listeners
from shim_common._net import CLOSE_BATCH

__all__ = ["main", "run_http_process", "shared_port_listener"]

_log = logging.getLogger("frontend_shim")

#: Connections the kernel queues for a process before it accepts them.
_BACKLOG = 4096


def shared_port_listener(
    host: str, port: int, *, listen: bool = True, reuse_port: bool = True
) -> socket.socket:
    """A socket bound to ``host:port``, with ``SO_REUSEPORT`` unless told not to (rule 3);
    listening unless asked not to (the host's, which only holds the port for its processes).

    Raises:
        OSError: the address cannot be bound, or ``SO_REUSEPORT`` is not available here.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            option = getattr(socket, "SO_REUSEPORT", None)
            if option is None:
                raise OSError("SO_REUSEPORT is not available on this system")
            sock.setsockopt(socket.SOL_SOCKET, option, 1)
        sock.bind(address)
        if listen:
            sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


async def run_http_process(
    channel_fd: int, board_fd: int, processes: int, listener_fd: int | None = None
) -> None:
    """Serve as the host's process until SIGTERM or the host's end (rules at the top)."""
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    sock = socket.socket(fileno=channel_fd)
    channel: Channel[msg.FromHost, msg.FromProcess] = Channel(sock, msg.FromHost)  # type: ignore[arg-type]
    first = await channel.receive()
    setup = first[0]
    if not isinstance(setup, msg.Setup):
        raise RuntimeError(f"the host spoke {type(setup).__name__} first")
    settings = setup.settings
    board = ShedBoard.attach(board_fd, processes)
    host = HostClient(channel, board, setup.index)
    metrics = FrontendMetrics(lambda: ())
    host.on_collect(lambda: families_of(metrics.registry))
    host.take(first[1:])  # what came with the setup
    idle_http = IdleConnections()
    pool = worker_pool(
        settings,
        setup.workers,
        lambda: idle_http.close_oldest(CLOSE_BATCH),
        event_plane=False,
    )
    links = LinkDirectory(host.key_of)
    links.watch(pool.links)

    async def render_metrics(accept: str | None) -> tuple[bytes, str]:
        answer = await host.ask(lambda ask: msg.MetricsAsk(ask=ask, accept=accept))
        assert isinstance(answer, msg.MetricsText)
        return answer.body, answer.content_type

    api = FrontendAPI(
        overload_status=settings.overload_status,
        busy_exempt_priority=settings.busy_exempt_priority,
        class_policy=ClassPolicy(
            max_client_priority=settings.max_client_priority,
            gateway_token=None
            if settings.gateway_token is None
            else settings.gateway_token.encode(),
        ),
        fleet=HostView(host),
        picture=RemotePicture(
            host,
            tokenizer_of(settings) if settings.router_mode == "kv" else None,
            settings.router_track_output_blocks,
        ),
        migration_limit=settings.migration_limit,
        links=links,
        admin=AdminRoutes(host, disabled=settings.admin_api_disabled, token=settings.admin_token),
        waiting=None,
        metrics=metrics,
        render_metrics=render_metrics,
        guard=loop_guard(settings),
    )
    tls = (
        server_context(settings.tls_cert_path, settings.tls_key_path)
        if settings.tls_cert_path is not None and settings.tls_key_path is not None
        else None
    )
    if listener_fd is None:
        sock = shared_port_listener(settings.http_host, settings.http_port)
    else:  # the host's own listening socket, shared by every process (rule 3)
        sock = socket.socket(fileno=listener_fd)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    http_shutdown = Shutdown()
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.run_sender)

            async def follow_host() -> None:
                try:
                    await host.run()
                except HostGone as exc:
                    _log.warning("the frontend's host process is gone (%s): stopping", exc)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(follow_host)
            nursery.start_soon(
                lambda: serve_http_listeners(
                    api.handle,
                    [listener],
                    limits=HTTPLimits(
                        max_body_bytes=settings.max_body_bytes,
                        send_timeout=settings.http_send_timeout,
                    ),
                    on_error=lambda _exc: metrics.count_connection_error(),
                    on_send_stall=metrics.count_send_stall,
                    ssl_context=tls,
                    on_tls_failure=metrics.count_tls_failure,
                    idle=idle_http,
                    shutdown=http_shutdown,
                    answer_at_once=api.answer_at_once,
                )
            )
            # Ready once the port listens (the listener was bound above), before any link
            # starts: a large fleet's links come up while /live and /health already answer,
            # as in a frontend of one process.
            channel.post(msg.Ready(pid=os.getpid()))
            await nursery.start(pool.run, links)
            async for signum in signals:
                name = signal.Signals(signum).name
                _log.debug("HTTP process %d: %s, draining", setup.index, name)
                break
            await drain(api, settings.drain_grace, signals)
            await http_shutdown.close(EXIT_ANSWER_SECONDS)
            nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    """The entry point the host starts its processes with."""
    parser = argparse.ArgumentParser(prog="frontend_shim._http_process")
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--board", type=int, required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--listener", type=int, default=None)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # SIGINT is the host's to handle (a terminal's ^C reaches the whole group): the host
    # forwards what it decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trio.run(run_http_process, args.channel, args.board, args.processes, args.listener)


if __name__ == "__main__":
    main()
