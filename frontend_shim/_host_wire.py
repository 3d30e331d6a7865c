"""The messages between a frontend's host process and its HTTP processes (``--processes N``).

With ``--processes N`` (N > 1) one host process keeps the picture of the fleet (it follows the
workers' events, once) and N HTTP processes serve the port and ask it for their picks. They
speak over one Unix stream socket per HTTP process, in frames: a 4-byte big-endian length, then
a msgpack array of messages (whatever queued while the last frame was being written). Every
message is a tagged msgspec struct; both ends are this package, of one version (the host
starts its HTTP processes from its own installation), so nothing here is negotiated.

Rules:

1. The host speaks first: :class:`Setup` (the settings, the worker URLs, the process's index).
   The HTTP process answers :class:`Ready` once its listener serves.
2. A pick: :class:`PickAsk` with an id of the asker's; the host answers :class:`Picked` (a ticket
   number of its own) or :class:`NotPicked` with the same id, in the order asked.
3. A ticket's life after the pick is one-way, in order: :class:`TicketStarted`,
   :class:`TicketOutput` (only those that move the charge), and exactly one closing message
   (:class:`TicketFinished`, :class:`TicketRefused`, :class:`TicketFailed`,
   :class:`TicketUnsent`). A start or an output that had not left its process when the
   request finished travels inside the :class:`TicketFinished` (a short request's whole life
   after its pick is one message). A ticket the host does not know (its worker went away, or
   the host restarted the process's books) is ignored.
4. Admin and metrics are asks with ids, answered in any order: :class:`SetThresholds` ->
   :class:`ThresholdsSet`; :class:`MetricsAsk` -> :class:`MetricsText`; the host's
   :class:`Collect` -> :class:`Samples`.
5. :class:`Overview` is the host's word on what every HTTP process answers without a pick: the
   models and whether each has an available worker, the workers connected, the thresholds in
   force. Sent at the start and whenever it changes.
6. A frame is at most :data:`MAX_FRAME_BYTES`; a peer that sends a larger one, or one that does
   not decode, is a bug of ours: the connection ends (the HTTP process is restarted).
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgspec

from frontend_shim._config import FrontendSettings
from shim_common import wire
from shim_common.wire import BusyThresholds

__all__ = [
    "MAX_FRAME_BYTES",
    "Collect",
    "FromHost",
    "FromProcess",
    "MetricsAsk",
    "MetricsText",
    "NotPicked",
    "Overview",
    "PickAsk",
    "Picked",
    "Ready",
    "SampleFamily",
    "Samples",
    "SetThresholds",
    "Setup",
    "ThresholdsSet",
    "TicketFailed",
    "TicketFinished",
    "TicketOutput",
    "TicketRefused",
    "TicketStarted",
    "TicketUnsent",
    "FrameReader",
    "encode_frame",
]

#: The largest frame either side sends (rule 6): a metrics snapshot of a busy process is the
#: largest message, far below this.
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
_LENGTH: Final = struct.Struct(">I")



class _Message(msgspec.Struct, tag_field="t", frozen=True, kw_only=True, array_like=True):
    """Every message: tagged by its kind, encoded as an array (no field names on the wire)."""


# ----------------------------------------------------------------------------- host -> process


class Setup(_Message, tag="setup", frozen=True):
    """What an HTTP process runs on (rule 1)."""

    index: int
    settings: FrontendSettings
    #: Every worker URL, those of ``--local-workers`` included.
    workers: list[str]


class Picked(_Message, tag="picked", frozen=True):
    ask: int
    ticket: int
    worker_id: str
    dp_rank: int | None = None
    #: The worker's KV block size (a process counts output blocks by it).
    block_size: int = 16
    #: The address of the worker's link (the id a fleet knows a worker by may be its announced
    #: id with ``@<address>`` added, when two addresses announce one id).
    key: str = ""


class NotPicked(_Message, tag="not-picked", frozen=True):
    """No worker: ``kind`` 0 overloaded (529), 1 unavailable (503), 2 unknown model (404)."""

    ask: int
    kind: int
    reason: str


class Overview(_Message, tag="overview", frozen=True):
    """Rule 5."""

    #: Every known model, with whether it has an available worker.
    models: list[tuple[str, bool]]
    connected: int
    thresholds: list[tuple[str, BusyThresholds]]
    #: The KV block sizes of the workers connected (a process names a prompt's blocks for each).
    block_sizes: list[int] = []


class ThresholdsSet(_Message, tag="thresholds-set", frozen=True):
    """The thresholds in force after a :class:`SetThresholds`; ``None``: the model is unknown."""

    ask: int
    thresholds: BusyThresholds | None


class MetricsText(_Message, tag="metrics-text", frozen=True):
    ask: int
    body: bytes
    content_type: str


class Collect(_Message, tag="collect", frozen=True):
    """Send your metrics' samples (rule 4)."""

    ask: int


FromHost = Setup | Picked | NotPicked | Overview | ThresholdsSet | MetricsText | Collect


# ----------------------------------------------------------------------------- process -> host


class Ready(_Message, tag="ready", frozen=True):
    pid: int


class PickAsk(_Message, tag="pick", frozen=True):
    """One pick (rule 2): the request's class and prompt, and the workers not to pick."""

    ask: int
    model: str
    priority: int = 0
    tenant: str = ""
    exempt: bool = False
    #: The prompt's length in tokens (0: unknown) and its block names by block size, as the
    #: HTTP process tokenised it (``kv`` mode only).
    prompt_tokens: int = 0
    names: dict[int, list[int]] | None = None
    exclude: list[str] = []
    #: A client's retry (:attr:`~frontend_shim._picture.PickQuery.retry`).
    retry: bool = False


class TicketStarted(_Message, tag="started", frozen=True):
    ticket: int
    prompt_tokens: int
    label: str


class TicketOutput(_Message, tag="output", frozen=True):
    ticket: int
    tokens: int


class TicketFinished(_Message, tag="finished", frozen=True):
    """The ticket's close; a start and an output not sent yet come with it (rule 3), applied
    first and in that order."""

    ticket: int
    final: wire.End | wire.Failed | None = None
    #: The worker's start, when it was not sent apart: its count of the prompt, and the label.
    started: tuple[int, str] | None = None
    #: Output tokens not sent apart (0: none).
    output: int = 0


class TicketRefused(_Message, tag="refused", frozen=True):
    ticket: int
    reason: str
    priority: int
    tenant: str
    queue_bound: int | None = None


class TicketFailed(_Message, tag="failed", frozen=True):
    ticket: int


class TicketUnsent(_Message, tag="unsent", frozen=True):
    ticket: int


class SetThresholds(_Message, tag="set-thresholds", frozen=True):
    ask: int
    model: str
    update: BusyThresholds


class MetricsAsk(_Message, tag="metrics", frozen=True):
    ask: int
    accept: str | None = None


class SampleFamily(msgspec.Struct, frozen=True, array_like=True):
    """One metric family of a process: name, type, help, and (sample name, labels, value)."""

    name: str
    type: str
    documentation: str
    samples: list[tuple[str, dict[str, str], float]]


class Samples(_Message, tag="samples", frozen=True):
    ask: int
    families: list[SampleFamily]


FromProcess = (
    Ready
    | PickAsk
    | TicketStarted
    | TicketOutput
    | TicketFinished
    | TicketRefused
    | TicketFailed
    | TicketUnsent
    | SetThresholds
    | MetricsAsk
    | Samples
)

_encoder = msgspec.msgpack.Encoder()


def encode_frame(messages: list[FromHost] | list[FromProcess]) -> bytes:
    """One frame of ``messages``."""
    payload = _encoder.encode(messages)
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Frames out of a byte stream, decoded as lists of ``T`` (rule 6 bounds them).

    Args:
        message_type: ``FromHost`` or ``FromProcess``.
    """

    __slots__ = ("_buffer", "_decoder")

    def __init__(self, message_type: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[list[FromHost | FromProcess]] = (
            msgspec.msgpack.Decoder(list[message_type])
        )
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[FromHost | FromProcess]:
        """Take bytes read; the messages of every frame now complete, in order.

        Raises:
            ValueError: a frame over the bound, or one that does not decode.
        """
        buffer = self._buffer
        buffer += data
        messages: list[FromHost | FromProcess] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            try:
                messages.extend(self._decoder.decode(memoryview(buffer)[start + 4 : end]))
            except msgspec.DecodeError as exc:
                raise ValueError(f"a frame that does not decode: {exc}") from exc
            start = end
        if start:
            del buffer[:start]
        return messages
