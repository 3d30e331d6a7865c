"""Where the workers are (frontend_shim._discovery): worker URLs and their keys, and name
resolution."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest
import trio

from frontend_shim._discovery import WorkerUrl, parse_worker_url, resolve_addresses


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ws://127.0.0.1:9100", WorkerUrl("127.0.0.1", 9100, "")),
        ("ws://workers.internal:9100/", WorkerUrl("workers.internal", 9100, "")),
        ("ws://[::1]:9100/prefix/", WorkerUrl("::1", 9100, "/prefix")),
        (" ws://localhost:1 ", WorkerUrl("localhost", 1, "")),
    ],
)
def test_parse_worker_url_accepts(url: str, expected: WorkerUrl) -> None:
    assert parse_worker_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9100",
        "ws://127.0.0.1",
        "ws://:9100",
        "ws://127.0.0.1:99999",
        "ws://h:1?x=1",
        "127.0.0.1:9100",
        "",
    ],
)
def test_parse_worker_url_refuses_with_the_value_named(url: str) -> None:
    with pytest.raises(ValueError, match="invalid worker URL"):
        parse_worker_url(url)


def test_keys_bracket_ipv6_addresses() -> None:
    url = WorkerUrl("h", 9100, "/p")
    assert url.key_for("10.0.0.7") == "ws://10.0.0.7:9100/p"
    assert url.key_for("::1") == "ws://[::1]:9100/p"


async def test_ip_literals_are_returned_without_a_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_lookup(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an IP literal was looked up")

    monkeypatch.setattr(trio.socket, "getaddrinfo", no_lookup)
    assert await resolve_addresses("127.0.0.1", 1) == ["127.0.0.1"]
    assert await resolve_addresses("::1", 1) == ["::1"]
    assert await resolve_addresses("0:0:0:0:0:0:0:1", 1) == ["::1"]  # in its canonical form


async def test_a_lookup_keeps_ip_addresses_in_order_without_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[tuple[str, int]] = []

    async def fake_getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        looked_up.append((host, port))
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_UNIX, socket.SOCK_STREAM, 0, "", "/not/an/ip"),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(trio.socket, "getaddrinfo", fake_getaddrinfo)
    assert await resolve_addresses("workers.test", 9100) == ["127.0.0.2", "::1", "127.0.0.1"]
    assert looked_up == [("workers.test", 9100)]


async def test_localhost_resolves_to_loopback_addresses_only() -> None:
    with trio.fail_after(5):
        try:
            addresses = await resolve_addresses("localhost", 9100)
        except OSError as exc:
            pytest.skip(f"this host cannot resolve localhost: {exc}")
    if not addresses:
        pytest.skip("this host has no address for localhost")
    assert all(ipaddress.ip_address(address).is_loopback for address in addresses), addresses
