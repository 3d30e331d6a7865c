"""A frontend of several processes routes on one picture: the host's picker, its channels,
the shed board and the merged metrics, driven with real sockets and no child process.

The interleavings that matter are driven on purpose: a pick in one process is in the picture
the next pick of another process reads; a close still in a process's hands (counted on the
board, not yet written) holds the host's "no worker free" until it arrives; a process that goes
away leaves nothing counted.
"""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families
from worker_configs import runtime_config

from frontend_shim import _host_wire as msg
from frontend_shim._host_channel import Channel, ChannelClosed
from frontend_shim._host_client import HostClient, RemotePicture, RemoteTicket
from frontend_shim._kv_index import KvIndex
from frontend_shim._kv_routing import KvMetrics, KvRouting
from frontend_shim._load import Fleet
from frontend_shim._metrics_merge import Retired, families_of, merge, render
from frontend_shim._picker import Picker, ProcessBooks
from frontend_shim._picture import LocalPicture, NoRoute, PickQuery
from frontend_shim._router import RejectionKind, Router, RouterMode
from frontend_shim._shed_board import ShedBoard
from shim_common import wire
from shim_common._busy import BusyThresholds
from shim_common.prefix import WordTokenizer

PROMPT = " ".join(f"w{i}" for i in range(20))


# ----------------------------------------------------------------------------- frames


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=6))
def test_frames_read_whole_however_the_bytes_are_cut(cuts: list[int]) -> None:
    messages: list[msg.FromProcess] = [
        msg.PickAsk(ask=1, model="m", names={16: [1, 2, 3]}, prompt_tokens=40, exclude=["w"]),
        msg.TicketFinished(
            ticket=7, final=wire.End(request_id=1, prompt_tokens=4, completion_tokens=1)
        ),
        msg.TicketRefused(ticket=8, reason="Server overloaded: x", priority=2, tenant="t"),
    ]
    data = msg.encode_frame(messages) + msg.encode_frame(messages[:1])
    reader = msg.FrameReader(msg.FromProcess)
    got: list[object] = []
    start = 0
    for cut in sorted(min(cut, len(data)) for cut in cuts):
        got += reader.feed(data[start:cut])
        start = cut
    got += reader.feed(data[start:])
    assert got == [*messages, messages[0]]


def test_a_frame_over_the_bound_or_undecodable_is_refused() -> None:
    reader = msg.FrameReader(msg.FromHost)
    with pytest.raises(ValueError, match="bytes"):
        reader.feed((msg.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="decode"):
        msg.FrameReader(msg.FromHost).feed(b"\x00\x00\x00\x01\xc1")


# ----------------------------------------------------------------------------- the board


def test_the_board_sheds_only_when_every_close_is_taken_in() -> None:
    board = ShedBoard.create(3)
    view = ShedBoard.attach(_dup(board.fd), 3)
    try:
        assert not view.verdict().may_shed  # nothing published yet
        board.publish(True, True, 0.5, closes_taken_in=0)
        assert view.verdict() == (True, True, 0.5)
        view.note_close(2)  # a process closed a ticket; the host has not taken it in
        assert not view.verdict().may_shed
        assert board.closes_of(2) == 1
        board.publish(True, False, 1.0, closes_taken_in=1)
        assert view.verdict() == (True, False, 1.0)
        board.publish(False, False, 1.0, closes_taken_in=1)
        assert not view.verdict().may_shed
    finally:
        view.close()
        board.close()


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)


# ----------------------------------------------------------------------------- metrics


def _registry(requests: float, inflight: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("dynamo_frontend_requests", "r", ["status"], registry=registry)
    counter.labels("200").inc(requests)
    gauge = Gauge("dynamo_frontend_inflight_requests", "i", registry=registry)
    gauge.set(inflight)
    return registry


def _value(body: bytes, name: str) -> float:
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def test_merged_metrics_sum_processes_and_never_go_backwards() -> None:
    a, b = families_of(_registry(3, 1)), families_of(_registry(5, 2))
    body, _ = render(merge([a, b]), None)
    assert _value(body, "dynamo_frontend_requests_total") == 8
    assert _value(body, "dynamo_frontend_inflight_requests") == 3
    # Process b dies: its counts stay, its in-flight gauge goes; its successor counts anew.
    retired = Retired()
    retired.add(b)
    successor = families_of(_registry(1, 0))
    body, _ = render(merge([a, retired.families(), successor]), None)
    assert _value(body, "dynamo_frontend_requests_total") == 9
    assert _value(body, "dynamo_frontend_inflight_requests") == 1


# ----------------------------------------------------------------------------- the picker


class _Host:
    """A picker over a fleet of one worker that one request makes busy, and its processes'
    ends of their channels, each a :class:`HostClient` as in a real HTTP process."""

    def __init__(self, processes: int) -> None:
        fleet = Fleet(default_thresholds=BusyThresholds(active_prefill_tokens=10))
        fleet.register(runtime_config("w-1"), now=trio.current_time())
        load = wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
        )
        event = wire.LoadEvent(seq=1, ts=0.0, load=load, engine_requests=0, queued_requests=0)
        fleet.apply("w-1", event, trio.current_time())
        kv = KvRouting(KvIndex(), WordTokenizer(), KvMetrics(CollectorRegistry()))
        router = Router(fleet, RouterMode.KV)
        self.fleet = fleet
        self.board = ShedBoard.create(processes)
        self.picker = Picker(LocalPicture(fleet, router, kv), self.board)
        self.books: list[ProcessBooks] = []
        self.clients: list[HostClient] = []
        for index in range(processes):
            host_end, process_end = socket.socketpair()
            self.books.append(ProcessBooks(index, Channel(host_end, msg.FromProcess)))  # type: ignore[arg-type]
            view = ShedBoard.attach(_dup(self.board.fd), processes)
            channel: Channel[msg.FromHost, msg.FromProcess] = Channel(process_end, msg.FromHost)  # type: ignore[arg-type]
            self.clients.append(HostClient(channel, view, index))

    def picture(self, index: int) -> RemotePicture:
        return RemotePicture(self.clients[index], WordTokenizer(), False)

    def query(self, index: int) -> PickQuery:
        prompt = self.picture(index).prompt("completions", {"model": "m", "prompt": PROMPT})
        return PickQuery("m", 0, "", False, prompt)

    def close(self) -> None:
        for books in self.books:
            books.channel.close()
        for client in self.clients:
            client.channel.close()
            client.board.close()
        self.board.close()

    def busy(self) -> bool:
        worker = self.fleet.worker("w-1")
        assert worker is not None
        return worker.busy


async def _serve(host: _Host, nursery: trio.Nursery, *, sender_of: set[int] | None = None) -> None:
    """The host serving every process, and each process reading its host; the processes whose
    index is in ``sender_of`` (all by default) write what they post."""
    for index, (books, client) in enumerate(zip(host.books, host.clients, strict=True)):
        nursery.start_soon(host.picker.serve, books)
        nursery.start_soon(client.run)
        if sender_of is None or index in sender_of:
            nursery.start_soon(client.channel.run_sender)
    host.picker.publish(trio.current_time())
    await trio.testing.wait_all_tasks_blocked()


async def test_a_pick_in_one_process_is_in_the_next_pick_of_another() -> None:
    with trio.fail_after(5):
        host = _Host(processes=2)
        async with trio.open_nursery() as nursery:
            await _serve(host, nursery)
            first = await host.picture(0).pick(host.query(0))
            assert isinstance(first, RemoteTicket)
            assert host.busy()  # charged at the pick, before any reply of the worker
            second = await host.picture(1).pick(host.query(1))
            assert second == NoRoute(RejectionKind.OVERLOADED, "busy")
            # The board says so too: every process may shed from a head now.
            await trio.testing.wait_all_tasks_blocked()
            assert host.clients[1].board.verdict().may_shed
            first.started(20, "m", trio.current_time())
            first.finished(wire.End(request_id=1, prompt_tokens=20, completion_tokens=1))
            third = await host.picture(1).pick(host.query(1))
            assert isinstance(third, RemoteTicket)
            nursery.cancel_scope.cancel()
        host.close()


async def test_a_close_on_its_way_holds_the_hosts_no_until_it_arrives() -> None:
    with trio.fail_after(5):
        host = _Host(processes=2)
        async with trio.open_nursery() as nursery:
            await _serve(host, nursery, sender_of={1})
            # Process 0's writer runs in a scope of its own, so the test can stop it.
            writer = trio.CancelScope()

            async def write0() -> None:
                with writer:
                    await host.clients[0].channel.run_sender()

            nursery.start_soon(write0)
            first = await host.picture(0).pick(host.query(0))
            assert isinstance(first, RemoteTicket)
            writer.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # The request ends: process 0 counts its close, but its writer is stopped.
            first.finished(wire.End(request_id=1, prompt_tokens=20, completion_tokens=1))
            assert not host.clients[1].board.verdict().may_shed  # no process sheds from a head
            results: list[object] = []
            answered = trio.Event()

            async def pick1() -> None:
                results.append(await host.picture(1).pick(host.query(1)))
                answered.set()

            nursery.start_soon(pick1)
            await trio.testing.wait_all_tasks_blocked()
            assert not results  # the host holds its answer for the close on its way
            nursery.start_soon(host.clients[0].channel.run_sender)
            await answered.wait()
            assert isinstance(results[0], RemoteTicket)
            nursery.cancel_scope.cancel()
        host.close()


async def test_a_process_that_goes_away_leaves_nothing_counted() -> None:
    with trio.fail_after(5):
        host = _Host(processes=2)
        async with trio.open_nursery() as nursery:
            await _serve(host, nursery)
            first = await host.picture(0).pick(host.query(0))
            assert isinstance(first, RemoteTicket)
            first.started(20, "m", trio.current_time())
            await trio.testing.wait_all_tasks_blocked()
            assert host.busy()
            host.clients[0].channel.close()  # the process dies holding a started request
            await trio.testing.wait_all_tasks_blocked()
            assert not host.busy()
            worker = host.fleet.worker("w-1")
            assert worker is not None
            assert len(worker.sequences) == 0
            second = await host.picture(1).pick(host.query(1))
            assert isinstance(second, RemoteTicket)
            nursery.cancel_scope.cancel()
        host.close()


async def test_thresholds_set_in_one_process_reach_every_process() -> None:
    with trio.fail_after(5):
        host = _Host(processes=2)
        async with trio.open_nursery() as nursery:
            await _serve(host, nursery)
            update = BusyThresholds(active_decode_blocks=0.5)
            current = await host.clients[0].set_thresholds("m", update)
            assert current is not None
            assert current.active_decode_blocks == 0.5
            await trio.testing.wait_all_tasks_blocked()
            assert dict(host.clients[1].all_thresholds())["m"].active_decode_blocks == 0.5
            assert await host.clients[1].set_thresholds("nope", update) is None
            nursery.cancel_scope.cancel()
        host.close()


async def test_a_broken_frame_ends_the_channel() -> None:
    with trio.fail_after(5):
        a, b = socket.socketpair()
        channel: Channel[msg.FromHost, msg.FromProcess] = Channel(a, msg.FromHost)  # type: ignore[arg-type]
        b.sendall(b"\x00\x00\x00\x02\xc1\xc1")
        with pytest.raises(ChannelClosed):
            await channel.receive()
        b.close()
        channel.close()
