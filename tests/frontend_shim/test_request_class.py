"""A completion's priority and tenant (frontend_shim/_request_class.py): where each is read."""

from __future__ import annotations

from typing import Any

import pytest

from frontend_shim._request_body import BadRequest
from frontend_shim._request_class import ClassPolicy, header_priority, request_class


def _headers(**values: str) -> list[tuple[bytes, bytes]]:
    return [(f"x-dynamo-{key}".encode(), value.encode()) for key, value in values.items()]


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, {}, (0, "")),
        ({}, {"priority": 7, "user": "alice"}, (7, "alice")),
        ({"priority": "-3"}, {"priority": 7}, (-3, "")),
        ({"tenant": "team-a"}, {"user": "alice"}, (0, "team-a")),
        ({"priority": "1000", "tenant": ""}, {"user": "alice"}, (1000, "")),
        ({}, {"priority": None, "user": None}, (0, "")),
        ({}, {"priority": -1000}, (-1000, "")),
    ],
)
def test_header_first_then_body_then_default(
    headers: dict[str, str], body: dict[str, Any], expected: tuple[int, str]
) -> None:
    assert request_class(_headers(**headers), body) == expected


@pytest.mark.parametrize(
    ("headers", "body", "named"),
    [
        ({"priority": "high"}, {}, "x-dynamo-priority"),
        ({"priority": "1001"}, {}, "x-dynamo-priority"),
        ({"priority": "+5"}, {}, "x-dynamo-priority"),
        ({"priority": "1.5"}, {}, "x-dynamo-priority"),
        ({"priority": ""}, {}, "x-dynamo-priority"),
        ({}, {"priority": "5"}, "`priority`"),
        ({}, {"priority": 2.0}, "`priority`"),
        ({}, {"priority": True}, "`priority`"),
        ({}, {"priority": -1001}, "`priority`"),
        ({"tenant": "x" * 257}, {}, "x-dynamo-tenant"),
        ({}, {"user": "x" * 257}, "`user`"),
        ({}, {"user": 42}, "`user`"),
    ],
)
def test_bad_values_are_a_400_naming_the_header_or_field(
    headers: dict[str, str], body: dict[str, Any], named: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        request_class(_headers(**headers), body)
    assert caught.value.status == 400
    assert named in str(caught.value)


def test_the_priority_header_alone_is_readable_from_the_head() -> None:
    assert header_priority([]) is None
    assert header_priority(_headers(priority=" 12 ")) == 12


def test_a_priority_of_thousands_of_digits_is_a_400_not_a_crash() -> None:
    with pytest.raises(BadRequest) as info:
        request_class([(b"x-dynamo-priority", b"1" * 6000)], {})
    assert info.value.status == 400
    assert "x-dynamo-priority" in str(info.value)
    assert len(str(info.value)) < 300


def test_a_hostile_user_or_priority_is_quoted_by_a_short_prefix() -> None:
    for body in ({"user": list(range(100_000))}, {"priority": ["x"] * 100_000}):
        with pytest.raises(BadRequest) as info:
            request_class([], body)
        assert info.value.status == 400
        assert len(str(info.value)) < 300


# -- who may claim a class (rule 4) --------------------------------------------------------------

GATEWAY = ClassPolicy(max_client_priority=5, gateway_token=b"s3cret-gw")


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"priority": "-1000"}, {}, (0, "")),
        ({}, {"priority": -1000, "user": "alice"}, (0, "alice")),
        ({"priority": "3", "tenant": "t"}, {}, (3, "t")),
        ({}, {}, (0, "")),
    ],
)
def test_a_claim_more_urgent_than_the_maximum_is_raised_to_it(
    headers: dict[str, str], body: dict[str, Any], expected: tuple[int, str]
) -> None:
    policy = ClassPolicy(max_client_priority=0)
    assert request_class(_headers(**headers), body, policy) == expected


def test_with_a_gateway_only_its_requests_claim_freely() -> None:
    claim = _headers(priority="-1000", tenant="gold")
    # The gateway, by its token: its class as it says, beyond the clients' maximum.
    trusted = [*claim, (b"x-dynamo-gateway-token", b"s3cret-gw")]
    assert request_class(trusted, {}, GATEWAY) == (-1000, "gold")
    assert header_priority(trusted, GATEWAY) == -1000
    # Anyone else (no token, a wrong one): clamped, and the shared tenant whatever it says.
    for headers in (claim, [*claim, (b"x-dynamo-gateway-token", b"guess")]):
        assert request_class(headers, {"user": "alice"}, GATEWAY) == (5, "")
        assert header_priority(headers, GATEWAY) == 5
    assert request_class(_headers(priority="9"), {}, GATEWAY) == (9, "")


def test_with_a_gateway_and_no_maximum_a_client_may_only_ask_to_wait_longer() -> None:
    policy = ClassPolicy(gateway_token=b"s3cret-gw")
    assert request_class(_headers(priority="-1"), {}, policy) == (0, "")
    assert request_class(_headers(priority="7"), {}, policy) == (7, "")


def test_a_claim_is_checked_before_it_is_clamped_or_set_aside() -> None:
    policy = ClassPolicy(max_client_priority=0, gateway_token=b"s3cret-gw")
    with pytest.raises(BadRequest, match="x-dynamo-priority"):
        request_class(_headers(priority="-1001"), {}, policy)
    with pytest.raises(BadRequest, match="x-dynamo-tenant"):
        request_class(_headers(tenant="x" * 300), {}, policy)


def test_the_gateway_token_stays_out_of_the_policys_repr() -> None:
    assert "s3cret" not in repr(GATEWAY)
