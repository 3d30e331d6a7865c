"""``bench/kit``, the library every benchmark uses: its pure parts, its client on loopback, and
its child processes."""

from __future__ import annotations

import math
import random
import sys
from functools import partial

import h11
import pytest
import trio

from bench.kit.children import Child
from bench.kit.http import Client, fetch
from bench.kit.metrics import by_label, metric_sum, sums
from bench.kit.processes import ready_fields, serve
from bench.kit.stats import median, percentile, poisson_arrivals
from bench.kit.table import Table, cell


def test_poisson_arrivals_are_increasing_inside_the_window_and_replayable() -> None:
    arrivals = poisson_arrivals(50.0, 4.0, random.Random("x"))
    assert arrivals == sorted(arrivals)
    assert all(0 <= offset < 4.0 for offset in arrivals)
    assert arrivals == poisson_arrivals(50.0, 4.0, random.Random("x"))
    # 200 expected; a seeded draw far from it would mean a wrong rate.
    assert 120 < len(arrivals) < 280
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 1.0, random.Random())


def test_percentile_interpolates() -> None:
    assert math.isnan(percentile([], 0.5))
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 1.0) == 5.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_median_skips_what_was_not_measured() -> None:
    assert median([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert math.isnan(median([math.nan]))


PAGE = """# HELP dynamo_frontend_requests_total Requests.
# TYPE dynamo_frontend_requests_total counter
dynamo_frontend_requests_total{model="m",status="200"} 7.0
dynamo_frontend_requests_total{model="m",status="529"} 3.0
dynamo_frontend_requests_total{model="n",status="200"} 1.0
dynamo_engine_request 2.0
dynamo_rejection_request_by_reason_total{reason="displaced"} 4.0
broken line
"""


def test_a_metrics_page_reads_as_sums_and_by_label() -> None:
    assert metric_sum(PAGE, "dynamo_frontend_requests_total") == 11.0
    assert metric_sum(PAGE, "dynamo_frontend_requests_total", status="200") == 8.0
    assert metric_sum(PAGE, "dynamo_frontend_requests_total", model="m", status="200") == 7.0
    assert metric_sum(PAGE, "dynamo_rejection_request_by_reason_total", reason="slo") == 0.0
    assert metric_sum(PAGE, "dynamo_engine_request") == 2.0
    assert sums(PAGE)["dynamo_frontend_requests_total"] == 11.0
    assert by_label(PAGE, "dynamo_frontend_requests_total", "status") == {"200": 8.0, "529": 3.0}


def test_a_ready_line_gives_its_fields() -> None:
    line = "worker-ingress ready ws=ws://127.0.0.1:1 system=http://127.0.0.1:2"
    assert ready_fields(line) == {"ws": "ws://127.0.0.1:1", "system": "http://127.0.0.1:2"}
    assert ready_fields("fleet-sim ready workers=2 ports=5,6") == {"workers": "2", "ports": "5,6"}
    assert ready_fields("INFO starting, not ready yet") is None
    assert ready_fields("frontend-shim is already running") is None


def test_the_figure_table_is_markdown() -> None:
    table = Table("system", "rate")
    table.add("ours", cell(1234.5, ",.0f"))
    table.add("theirs", cell(math.nan, ".1f"))
    assert str(table) == "| system | rate |\n|---|---|\n| ours | 1,234 |\n| theirs | n/a |"
    assert cell(None, ".1f", missing="-") == "-"
    assert cell(0.25, ".0%") == "25%"
    assert cell(0.5, ".1f", scale=1e3) == "500.0"


async def _answer(stream: trio.SocketStream, *, close_after: int) -> None:
    """Answer ``/echo`` with the request's body, ``/stream`` in three pieces; close the
    connection after ``close_after`` answers."""
    conn = h11.Connection(h11.SERVER)
    answered = 0
    body = b""
    async with stream:
        while answered < close_after:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                target, body = event.target, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                pieces = [b"a", b"b", b"c"] if target == b"/stream" else [body]
                size = str(sum(map(len, pieces)))
                headers = [("content-length", size)]
                if answered + 1 == close_after:
                    headers.append(("connection", "close"))
                out = conn.send(h11.Response(status_code=200, headers=headers)) or b""
                for piece in pieces:
                    out += conn.send(h11.Data(data=piece)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                answered += 1
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()


async def test_the_client_keeps_its_connection_and_reopens_a_closed_one() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(
                partial(trio.serve_tcp, host="127.0.0.1"), partial(_answer, close_after=2), 0
            )
            url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            client = Client(url)
            first = await client.request("POST", "/echo", json={"n": 1})
            assert (first.status, bytes(first.body), first.complete) == (200, b'{"n": 1}', True)
            assert client.connected
            second = await client.request("POST", "/echo", b"two")
            assert bytes(second.body) == b"two"
            assert not client.connected  # the server said close: the next request reopens
            pieces: list[bytes] = []
            third = await client.request("GET", "/stream", on_data=pieces.append)
            assert (third.json(), b"".join(pieces)) == (None, b"abc")
            assert bytes((await fetch(url, "GET", "/stream")).body) == b"abc"
            await client.aclose()
            nursery.cancel_scope.cancel()


HELPER = (
    "import sys\n"
    "print('helper ready http=http://127.0.0.1:9', flush=True)\n"
    "for line in sys.stdin: print('got', line.strip(), flush=True)\n"
)


async def test_a_child_is_read_to_its_ready_line_commanded_and_reaped() -> None:
    with trio.fail_after(20):
        async with Child([sys.executable, "-c", HELPER], name="helper") as child:
            assert child.addresses == {"http": "http://127.0.0.1:9"}
        assert child.process is not None
        assert child.process.returncode is not None
        controlled = Child([sys.executable, "-c", HELPER], control=True)
        await controlled.start()
        try:
            await controlled.ready()
            await controlled.send("stats")
            assert await controlled.readline() == "got stats"
        finally:
            await controlled.stop()


async def test_a_child_that_exits_before_its_ready_line_says_so() -> None:
    with trio.fail_after(20), pytest.raises(RuntimeError, match="before it was ready"):
        async with Child([sys.executable, "-c", "print('no')"], name="quitter"):
            pass


def test_a_served_script_yields_its_ready_fields_and_is_stopped() -> None:
    with serve([sys.executable, "-c", HELPER]) as server:
        assert server.addresses == {"http": "http://127.0.0.1:9"}
    with (
        pytest.raises(RuntimeError, match="exited before its ready line"),
        serve([sys.executable, "-c", "pass"]),
    ):
        pass
