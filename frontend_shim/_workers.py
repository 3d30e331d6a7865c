"""The frontend's connections to its workers, gathered from the modules that own them.

- :mod:`frontend_shim._discovery`: ``--worker`` URLs, worker keys, name lookups.
- :mod:`frontend_shim._pool`: :class:`WorkerPool`, one link per resolved address.
- :mod:`frontend_shim._links`: :class:`WorkerLink`, the session state machine of one worker.
- :mod:`frontend_shim._connection`: one websocket connection on the lean codec.
- :mod:`frontend_shim._request_plane`: request ids, reply buffers, :class:`RequestStream`.
"""

from frontend_shim._discovery import Resolver as Resolver
from frontend_shim._discovery import WorkerKey as WorkerKey
from frontend_shim._discovery import WorkerUrl as WorkerUrl
from frontend_shim._discovery import parse_worker_url as parse_worker_url
from frontend_shim._discovery import resolve_addresses as resolve_addresses
from frontend_shim._links import FleetListener as FleetListener
from frontend_shim._links import LinkSettings as LinkSettings
from frontend_shim._links import WorkerLink as WorkerLink
from frontend_shim._pool import WorkerPool as WorkerPool
from frontend_shim._request_plane import FirstReply as FirstReply
from frontend_shim._request_plane import LinkStats as LinkStats
from frontend_shim._request_plane import ProtocolError as ProtocolError
from frontend_shim._request_plane import RequestStream as RequestStream
from frontend_shim._request_plane import StreamReply as StreamReply
