"""The load generator's traces: Mooncake and Azure traces read, a window of them selected, scaled
in time and length, and turned into prompts whose block structure is the trace's (the words
``w0`` ... ``w499``, one block of words per ``hash_id``).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Tokens per block of the Mooncake trace's ``hash_ids``.
TRACE_BLOCK_TOKENS = 512
#: Prompts are made of the words ``w0`` ... ``w499``: one token each for the mocker's
#: whitespace tokenizer, and words a small word-level tokenizer can know.
VOCABULARY = 500


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as the trace gives it.

    Attributes:
        arrival: Seconds since the trace's start.
        input_tokens: Prompt tokens.
        output_tokens: Generated tokens.
        hash_ids: Names of the prompt's blocks of :data:`TRACE_BLOCK_TOKENS` tokens (Mooncake);
            empty when the trace has no prefix information (Azure).
    """

    arrival: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: Path, trace_format: str = "auto") -> list[TraceRequest]:
    """Read a trace file in the Mooncake (JSONL) or Azure (CSV) format.

    Args:
        path: The file.
        trace_format: ``mooncake``, ``azure``, or ``auto`` (by the file's first character:
            ``{`` is Mooncake).

    Returns:
        The requests in arrival order.

    Raises:
        ValueError: an unknown format, or a line that is not a request of it (the message names
            the line).
    """
    with path.open(encoding="utf-8", newline="") as source:
        if trace_format == "auto":
            head = source.read(1)
            source.seek(0)
            trace_format = "mooncake" if head == "{" else "azure"
        if trace_format == "mooncake":
            requests = [
                _mooncake_request(line, f"{path}:{number}")
                for number, line in enumerate(source, 1)
                if line.strip()
            ]
        elif trace_format == "azure":
            requests = _azure_requests(source, str(path))
        else:
            raise ValueError(f"unknown trace format {trace_format!r} (mooncake, azure or auto)")
    requests.sort(key=lambda request: request.arrival)  # stable: equal times keep file order
    return requests


def _count(value: object, name: str, where: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
    return value


def _mooncake_request(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    timestamp = row.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    input_tokens = _count(row.get("input_length"), "input_length", where, least=1)
    output_tokens = _count(row.get("output_length"), "output_length", where, least=0)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    ids = tuple(_count(h, "a hash id", where, least=0) for h in hash_ids)
    if len(ids) != math.ceil(input_tokens / TRACE_BLOCK_TOKENS):
        raise ValueError(
            f"{where}: {len(ids)} hash_ids for {input_tokens} tokens"
            f" (blocks of {TRACE_BLOCK_TOKENS} need {math.ceil(input_tokens / TRACE_BLOCK_TOKENS)})"
        )
    return TraceRequest(timestamp / 1000.0, input_tokens, output_tokens, ids)


def _azure_requests(source: Any, where: str) -> list[TraceRequest]:
    rows = csv.reader(source)
    header = next(rows, None)
    if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ValueError(f"{where}:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens")
    requests = []
    first: float | None = None
    for number, row in enumerate(rows, 2):
        if not row:
            continue
        at = f"{where}:{number}"
        if len(row) != 3:
            raise ValueError(f"{at}: expected 3 fields, got {len(row)}")
        moment = _azure_time(row[0], at)
        first = moment if first is None else first
        try:
            lengths = int(row[1]), int(row[2])
        except ValueError:
            raise ValueError(f"{at}: token counts must be integers, got {row[1:]!r}") from None
        input_tokens = _count(lengths[0], "ContextTokens", at, least=1)
        output_tokens = _count(lengths[1], "GeneratedTokens", at, least=0)
        requests.append(TraceRequest(moment - first, input_tokens, output_tokens))
    return requests


def _azure_time(text: str, where: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (100 ns digits kept)."""
    whole, _, fraction = text.strip().partition(".")
    try:
        moment = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        digits = int(fraction) / 10 ** len(fraction) if fraction else 0.0
    except ValueError:
        raise ValueError(f"{where}: not a timestamp: {text!r}") from None
    return moment.replace(tzinfo=datetime.UTC).timestamp() + digits


def select_window(
    requests: Sequence[TraceRequest],
    *,
    start: float = 0.0,
    duration: float | None = None,
    count: int | None = None,
) -> list[TraceRequest]:
    """The requests of a window of the trace, their arrivals counted from its first one.

    Args:
        requests: The trace, in arrival order.
        start: Trace seconds before the window.
        duration: Trace seconds of the window (None: to the end).
        count: At most this many requests, the first ones of the window (None: all).

    Returns:
        The window's requests, the first arriving at 0.
    """
    end = math.inf if duration is None else start + duration
    chosen = [request for request in requests if start <= request.arrival < end]
    if count is not None:
        chosen = chosen[:count]
    if not chosen:
        return []
    origin = chosen[0].arrival
    return [dataclasses.replace(r, arrival=r.arrival - origin) for r in chosen]


@dataclasses.dataclass(frozen=True)
class ReplayItem:
    """One request as it is replayed: scaled in time and length.

    Attributes:
        index: Position in the window.
        arrival: Replay seconds from the start at which it is sent (open loop).
        prompt_tokens: Words of its prompt.
        max_tokens: Tokens it asks for.
        hash_ids: The trace's block names, each of ``block_tokens`` words (the last block
            possibly shorter); empty for a prompt shared with no other.
        block_tokens: Words per block.
    """

    index: int
    arrival: float
    prompt_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...]
    block_tokens: int


def scale_requests(
    requests: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float | None = None,
) -> list[ReplayItem]:
    """Scale a window for replay, keeping its block structure.

    A Mooncake block of :data:`TRACE_BLOCK_TOKENS` tokens becomes ``round(512 x length_scale)``
    words, so two prompts that share k blocks still share exactly their first k blocks; the last,
    partial block shrinks in proportion (one word at least). A prompt without blocks (Azure) is
    ``round(tokens x length_scale)`` words, at least one.

    Args:
        requests: The window.
        time_scale: Replay seconds per trace second (0.25: four times the trace's rate).
        length_scale: Prompt tokens replayed per trace token.
        output_scale: Generated tokens asked per trace token (None: ``length_scale``); at least
            one is asked for.

    Returns:
        The items to replay.

    Raises:
        ValueError: a scale that is not positive, or a block that would have no token.
    """
    if not time_scale > 0 or not length_scale > 0:
        raise ValueError("time_scale and length_scale must be positive")
    out_scale = length_scale if output_scale is None else output_scale
    if not out_scale > 0:
        raise ValueError("output_scale must be positive")
    block_tokens = round(TRACE_BLOCK_TOKENS * length_scale)
    if block_tokens < 1:
        raise ValueError(f"length_scale {length_scale} leaves no token in a block of 512")
    items = []
    for index, request in enumerate(requests):
        if request.hash_ids:
            whole = len(request.hash_ids) - 1
            rest = request.input_tokens - whole * TRACE_BLOCK_TOKENS
            tail = min(block_tokens, max(1, round(rest * block_tokens / TRACE_BLOCK_TOKENS)))
            prompt = whole * block_tokens + tail
        else:
            prompt = max(1, round(request.input_tokens * length_scale))
        items.append(
            ReplayItem(
                index=index,
                arrival=request.arrival * time_scale,
                prompt_tokens=prompt,
                max_tokens=max(1, round(request.output_tokens * out_scale)),
                hash_ids=request.hash_ids,
                block_tokens=block_tokens,
            )
        )
    return items


@functools.lru_cache(maxsize=65536)
def block_words(name: str, count: int) -> tuple[str, ...]:
    """The words of one block: a pure function of its name, so equal names give equal text.

    Args:
        name: The block's name (``h<hash id>``, or ``r<request>.<block>`` for one never shared).
        count: Words in the block.
    """
    digest = hashlib.shake_256(name.encode()).digest(2 * count)
    return tuple(
        f"w{int.from_bytes(digest[i : i + 2], 'big') % VOCABULARY}" for i in range(0, 2 * count, 2)
    )


def prompt_text(item: ReplayItem) -> str:
    """The prompt of ``item``: block after block, the words of each named by its hash id."""
    words: list[str] = []
    left = item.prompt_tokens
    block = 0
    while left > 0:
        size = min(item.block_tokens, left)
        if block < len(item.hash_ids):
            name = f"h{item.hash_ids[block]}"
        else:  # no prefix information: words of this request alone
            name = f"r{item.index}.{block}"
        words.extend(block_words(name, item.block_tokens)[:size])
        left -= size
        block += 1
    return " ".join(words)


def unbounded_hit_rate(items: Sequence[ReplayItem]) -> float:
    """The share of prompt tokens an unbounded single prefix cache would find, in order.

    A prompt's full blocks are looked up from the first; the longest run already seen counts as
    cached (a partial last block never does: engines do not share it), as the mocker's cache and
    vLLM's count it.
    """
    seen: set[int] = set()
    cached = total = 0
    for item in items:
        total += item.prompt_tokens
        full = item.prompt_tokens // item.block_tokens
        hits = 0
        while hits < full and hits < len(item.hash_ids) and item.hash_ids[hits] in seen:
            hits += 1
        cached += hits * item.block_tokens
        seen.update(item.hash_ids[:full])
    return cached / total if total else 0.0


def distinct_blocks(items: Sequence[ReplayItem]) -> int:
    """Distinct full blocks of the items' prompts (what caches would have to hold)."""
    names: set[int] = set()
    for item in items:
        names.update(item.hash_ids[: item.prompt_tokens // item.block_tokens])
    return len(names)


@dataclasses.dataclass(frozen=True)
class PromptShape:
    """How an item becomes a request body.

    Attributes:
        endpoint: ``chat`` or ``completions``.
        model: The model name.
        extra: Fields merged into every body.
    """

    endpoint: str
    model: str
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def body(self, item: ReplayItem) -> bytes:
        """The streamed request of ``item``, asking for usage in the last chunk."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": item.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt_text(item)}]
        else:
            body["prompt"] = prompt_text(item)
        body.update(self.extra)
        return json.dumps(body).encode()


@dataclasses.dataclass
class ReplayRecord:
    """What one replayed request measured (times in seconds since the replay's start).

    Attributes:
        index: The item's position in the window.
        status: HTTP status; 0 for no answer, 500 for a stream that ended in an error event.
        due: When it was to be sent.
        sent: When it was sent.
        ttft: Seconds from sending to the answer's first chunk of a choice (None: none came).
        itl: Mean seconds between tokens after the first (None: fewer than two).
        latency: Seconds from sending to the end of the answer.
        prompt_tokens: From the answer's usage (None: no usage).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (None: not reported).
        output_tokens: Tokens generated (usage's count, else the chunks with text).
    """

    index: int
    status: int
    due: float
    sent: float
    ttft: float | None = None
    itl: float | None = None
    latency: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
