"""A frontend of several processes (``--processes N``): one host, N HTTP processes, one port.

One Python process serves one core. With ``--processes N`` (N > 1) the frontend is N HTTP
processes (:mod:`frontend_shim._http_process`) on one port and one host process, this module,
which:

1. holds the port: it binds the frontend's address with ``SO_REUSEPORT`` (so port 0 is chosen
   once) and each HTTP process listens on it beside its siblings; where the system lacks the
   option (or ``DYN_FRONTEND_PORT_SHARING=inherit``), it listens itself and every process
   accepts from that one socket;
2. keeps the picture of the fleet, the only one: it follows every worker's events once, holds
   the ``kv`` index once, and answers the picks of every process (:mod:`frontend_shim._picker`);
   so N processes route as one frontend would;
3. starts ``--local-workers`` once, and the N processes, each with its end of a channel and
   the shed board (:mod:`frontend_shim._shed_board`);
4. restarts a process that exits while the frontend is not draining (after a delay that
   doubles on each restart in a row, up to a few seconds); what the process held is released
   at once (:mod:`frontend_shim._picker` rule 2) and its counters are kept (rule 6);
5. prints one ready line, ``frontend-shim ready http=...``, once every process serves;
6. merges ``/metrics``: a process asked for it asks the host, which collects every process's
   samples (each answers within a second, or its last snapshot stands) and adds its own and
   those of processes gone (:mod:`frontend_shim._metrics_merge`); it also takes a snapshot of
   every process every few seconds, so a crash loses no more than that;
7. on SIGTERM or SIGINT passes SIGTERM to every process (each drains as a frontend of one
   process does), waits for all of them within the grace period (a second signal is passed on
   too, and ends their drain), then stops the links and the local workers. A process still up
   a few seconds past the grace is killed.

Task tree::

    run_frontend_processes
    ├── run_local_workers     the local workers, stopped last
    ├── WorkerPool.run        one link per worker; events -> FleetBridge -> Fleet (once)
    ├── Supervisor.run        one task per process slot: start, serve its picks, restart
    │   └── Picker.serve      per process: its channel's sender and its messages
    └── _tick                 expiry, the frontend queue, the board (the overview every 0.25 s)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Final

import prometheus_client
import trio

from frontend_shim import _host_wire as msg
from frontend_shim._admin import FleetThresholds
from frontend_shim._app import (
    PictureParts,
    budget_sample,
    link_samples,
    log_thresholds,
    picture_parts,
    worker_pool,
)
from frontend_shim._config import FrontendSettings
from frontend_shim._fleet_bridge import FleetBridge
from frontend_shim._host_channel import Channel
from frontend_shim._http_process import shared_port_listener
from frontend_shim._local import run_local_workers
from frontend_shim._metrics_merge import Retired, families_of, merge, render
from frontend_shim._picker import Picker, ProcessBooks
from frontend_shim._picture import LocalPicture
from frontend_shim._shed_board import ShedBoard
from frontend_shim._waiting import WaitingRoom
from shim_common._net import base_url

__all__ = ["Supervisor", "run_frontend_processes", "usable_cores"]

_log = logging.getLogger(__name__)

#: Seconds between the host's looks at time-driven changes (marks, staleness, the queue).
TICK_INTERVAL: Final = 0.05
#: Ticks between two overviews sent to the processes (models, workers connected, thresholds:
#: what they answer /v1/models and /health with; a threshold change is sent at once).
OVERVIEW_TICKS: Final = 5
#: Seconds a process gets to answer a metrics collection before its last snapshot stands.
COLLECT_TIMEOUT: Final = 1.0
#: Seconds between the host's unasked snapshots of every process's metrics (rule 6).
SNAPSHOT_INTERVAL: Final = 5.0
#: Seconds a process may outlive the drain grace before it is killed (rule 7).
KILL_AFTER_GRACE: Final = 5.0
#: The first and the largest delay before a process that exited is started again (rule 4).
RESTART_DELAY: Final = 0.1
RESTART_DELAY_CAP: Final = 5.0
#: A process that served this long before it exited restarts after the first delay again.
HEALTHY_RUN: Final = 30.0


class Supervisor:
    """The HTTP processes of a frontend: started, served, restarted, drained (rules 3-7).

    Args:
        processes: how many.
        picker: the host's picture, serving their picks.
        board: the shed board they read.
        settings: what each runs on (the port the host holds).
        workers: every worker URL.
        snapshot: the host's own metrics, as samples (its fleet's gauges).
        python: the interpreter that runs them.
    """

    def __init__(
        self,
        processes: int,
        picker: Picker,
        board: ShedBoard,
        settings: FrontendSettings,
        workers: list[str],
        snapshot: Callable[[], Awaitable[list[msg.SampleFamily]]] | None = None,
        *,
        python: str = sys.executable,
        listener: socket.socket | None = None,
    ) -> None:
        self.processes = processes
        self._picker = picker
        self._board = board
        self._settings = settings
        self._workers = workers
        self._python = python
        self._own_snapshot = snapshot
        #: The host's listening socket every process accepts from, where the port is not
        #: shared with SO_REUSEPORT (rule 1).
        self._listener = listener
        self.retired = Retired()
        self.draining = False
        self.restarts = 0
        self._procs: dict[int, trio.Process] = {}
        self._ready: set[int] = set()
        self._all_ready = trio.Event()
        #: Set once the drain began and no process is up.
        self._all_gone = trio.Event()
        self._collects = itertools.count(1)
        self._collect_waits: dict[int, tuple[set[int], trio.Event]] = {}
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ messages for the host

    def on_message(self, books: ProcessBooks, message: msg.FromProcess) -> None:
        """A process's :class:`~frontend_shim._host_wire.Ready` or metrics ask (the picker
        passes on what is not its own)."""
        if isinstance(message, msg.Ready):
            self._ready.add(books.index)
            _log.debug("HTTP process %d (pid %d) serves", books.index, message.pid)
            if len(self._ready) >= self.processes:
                self._all_ready.set()
        elif isinstance(message, msg.MetricsAsk) and self._nursery is not None:
            self._nursery.start_soon(self._answer_metrics, books, message)

    def on_samples(self, books: ProcessBooks, samples: msg.Samples) -> None:
        wait = self._collect_waits.get(samples.ask)
        if wait is not None:
            wait[0].discard(books.index)
            if not wait[0]:
                wait[1].set()

    async def _answer_metrics(self, books: ProcessBooks, ask: msg.MetricsAsk) -> None:
        body, content_type = await self.metrics(ask.accept)
        books.channel.post(msg.MetricsText(ask=ask.ask, body=body, content_type=content_type))

    async def metrics(self, accept: str | None) -> tuple[bytes, str]:
        """The whole frontend's exposition (rule 6)."""
        await self.collect(wait=True)
        own = await self._own_snapshot() if self._own_snapshot is not None else []
        sources = [own, self.retired.families()]
        sources += [books.last_samples for books in self._picker.processes]
        return await trio.to_thread.run_sync(lambda: render(merge(sources), accept))

    async def collect(self, *, wait: bool) -> None:
        """Ask every process for its samples; with ``wait``, until all answered or a second."""
        processes = self._picker.processes
        ask = next(self._collects)
        pending = {books.index for books in processes}
        done = trio.Event()
        if wait and pending:
            self._collect_waits[ask] = (pending, done)
        for books in processes:
            books.channel.post(msg.Collect(ask=ask))
        if wait and pending:
            try:
                with trio.move_on_after(COLLECT_TIMEOUT):
                    await done.wait()
            finally:
                self._collect_waits.pop(ask, None)

    # ------------------------------------------------------------------ the processes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep every process up until the drain ends them; ready once all serve (rule 5)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for index in range(self.processes):
                nursery.start_soon(self._keep, index)
            nursery.start_soon(self._snapshots)
            await self._all_ready.wait()
            task_status.started()
            await self._wait_all_gone()
            nursery.cancel_scope.cancel()

    async def _wait_all_gone(self) -> None:
        await self._all_gone.wait()

    def _note_gone(self) -> None:
        if self.draining and not self._procs:
            self._all_gone.set()

    async def _snapshots(self) -> None:
        while True:
            await trio.sleep(SNAPSHOT_INTERVAL)
            await self.collect(wait=False)

    async def _keep(self, index: int) -> None:
        """One slot: start its process, serve it, start it again when it exits (rule 4)."""
        delay = RESTART_DELAY
        while not self.draining:
            started = trio.current_time()
            code = await self._run_once(index)
            if self.draining:
                return
            self.restarts += 1
            if trio.current_time() - started >= HEALTHY_RUN:
                delay = RESTART_DELAY
            _log.warning(
                "HTTP process %d exited with %s; starting it again in %.1f s", index, code, delay
            )
            await trio.sleep(delay)
            delay = min(RESTART_DELAY_CAP, delay * 2)

    async def _run_once(self, index: int) -> int | None:
        host_end, process_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            self._python,
            "-m",
            "frontend_shim._http_process",
            "--channel",
            str(process_end.fileno()),
            "--board",
            str(self._board.fd),
            "--processes",
            str(self.processes),
            "--log-level",
            str(logging.getLogger("frontend_shim").getEffectiveLevel()),
        ]
        inherited = [process_end.fileno(), self._board.fd]
        if self._listener is not None:
            command += ["--listener", str(self._listener.fileno())]
            inherited.append(self._listener.fileno())
        try:
            proc = await trio.lowlevel.open_process(command, pass_fds=inherited)
        finally:
            process_end.close()
        self._procs[index] = proc
        channel: Channel[msg.FromProcess, msg.FromHost] = Channel(host_end, msg.FromProcess)  # type: ignore[arg-type]
        channel.post(msg.Setup(index=index, settings=self._settings, workers=self._workers))
        books = ProcessBooks(index, channel)
        try:
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    await self._picker.serve(books)
                    # The channel ended: the process is gone or broke it; make sure it goes.
                    if proc.returncode is None:
                        proc.terminate()

                nursery.start_soon(serve)
                await proc.wait()
                channel.close()
        finally:
            self._procs.pop(index, None)
            self._ready.discard(index)
            self.retired.add(books.last_samples)
            if proc.returncode is None:
                proc.kill()
            self._note_gone()
        return proc.returncode

    def signal_all(self, signum: int) -> None:
        """Pass a signal to every process up."""
        for proc in list(self._procs.values()):
            if proc.returncode is None:
                proc.send_signal(signum)

    async def drain(self, grace: float, signals: AsyncIterator[int]) -> None:
        """Rule 7: every process drains; the second signal is passed on too."""
        self.draining = True
        self._note_gone()
        self.signal_all(signal.SIGTERM)
        with trio.move_on_after(grace + KILL_AFTER_GRACE) as scope:
            async with trio.open_nursery() as nursery:

                async def pass_on() -> None:
                    async for signum in signals:
                        _log.warning("received %s again: stopping now", signal.Signals(signum).name)
                        self.signal_all(signal.SIGTERM)

                nursery.start_soon(pass_on)
                await self._wait_all_gone()
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            _log.warning("HTTP processes still up past the drain grace: killing them")
            self.signal_all(signal.SIGKILL)


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on (``--processes auto``): the CPUs of its affinity,
    fewer when its control group's CPU quota allows less (a container's CPU limit), rounded up.
    """
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = _cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _cpu_quota(cgroup: Path) -> float | None:
    """The CPUs a control group's quota allows (v2 ``cpu.max``, else v1), ``None``: no quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


async def run_frontend_processes(
    settings: FrontendSettings,
    processes: int,
    *,
    python: str = sys.executable,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a frontend of ``processes`` HTTP processes until SIGTERM/SIGINT (the module's rules).

    Prints ``frontend-shim ready http=http://HOST:PORT`` once every process serves, and
    reports the same URL through ``task_status``.
    """
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    log_thresholds(settings)
    parts: PictureParts = picture_parts(settings)
    fleet, metrics, waiting = parts.fleet, parts.metrics, parts.waiting
    held, shared = _hold_port(settings)
    port = held.getsockname()[1]
    board = ShedBoard.create(processes)
    try:
        async with trio.open_nursery() as nursery:
            local_urls: list[str] = []
            if settings.local_workers:
                local_urls = await nursery.start(
                    run_local_workers, settings.local_workers, list(settings.local_worker_args)
                )
            elif not settings.workers:
                _log.warning("no --worker and no --local-workers: every request will get 503")
            workers = [*settings.workers, *local_urls]
            # The host follows the events and sends no request: its links are event planes.
            pool = worker_pool(settings, workers, None, request_plane=False)
            picker = Picker(
                LocalPicture(fleet, parts.router, parts.kv_routing),
                board,
                waiting if settings.router_queue_threshold is not None else None,
                FleetThresholds(fleet, on_change=pool.thresholds_changed),
            )

            def changed() -> None:
                # After every batch of events: the board (O(1)); the overview, which reads
                # every worker, on the tick.
                waiting.release()
                picker.publish_board(trio.current_time())

            bridge = FleetBridge(
                fleet,
                on_change=changed,
                links=pool.links,
                kv_index=parts.kv_index,
                on_collision=metrics.count_worker_id_collision,
            )
            metrics.watch_links(lambda: link_samples(pool, bridge))
            metrics.watch_event_budget(lambda: budget_sample(pool))
            supervisor = Supervisor(
                processes,
                picker,
                board,
                dataclasses.replace(settings, http_port=port, local_workers=0),
                workers,
                functools.partial(metrics.off_loop, families_of, metrics.registry),
                python=python,
                listener=shared,
            )
            picker.key_of = bridge.key_of
            picker.on_message = supervisor.on_message
            picker.on_samples = supervisor.on_samples
            picker.publish(trio.current_time())
            await nursery.start(
                functools.partial(pool.run, bridge, on_link_stopped=bridge.link_stopped)
            )
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                await nursery.start(supervisor.run)
                scheme = "https" if settings.tls_cert_path is not None else "http"
                url = base_url(scheme, settings.http_host, port)
                print(f"frontend-shim ready http={url}", flush=True)
                gc.freeze()
                task_status.started(url)
                nursery.start_soon(_tick, picker, waiting)
                async for signum in signals:
                    _log.info(
                        "received %s: draining %d HTTP processes (%.1f s grace)",
                        signal.Signals(signum).name,
                        processes,
                        settings.drain_grace,
                    )
                    break
                await supervisor.drain(settings.drain_grace, signals)
            nursery.cancel_scope.cancel()
    finally:
        held.close()
        board.close()
    sys.stdout.flush()


#: ``reuseport`` (the default where the system has it) or ``inherit`` (rule 1).
PORT_SHARING_ENV: Final = "DYN_FRONTEND_PORT_SHARING"


def _hold_port(settings: FrontendSettings) -> tuple[socket.socket, socket.socket | None]:
    """The host's socket on the frontend's address, and the listening socket the processes
    inherit when the port is not shared with ``SO_REUSEPORT`` (rule 1)."""
    host, port = settings.http_host, settings.http_port
    sharing = os.environ.get(PORT_SHARING_ENV, "reuseport").strip().lower()
    if sharing != "inherit":
        if _reuse_port_works():
            return shared_port_listener(host, port, listen=False), None
        _log.warning("SO_REUSEPORT is not available: the HTTP processes share one socket")
    listener = shared_port_listener(host, port, reuse_port=False)
    listener.set_inheritable(True)
    return listener, listener


def _reuse_port_works() -> bool:
    option = getattr(socket, "SO_REUSEPORT", None)
    if option is None:
        return False
    with socket.socket() as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, option, 1)
        except OSError:
            return False
    return True


async def _tick(picker: Picker, waiting: WaitingRoom) -> None:
    # Time alone changes the picture (staleness, mark leases): look again often, since the
    # board is what every process sheds by; the overview (models, workers connected, block
    # sizes), which reads every worker, less often.
    ticks = 0
    while True:
        await trio.sleep(TICK_INTERVAL)
        waiting.release()
        ticks += 1
        if ticks % OVERVIEW_TICKS:
            picker.publish_board(trio.current_time())
        else:
            picker.publish(trio.current_time())

