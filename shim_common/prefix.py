"""One tokenisation and one block naming of prompts, shared by the frontend and the worker.

A prefix cache reuses the KV blocks of a prompt's longest prefix seen before; a cache-aware router
sends the prompt where that prefix lives. Both must cut a prompt into the same blocks and give
each the same name, or the router's picture of a cache is a guess. Both therefore use this module:

1. A prompt becomes token ids through a :class:`PromptTokenizer`: the :class:`WordTokenizer` (the
   mocker's own: one token per whitespace-separated word) or a model's ``tokenizer.json``
   (:class:`FileTokenizer`). :func:`prompt_token_ids` reads the OpenAI body: a chat's message
   texts in order, a completion's ``prompt`` as text, or as token ids used as they are.
2. :func:`block_names` cuts the ids into blocks of ``block_size`` tokens and names each FULL
   block by a hash of the name of the block before it and of its own tokens, so two prompts'
   ``i``-th names are equal exactly when their first ``i + 1`` blocks are (barring a 63-bit hash
   collision). A partial last block has no name: it is never shared.
3. Every name and every id is stable across processes, machines and Python versions (CRC-32 and
   BLAKE2b over little-endian bytes; never Python's ``hash()``, which is salted per process).
4. Token ids are integers in ``[0, 2**32)``; names are integers in ``[0, 2**63)``, so that they
   fit a signed 64-bit integer of any msgpack peer.
"""

from __future__ import annotations

import hashlib
import re
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

__all__ = [
    "MAX_BLOCK_NAME",
    "MAX_TOKEN_ID",
    "FileTokenizer",
    "PromptTokenizer",
    "WordTokenizer",
    "block_names",
    "chat_texts",
    "prompt_token_ids",
]

#: The largest token id a prompt may carry (ids are unsigned 32-bit integers).
MAX_TOKEN_ID: Final = 2**32 - 1
#: The largest block name (names are unsigned 63-bit integers).
MAX_BLOCK_NAME: Final = 2**63 - 1

# The array type code whose items are 4 bytes wide ("I" on every common platform).
_UINT32: Final = next(code for code in ("I", "L") if array(code).itemsize == 4)
#: ASCII characters ``str.split`` takes for whitespace and ``bytes.split`` does not.
_ASCII_ONLY_STR_SPACES: Final = "\x1c\x1d\x1e\x1f"
#: A whitespace character as ``str.split`` reads one (``str.isspace``).
_SPACE: Final = re.compile(r"\s")
#: Characters of text the word tokeniser encodes in one piece (see ``WordTokenizer.encode``).
TOKENIZE_PIECE_CHARS: Final = 64 * 1024
_ROOT: Final = b"\x00"
_CHILD: Final = b"\x01"


class PromptTokenizer(Protocol):
    """Turns a text into token ids."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, each in ``[0, MAX_TOKEN_ID]``."""
        ...


class WordTokenizer:
    """The mocker's tokeniser: one token per whitespace-separated word, its id the word's CRC-32.

    The count is the one the mocker has always used (``len(text.split())``); the id depends only
    on the word's UTF-8 bytes, so every process gives a word the same id.
    """

    __slots__ = ()

    def encode(self, text: str) -> list[int]:
        """One id per whitespace-separated word of ``text`` (as ``str.split`` cuts it).

        A long text is encoded in pieces of about :data:`TOKENIZE_PIECE_CHARS`, each cut at a
        whitespace character (so no word is cut): every call into C then handles one piece, and
        a worker thread encoding megabytes gives the event loop its turn between pieces.
        """
        if len(text) <= TOKENIZE_PIECE_CHARS:
            return self._encode(text)
        ids: list[int] = []
        piece = TOKENIZE_PIECE_CHARS
        start, size = 0, len(text)
        while start < size:
            # The piece ends at the first whitespace from ``start + piece`` on, looked for a
            # window at a time (a search over a whole long word would be one long call).
            end = start + piece
            while end < size:
                space = _SPACE.search(text, end, end + piece)
                if space is not None:
                    end = space.start()
                    break
                end += piece
            end = min(end, size)
            ids.extend(self._encode(text[start:end]))
            start = end
        return ids

    @staticmethod
    def _encode(text: str) -> list[int]:
        crc32 = zlib.crc32
        if text.isascii() and not any(separator in text for separator in _ASCII_ONLY_STR_SPACES):
            # The same words, three times faster: on ASCII text bytes.split() cuts where
            # str.split() does, except at the four separators only str.split() takes for spaces.
            return list(map(crc32, text.encode("ascii").split()))
        return [crc32(word.encode("utf-8")) for word in text.split()]


class FileTokenizer:
    """A model's tokeniser, read from its ``tokenizer.json`` by the ``tokenizers`` library.

    Texts are encoded without special tokens, so a chat's messages encode to the concatenation
    of their texts' ids, on either side alike.

    Args:
        path: the ``tokenizer.json`` file.

    Raises:
        ImportError: the ``tokenizers`` library is not installed (the ``tokenizers`` extra).
        ValueError: the file cannot be read or is not a tokenizer.
    """

    __slots__ = ("_tokenizer", "path")

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError(
                "reading a tokenizer.json needs the 'tokenizers' library: "
                "pip install 'dynamo-shim[tokenizers]'"
            ) from error
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as error:  # the library raises bare Exception for a bad file
            raise ValueError(f"cannot read the tokenizer {path!r}: {error}") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        """The model's token ids of ``text``, without special tokens."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids


def _texts_of_content(content: object, where: str) -> list[str]:
    # OpenAI content: a string, null (an assistant turn with tool calls only) or a list of parts,
    # of which only the text parts carry words (a part without "type" is taken as text).
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts: list[str] = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}.content[{part_index}] must be an object")
            if part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}.content[{part_index}].text must be a string")
                texts.append(text)
        return texts
    raise ValueError(f"{where}.content must be a string, a list of parts or null")


def chat_texts(messages: object) -> list[str]:
    """The texts of a chat's ``messages``, in order (non-text content parts are skipped).

    Args:
        messages: The ``messages`` value of a chat body.

    Returns:
        Every text of every message.

    Raises:
        ValueError: ``messages`` is not a non-empty list of objects, a message has neither
            ``content`` nor ``tool_calls``, or a content is ill-typed.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of message objects")
    texts: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{index}] has no 'content'")
        texts.extend(_texts_of_content(message.get("content"), f"messages[{index}]"))
    return texts


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _encode_all(texts: Sequence[str], tokenizer: PromptTokenizer) -> list[int]:
    tokens: list[int] = []
    for text in texts:
        tokens.extend(tokenizer.encode(text))
    return tokens


def prompt_token_ids(
    endpoint: str, body: Mapping[str, object], tokenizer: PromptTokenizer
) -> list[int]:
    """The prompt of an OpenAI body as token ids.

    Chat (``chat_completions``): the texts of the messages in order (:func:`chat_texts`), each
    encoded and the ids concatenated, as the mocker counts them. Completions: ``prompt`` as a
    string, a non-empty list of strings (encoded in order and concatenated), or a non-empty list
    of token ids used as they are. Embeddings read ``input`` the same way.

    Args:
        endpoint: ``chat_completions``, ``completions`` or ``embeddings``.
        body: The OpenAI request body.
        tokenizer: Encodes the texts.

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: an unknown endpoint, a missing or ill-typed prompt, or a token id that is
            not an integer in ``[0, MAX_TOKEN_ID]``.
    """
    if endpoint == "chat_completions":
        return _encode_all(chat_texts(body.get("messages")), tokenizer)
    if endpoint == "completions":
        field = "prompt"
    elif endpoint == "embeddings":
        field = "input"
    else:
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    value: Any = body.get(field)
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return _encode_all(value, tokenizer)
        if all(_is_token_id(item) for item in value):
            return list(value)
    if value is None:
        raise ValueError(f"'{field}' is required: a string, a list of strings or of token ids")
    raise ValueError(
        f"'{field}' must be a string, a non-empty list of strings, or a non-empty list of "
        f"token ids (integers from 0 to {MAX_TOKEN_ID})"
    )


def block_names(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Name every full block of ``tokens``.

    Block ``i`` is named by BLAKE2b-64 of (the name of block ``i - 1``, or ``parent`` for the
    first, or a root marker when ``parent`` is ``None``; then the block's ids as little-endian
    unsigned 32-bit integers), keeping the low 63 bits. Equal names mean equal prefixes; a
    partial last block gets no name.

    Args:
        tokens: Token ids, each in ``[0, MAX_TOKEN_ID]``.
        block_size: Tokens per block, at least 1.
        parent: The name of the block before ``tokens[0]``, to continue a chain; ``None`` when
            ``tokens`` starts the prompt.

    Returns:
        ``len(tokens) // block_size`` names, in order.

    Raises:
        ValueError: ``block_size`` below 1, ``parent`` outside ``[0, MAX_BLOCK_NAME]``, or a token
            id out of range or not an integer.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if parent is not None and (
        isinstance(parent, bool) or not isinstance(parent, int) or not 0 <= parent <= MAX_BLOCK_NAME
    ):
        raise ValueError(f"parent must be a block name in [0, {MAX_BLOCK_NAME}], got {parent!r}")
    full = len(tokens) // block_size * block_size
    if full == 0:
        return []
    try:
        # In pieces: one call into C per piece, so a thread naming millions of tokens gives the
        # event loop its turn between them.
        packed = array(_UINT32)
        for start in range(0, full, TOKENIZE_PIECE_CHARS):
            packed.extend(tokens[start : min(start + TOKENIZE_PIECE_CHARS, full)])
    except (OverflowError, TypeError):
        raise ValueError(f"token ids must be integers from 0 to {MAX_TOKEN_ID}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    data = memoryview(packed.tobytes())
    step = block_size * 4
    names: list[int] = []
    previous = _ROOT if parent is None else _CHILD + parent.to_bytes(8, "little")
    blake2b = hashlib.blake2b
    for start in range(0, full * 4, step):
        digest = blake2b(previous, digest_size=8)
        digest.update(data[start : start + step])
        name = int.from_bytes(digest.digest(), "little") & MAX_BLOCK_NAME
        names.append(name)
        previous = _CHILD + name.to_bytes(8, "little")
    return names
