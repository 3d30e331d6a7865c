"""The shared tokenisation and block naming: chained names equal exactly when prefixes are,
stable across processes, token-id prompts used as they are, bad shapes refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim_common import prefix
from shim_common.prefix import (
    MAX_BLOCK_NAME,
    MAX_TOKEN_ID,
    FileTokenizer,
    WordTokenizer,
    block_names,
    prompt_token_ids,
)

# Small alphabets so that random prompts share prefixes often.
token_lists = st.lists(st.integers(0, 3), max_size=40)
block_sizes = st.integers(1, 5)


@given(a=token_lists, b=token_lists, block_size=block_sizes)
def test_equal_names_exactly_when_the_prefixes_are_equal(
    a: list[int], b: list[int], block_size: int
) -> None:
    names_a = block_names(a, block_size)
    names_b = block_names(b, block_size)
    for i in range(min(len(names_a), len(names_b))):
        same_prefix = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (names_a[i] == names_b[i]) == same_prefix


@given(tokens=token_lists, block_size=block_sizes)
def test_one_name_per_full_block_each_63_bits(tokens: list[int], block_size: int) -> None:
    names = block_names(tokens, block_size)
    assert len(names) == len(tokens) // block_size
    assert all(0 <= name <= MAX_BLOCK_NAME for name in names)
    # A partial last block changes nothing.
    assert block_names([*tokens, *([0] * (block_size - 1))], block_size)[: len(names)] == names


@given(tokens=token_lists, cut=st.integers(0, 10), block_size=block_sizes)
def test_a_chain_continues_from_its_parent(tokens: list[int], cut: int, block_size: int) -> None:
    names = block_names(tokens, block_size)
    cut = min(cut, len(names))
    parent = names[cut - 1] if cut else None
    assert block_names(tokens[cut * block_size :], block_size, parent) == names[cut:]


def test_the_same_block_under_different_parents_has_different_names() -> None:
    tokens = [7, 7, 7, 7]
    roots = block_names(tokens, 4)
    assert block_names(tokens, 4, parent=1) != roots
    assert block_names(tokens, 4, parent=0) != roots
    assert block_names(tokens, 4, parent=1) != block_names(tokens, 4, parent=2)


def test_names_are_pinned() -> None:
    # The names are part of the wire: a change of the hash must be a deliberate protocol change.
    assert block_names(list(range(8)), 4) == [6232228188156701842, 1332863295004555542]
    assert block_names(list(range(8)), 4, parent=5) == [31314316660114586, 3903847388157939152]
    assert WordTokenizer().encode("hello world") == [907060870, 980881731]


def test_names_and_ids_are_the_same_in_another_process() -> None:
    code = (
        "from shim_common.prefix import WordTokenizer, block_names;"
        "print(block_names(WordTokenizer().encode('a b c d e f g h i'), 2))"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.add(result.stdout.strip())
    here = str(block_names(WordTokenizer().encode("a b c d e f g h i"), 2))
    assert outputs == {here}


@pytest.mark.parametrize(
    ("tokens", "block_size", "parent"),
    [
        ([1, 2], 0, None),
        ([1, 2], -1, None),
        ([1, 2], True, None),
        ([1, 2], 1, -1),
        ([1, 2], 1, MAX_BLOCK_NAME + 1),
        ([-1, 2], 1, None),
        ([MAX_TOKEN_ID + 1], 1, None),
        ([1.5], 1, None),
    ],
)
def test_bad_arguments_are_value_errors(tokens: list[int], block_size: int, parent: int) -> None:
    with pytest.raises(ValueError, match=r"block_size|parent|token ids"):
        block_names(tokens, block_size, parent)


def test_word_tokenizer_counts_as_the_mocker_does() -> None:
    text = "  the quick\tbrown\n fox  "
    ids = WordTokenizer().encode(text)
    assert len(ids) == len(text.split()) == 4
    assert ids[0] != ids[1]
    assert WordTokenizer().encode("fox") == [ids[3]]
    assert all(0 <= token <= MAX_TOKEN_ID for token in WordTokenizer().encode("é ü ∑ 😀"))


WORDS = WordTokenizer()


@given(
    text=st.text(
        alphabet=st.sampled_from(list("ab \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\u00a0\u2003é")),
        max_size=30,
    )
)
def test_every_text_is_cut_where_str_split_cuts_it(text: str) -> None:
    # The fast path for ASCII text must give the ids of the plain definition, exotic spaces
    # included.
    assert WORDS.encode(text) == [zlib.crc32(word.encode("utf-8")) for word in text.split()]


@given(
    text=st.text(
        alphabet=st.sampled_from(list("ab \t\n\x1c\u00a0\u2003é")),
        max_size=60,
    ),
    piece=st.integers(1, 7),
    block_size=st.integers(1, 3),
)
def test_a_long_text_is_encoded_and_named_in_pieces_as_if_whole(
    text: str, piece: int, block_size: int
) -> None:
    # A long prompt is encoded, and its ids packed, a piece at a time (so a worker thread
    # gives the event loop its turn between pieces): the ids and names are those of the whole.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix, "TOKENIZE_PIECE_CHARS", piece)
        ids = WORDS.encode(text)
        names = block_names(ids, block_size)
    assert ids == [zlib.crc32(word.encode("utf-8")) for word in text.split()]
    assert names == block_names(ids, block_size)


def test_chat_prompts_are_the_messages_texts_in_order() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi there"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
    }
    assert prompt_token_ids("chat_completions", body, WORDS) == WORDS.encode("be brief hi there")


def test_completion_prompts_as_text_strings_or_token_ids() -> None:
    assert prompt_token_ids("completions", {"prompt": "a b c"}, WORDS) == WORDS.encode("a b c")
    assert prompt_token_ids("completions", {"prompt": ["a b", "c"]}, WORDS) == WORDS.encode("a b c")
    assert prompt_token_ids("completions", {"prompt": [5, 0, MAX_TOKEN_ID]}, WORDS) == [
        5,
        0,
        MAX_TOKEN_ID,
    ]
    assert prompt_token_ids("embeddings", {"input": [3, 4]}, WORDS) == [3, 4]


@pytest.mark.parametrize(
    ("endpoint", "body", "match"),
    [
        ("completions", {}, "'prompt' is required"),
        ("completions", {"prompt": []}, "'prompt' must be"),
        ("completions", {"prompt": [1, "a"]}, "'prompt' must be"),
        ("completions", {"prompt": [[1, 2]]}, "'prompt' must be"),
        ("completions", {"prompt": [True]}, "'prompt' must be"),
        ("completions", {"prompt": [-1]}, "'prompt' must be"),
        ("completions", {"prompt": [MAX_TOKEN_ID + 1]}, "'prompt' must be"),
        ("completions", {"prompt": 5}, "'prompt' must be"),
        ("embeddings", {"input": {}}, "'input' must be"),
        ("chat_completions", {"messages": []}, "'messages' must be"),
        ("chat_completions", {"messages": [{"role": "user"}]}, "has no 'content'"),
        ("chat_completions", {"messages": [{"content": 3}]}, "content must be"),
        ("images", {"prompt": "a"}, "unsupported endpoint"),
    ],
)
def test_bad_shapes_are_value_errors(endpoint: str, body: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prompt_token_ids(endpoint, body, WORDS)


def write_tiny_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json of six words, made with the tokenizers library itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3, "cat": 4, "sat": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_a_tokenizer_json_encodes_prompts(tmp_path: Path) -> None:
    tokenizer = FileTokenizer(str(write_tiny_tokenizer(tmp_path / "tokenizer.json")))
    assert tokenizer.encode("hello world") == [1, 2]
    assert tokenizer.encode("the dog sat") == [3, 0, 5]
    body = {"messages": [{"role": "user", "content": "the cat"}, {"content": "sat"}]}
    assert prompt_token_ids("chat_completions", body, tokenizer) == [3, 4, 5]


def test_a_bad_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        FileTokenizer(str(bad))
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        FileTokenizer(str(tmp_path / "missing.json"))


def test_without_the_library_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"dynamo-shim\[tokenizers\]"):
        FileTokenizer(str(tmp_path / "tokenizer.json"))
