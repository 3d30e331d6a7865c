"""The cycle's states and rules (:mod:`shim_common._http_cycle`), without sockets: each rule at
the top of the module, driven by the calls the connection makes."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import pytest

from shim_common._http_cycle import (
    CLOSE,
    CLOSED,
    DISCARD_BODY,
    DONE,
    IDLE,
    NEXT_CYCLE,
    SEND_BODY,
    SEND_RESPONSE,
    Cycle,
)


def received(
    *,
    keep_alive: bool = True,
    expects_continue: bool = False,
    discardable: bool = False,
    ended: bool = True,
) -> Cycle:
    cycle = Cycle()
    cycle.request_received(keep_alive, expects_continue, discardable, ended)
    return cycle


def test_a_head_starts_the_cycle_and_a_complete_answer_ends_it() -> None:
    cycle = Cycle()
    assert (cycle.ours, cycle.theirs) == (IDLE, IDLE)
    cycle.request_received(keep_alive=True, expects_continue=False, discardable=False, ended=True)
    assert (cycle.ours, cycle.theirs) == (SEND_RESPONSE, DONE)
    assert not cycle.response_started
    assert (
        cycle.start_response(says_close=False, streamed=False, ends_with_connection=False) is False
    )
    assert (cycle.ours, cycle.response_started, cycle.response_finished) == (DONE, True, True)
    assert cycle.after_response() == NEXT_CYCLE
    cycle.start_next_cycle()
    assert (cycle.ours, cycle.theirs) == (IDLE, IDLE)


def test_a_streamed_answer_is_started_then_ended() -> None:
    cycle = received()
    cycle.start_response(says_close=False, streamed=True, ends_with_connection=False)
    assert (cycle.ours, cycle.response_started, cycle.response_finished) == (
        SEND_BODY,
        True,
        False,
    )
    cycle.check_streaming("send_chunk()")
    cycle.end_response()
    assert cycle.ours == DONE
    assert cycle.after_response() == NEXT_CYCLE


@pytest.mark.parametrize("streamed", [False, True])
def test_a_second_answer_or_a_chunk_outside_a_stream_is_refused_and_changes_nothing(
    streamed: bool,
) -> None:
    cycle = received()
    with pytest.raises(RuntimeError, match="outside a started stream"):
        cycle.check_streaming("send_chunk()")
    with pytest.raises(RuntimeError, match="outside a started stream"):
        cycle.end_response()
    cycle.start_response(says_close=False, streamed=streamed, ends_with_connection=False)
    state = cycle.ours
    with pytest.raises(RuntimeError, match="already started"):
        cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert cycle.ours is state
    if not streamed:
        with pytest.raises(RuntimeError, match="outside a started stream"):
            cycle.end_response()


def test_100_continue_is_due_once_and_never_after_an_answer() -> None:
    cycle = received(expects_continue=True, ended=False)
    assert cycle.continue_due() is True
    assert cycle.continue_due() is False
    early = received(expects_continue=True, ended=False)
    early.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert early.continue_due() is False


def test_connection_close_from_either_side_or_the_body_framing_ends_the_connection() -> None:
    # The handler said it: no second close line is written, and the connection ends.
    cycle = received()
    assert (
        cycle.start_response(says_close=True, streamed=False, ends_with_connection=False) is False
    )
    assert cycle.after_response() == CLOSE
    # The client said it.
    cycle = received(keep_alive=False)
    assert cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert cycle.after_response() == CLOSE
    # A body delimited by the connection's end (a stream to an HTTP/1.0 client).
    cycle = received()
    assert cycle.start_response(says_close=False, streamed=True, ends_with_connection=True)
    cycle.end_response()
    assert cycle.after_response() == CLOSE
    with pytest.raises(RuntimeError):
        cycle.start_next_cycle()


def test_an_early_answer_drops_a_discardable_body_and_closes_before_another() -> None:
    cycle = received(discardable=True, ended=False)
    assert not cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert cycle.keep_alive
    assert cycle.after_response() == DISCARD_BODY
    cycle.request_ended()
    assert cycle.after_response() == NEXT_CYCLE

    cycle = received(discardable=False, ended=False)
    assert cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert not cycle.keep_alive
    assert cycle.after_response() == CLOSE


def test_an_answer_after_the_body_was_read_keeps_the_connection() -> None:
    cycle = received(discardable=False, ended=False)
    assert cycle.theirs == SEND_BODY
    cycle.request_ended()
    assert not cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    assert cycle.after_response() == NEXT_CYCLE


@pytest.mark.parametrize("started", [False, True])
def test_an_error_answer_of_the_server_closes(started: bool) -> None:
    cycle = Cycle() if not started else received(expects_continue=True, ended=False)
    cycle.refuse()
    assert (cycle.ours, cycle.keep_alive, cycle.waiting_for_continue) == (DONE, False, False)
    assert cycle.after_response() == CLOSE


def test_gone_and_closed_are_final_whatever_comes_after() -> None:
    calls: list[Callable[[Cycle], object]] = [
        lambda c: c.request_received(True, False, False, True),
        lambda c: c.request_received(True, False, True, False),
        lambda c: c.request_ended(),
        lambda c: c.start_response(False, False, False),
    ]
    # Every order of the later calls: the client stays gone, and no next cycle starts.
    for order in itertools.permutations(calls):
        cycle = Cycle()
        cycle.client_gone()
        for call in order:
            with contextlib.suppress(RuntimeError):
                call(cycle)
            assert cycle.client_is_gone
            assert cycle.after_response() == CLOSE
    cycle = received()
    cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    cycle.close()
    assert cycle.ours == CLOSED
    assert cycle.response_finished
    with pytest.raises(RuntimeError):
        cycle.start_response(says_close=False, streamed=False, ends_with_connection=False)
    with pytest.raises(RuntimeError):
        cycle.start_next_cycle()
    assert cycle.ours == CLOSED
