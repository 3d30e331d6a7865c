"""Where workers are: ``--worker`` URLs, their keys, and looking host names up."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TypeAlias

import trio

from shim_common._net import host_for_url

__all__ = ["Resolver", "WorkerKey", "WorkerUrl", "parse_worker_url", "resolve_addresses"]

#: A worker's stable identity in the frontend: its websocket URL with the host resolved to an IP
#: address, e.g. ``"ws://127.0.0.1:9100"``, ``"wss://[::1]:9100"``.
WorkerKey: TypeAlias = str

#: Receives a host name and a port, returns IP address strings (first preferred).
Resolver: TypeAlias = Callable[[str, int], Awaitable[list[str]]]


@dataclasses.dataclass(frozen=True)
class WorkerUrl:
    """A parsed ``--worker`` URL: ``ws://host:port`` or ``wss://host:port``, with an optional
    path prefix."""

    host: str
    port: int
    #: Path prefix before ``/v1/events`` and ``/v1/requests``; ``""`` or ``"/prefix"``.
    path: str = ""
    #: ``ws`` or ``wss`` (TLS).
    scheme: str = "ws"

    def key_for(self, address: str) -> WorkerKey:
        """The key (and base URL) of the worker at ``address`` (an IP address string)."""
        return f"{self.scheme}://{host_for_url(address)}:{self.port}{self.path}"


def parse_worker_url(url: str) -> WorkerUrl:
    """Parse and check a ``--worker`` value.

    Args:
        url: ``ws://host:port`` or ``wss://host:port`` (an IPv6 address in brackets); a path
            prefix is kept.

    Returns:
        The host, port and path prefix.

    Raises:
        ValueError: with a message naming the value, for any other scheme, a missing host or
            port, a query or a fragment.
    """
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid worker URL {url!r}: {exc}") from exc
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"invalid worker URL {url!r}: the scheme must be ws:// or wss://")
    if not parts.hostname:
        raise ValueError(f"invalid worker URL {url!r}: no host")
    if port is None:
        raise ValueError(f"invalid worker URL {url!r}: no port (ws://host:port)")
    if parts.query or parts.fragment:
        raise ValueError(f"invalid worker URL {url!r}: no query or fragment allowed")
    return WorkerUrl(
        host=parts.hostname, port=port, path=parts.path.rstrip("/"), scheme=parts.scheme
    )


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every IP address of ``host`` for a TCP connection, in resolver order, without repeats.

    An IP literal is returned as is, without a lookup.

    Raises:
        OSError: the lookup failed (``socket.gaierror`` is one).
    """
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for family, _type, _proto, _canonname, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


