"""NVIDIA Dynamo beside ours: what it takes to run its frontend and mocker on this machine.

Dynamo 1.6 runs here without etcd or NATS: ``--discovery-backend file`` (a scratch folder in
``DYN_FILE_KV``), the TCP request plane and the ZMQ event plane (:data:`PLANES`), every address
pinned to 127.0.0.1 (:func:`dynamo_env`). Its mocker needs a model folder for the tokenizer, the
chat template and the model's sizes; no model hub is reachable, so :func:`write_model_folder`
makes a tiny one. It is installed in an interpreter of its own (``bench/bench_dynamo.py`` says
how); :func:`dynamo_version` says whether one can run it, and a benchmark without one skips its
Dynamo column and says why.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Final

from bench.kit.processes import clean_env

__all__ = [
    "DEFAULT_PYTHON",
    "MODEL",
    "PLANES",
    "dynamo_env",
    "dynamo_version",
    "skipped",
    "write_model_folder",
]

#: Where ``--dynamo-python`` looks by default: the virtual environment the install makes.
DEFAULT_PYTHON: Final = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"
#: The model both systems serve.
MODEL: Final = "mock-model"
#: Dynamo's discovery and planes without etcd or NATS.
PLANES: Final = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")

#: The words the tiny tokenizer knows besides its numbered filler; every prompt here uses them.
#: The filler is large because Dynamo's mocker draws token ids beyond a few hundred: an id
#: the vocabulary lacks decodes to no text, and Dynamo's frontend sends no event for it (with
#: 500 words its streams carried three events, not one per token).
WORDS: Final = ("one", "two", "a", "b", "c", "hello", "there", "user", "assistant", "system", ":")
FILLER: Final = 32000


# ----------------------------------------------------------------------------- the model folder


def _special(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def write_model_folder(folder: Path) -> None:
    """Write the smallest model folder Dynamo's mocker and frontend accept.

    - ``tokenizer.json``: a word-level tokenizer (split on whitespace and punctuation) of three
      special tokens, the words of :data:`WORDS` and :data:`FILLER` numbered words, so that the
      token ids the mocker draws decode to something;
    - ``tokenizer_config.json``: the special tokens and a one-line chat template
      (``role : content`` per message);
    - ``config.json``: a two-layer Llama shape, from which the mocker derives the bytes of KV
      cache per token;
    - ``generation_config.json``: the end-of-sequence id.

    Args:
        folder: Created if missing; files in it are replaced.
    """
    folder.mkdir(parents=True, exist_ok=True)
    vocab_words = ["<unk>", "<s>", "</s>", *WORDS, *(f"w{i}" for i in range(FILLER))]
    vocab = {word: index for index, word in enumerate(vocab_words)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_special(0, "<unk>"), _special(1, "<s>"), _special(2, "</s>")],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    template = (
        "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
    )
    files: dict[str, Any] = {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": 4096,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": template,
        },
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": len(vocab_words),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "torch_dtype": "float16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2},
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=1) + "\n")


def dynamo_env(kv_folder: Path, log: str) -> dict[str, str]:
    """Environment of a Dynamo process: file discovery in ``kv_folder``, loopback, ``log``."""
    return clean_env(
        DYN_FILE_KV=str(kv_folder),
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
        DYN_EVENT_PLANE_HOST="127.0.0.1",
        DYN_LOG=log,
    )


def dynamo_version(python: str) -> str | None:
    """The installed ``ai-dynamo`` version, or None when ``python`` cannot import Dynamo."""
    probe = (
        "import importlib.metadata, dynamo.frontend, dynamo.mocker; "
        "print(importlib.metadata.version('ai-dynamo'))"
    )
    try:
        result = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def skipped(python: str) -> str:
    """The line a benchmark prints when ``python`` cannot run Dynamo."""
    return (
        f"Dynamo: skipped, {python} cannot import dynamo.frontend and dynamo.mocker"
        " (see bench/bench_dynamo.py to install them)"
    )
