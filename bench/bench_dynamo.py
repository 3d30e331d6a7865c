"""The frontend figures of ``bench/bench_frontend.py``, ours and NVIDIA Dynamo's, side by side.

Run from the repository's root: ``python -m bench.bench_dynamo [--seconds 5] [--connections 64]
[--repeats 3] [--dynamo-python .venv-dynamo/bin/python]`` (needs ``wrk``:
``apt-get install -y wrk``). Servers are pinned to CPU 0 and wrk to CPU 1 with ``taskset``.

Each system runs two deployments, both on loopback:

- busy: a mocker slowed down 50 times (``--speedup-ratio 0.02``) holding one long streamed
  chat, behind a frontend whose decode threshold is 0.0 (Dynamo's needs ``--router-mode kv`` for
  it), so every chat it gets is answered 529;
- fast: a mocker sped up 100 times behind a frontend without thresholds.

Figures, wrk on ``--connections`` keep-alive connections unless said otherwise, the systems
taking turns within each repeat, medians of ``--repeats``:

1. ``GET /live`` on the busy frontend;
2. chat answered 529 by the busy frontend;
3. chat with ``max_tokens`` 1 through the fast frontend and mocker;
4. chat for an unknown model on the fast frontend (404);
5. one connection: p50/p99 of the chat of 3 and of ``GET /live``, on the fast frontend.

With both systems present, the report ends with ours over Dynamo's for figures 1-4, from the
same run.

Both sides log at warning level (``--dynamo-log`` sets Dynamo's ``DYN_LOG``): at info level
Dynamo writes lines for every request, a cost of its own. Even at warning level it writes three
to four error lines for every 529 and every 404; ours writes none. wrk's count of non-2xx answers
is printed too, so a figure that measured the wrong answer shows. Both systems stay up for the
whole run, each idle (but for its long request) while the other is measured.

Installing Dynamo (a separate virtual environment, so that its requirements stay out of ours;
its planner needs ``aisimulate``, which installs only from an index of its own and is not
needed by the frontend or the mocker, hence ``--no-deps`` and the list by hand)::

    python -m venv .venv-dynamo
    .venv-dynamo/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    .venv-dynamo/bin/pip install 'aiohttp>=3.14.3,<4' 'certifi>=2026.10.19' \\
        'kubernetes>=32.0.1,<33' 'msgspec>=0.19' 'prometheus-client>=0.23.1,<1' 'pyzmq>=26' \\
        'redis>=6.2,<9' 'tqdm>=4' 'transformers>=4.56' 'typing-extensions>=4.10' \\
        'zstandard>=0.23,<1' 'pydantic>=2.10.6,<=2.13.5' 'uvloop>=0.21'

(the ``Requires-Dist`` of both wheels, less ``aisimulate``). Dynamo 1.6 runs here without etcd
or NATS: ``--discovery-backend file`` (a scratch folder in ``DYN_FILE_KV``), the TCP request
plane and the ZMQ event plane, every address pinned to 127.0.0.1 by ``DYN_TCP_RPC_HOST``,
``DYN_TCP_RESPONSE_STREAM_HOST`` and ``DYN_EVENT_PLANE_HOST``. Its mocker needs a model folder
for the tokenizer, the chat template and the model's sizes; no model hub is reachable, so
:func:`write_model_folder` makes a tiny one. Without a Dynamo interpreter the Dynamo column is
skipped and says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from bench.bench_frontend import Wrk, _pinned, _process, _wait_connected

ROOT: Final = Path(__file__).resolve().parent.parent
SERVER_CPU: Final = "0"
MODEL: Final = "mock-model"
SLOW: Final = "0.02"
FAST: Final = "100"
CHAT: Final = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 1}
)
UNKNOWN: Final = json.dumps(
    {
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "one two"}],
        "max_tokens": 1,
    }
)
LONG: Final = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a b c"}],
        "max_tokens": 2000,
        "stream": True,
    }
)
#: The words the tiny tokenizer knows besides its numbered filler; every prompt here uses them.
WORDS: Final = ("one", "two", "a", "b", "c", "hello", "there", "user", "assistant", "system", ":")
FILLER: Final = 500


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


# ----------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _post(url: str, body: str, timeout: float = 10.0) -> int:
    request = urllib.request.Request(
        url, data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            status: int = reply.status
    except urllib.error.HTTPError as error:
        status = error.code
    return status


def _wait_status(url: str, body: str, want: int, *, timeout: float) -> None:
    """Post ``body`` until the answer is ``want`` (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = _post(url, body)
        except OSError as error:
            last = error
        if last == want:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} never answered {want} (last: {last!r})")


@contextlib.contextmanager
def _background(args: list[str], env: Mapping[str, str], log: Path) -> Iterator[None]:
    """Run a server on the server CPU, its output to ``log``; stop it and its group at the end."""
    with log.open("ab") as sink:
        process = subprocess.Popen(
            _pinned(SERVER_CPU, args),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)


@contextlib.contextmanager
def _long_request(url: str, scratch: Path) -> Iterator[None]:
    """Hold one long streamed chat open (it keeps KV blocks in use: the fleet is busy).

    Probing for 529 starts only once the stream has begun: a probe sent alongside it could be
    admitted first, make the fleet busy for a moment, and have the long request itself shed.
    """
    stream = scratch / f"long-{_free_port()}.out"
    process = subprocess.Popen(
        [
            "curl", "-sN", "-o", str(stream), "-H", "Content-Type: application/json",
            "-d", LONG, url + "/v1/chat/completions",
        ]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (stream.exists() and stream.stat().st_size > 0):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the long request to {url} did not start streaming")
            time.sleep(0.1)
        _wait_status(url + "/v1/chat/completions", CHAT, 529, timeout=60)
        yield
    finally:
        process.terminate()
        process.wait()


class Deployment:
    """The URLs of one system's busy and fast frontends."""

    def __init__(self, busy: str, fast: str) -> None:
        self.busy = busy
        self.fast = fast


@contextlib.contextmanager
def shim_deployment(scratch: Path) -> Iterator[Deployment]:
    """Our worker and frontend, twice: busy (slow mocker, threshold 0.0) and fast."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    python = sys.executable
    worker = [python, "-m", "worker_ingress", "--port", "0", "--system-port", "0"]
    worker += ["--log-level", "warning"]
    frontend = [python, "-m", "frontend_shim", "--http-port", "0", "--log-level", "warning"]
    with (
        _process([*worker, "--speedup-ratio", SLOW], env) as (slow_ws, _),
        _process([*worker, "--speedup-ratio", FAST], env) as (fast_ws, _),
        _process(
            [*frontend, "--worker", slow_ws, "--active-decode-blocks-threshold", "0.0"], env
        ) as (busy,),
        _process([*frontend, "--worker", fast_ws], env) as (fast,),
    ):
        _wait_connected(busy)
        _wait_connected(fast)
        _wait_status(fast + "/v1/chat/completions", CHAT, 200, timeout=60)
        with _long_request(busy, scratch):
            yield Deployment(busy, fast)


def dynamo_env(kv_folder: Path, log: str) -> dict[str, str]:
    """Environment of a Dynamo process: file discovery in ``kv_folder``, loopback, ``log``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env.update(
        DYN_FILE_KV=str(kv_folder),
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
        DYN_EVENT_PLANE_HOST="127.0.0.1",
        DYN_LOG=log,
    )
    return env


@contextlib.contextmanager
def dynamo_deployment(python: str, scratch: Path, log: str) -> Iterator[Deployment]:
    """Dynamo's mocker and frontend, twice: busy and fast, each pair with its own discovery."""
    model = scratch / "model"
    write_model_folder(model)
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    mocker = [python, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL]
    frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
    urls: list[str] = []
    with contextlib.ExitStack() as stack:
        for name, speedup, extra in (
            ("busy", SLOW, ["--router-mode", "kv", "--active-decode-blocks-threshold", "0.0"]),
            ("fast", FAST, []),
        ):
            env = dynamo_env(scratch / f"kv-{name}", log)
            port = _free_port()
            stack.enter_context(
                _background(
                    [*mocker, *planes, "--speedup-ratio", speedup],
                    env,
                    scratch / f"dynamo-mocker-{name}.log",
                )
            )
            stack.enter_context(
                _background(
                    [*frontend, "--http-port", str(port), *planes, *extra],
                    env,
                    scratch / f"dynamo-frontend-{name}.log",
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        busy, fast = urls
        _wait_status(fast + "/v1/chat/completions", CHAT, 200, timeout=180)
        _wait_status(busy + "/v1/chat/completions", CHAT, 200, timeout=180)
        stack.enter_context(_long_request(busy, scratch))
        yield Deployment(busy, fast)


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


# ----------------------------------------------------------------------------- figures


def _lua(path: Path, body: str) -> str:
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body)}\n"
    )
    return str(path)


Figures = dict[str, dict[str, float]]


def measure(deployment: Deployment, wrk: dict[str, Wrk]) -> Figures:
    """The five figures of the module docstring, on one system."""
    return {
        "live": wrk["get"].run(deployment.busy + "/live"),
        "shed": wrk["chat"].run(deployment.busy + "/v1/chat/completions", post=True),
        "chat": wrk["chat"].run(deployment.fast + "/v1/chat/completions", post=True),
        "unknown": wrk["unknown"].run(deployment.fast + "/v1/chat/completions", post=True),
        "chat1": wrk["chat"].run(
            deployment.fast + "/v1/chat/completions", post=True, connections=1
        ),
        "live1": wrk["get"].run(deployment.fast + "/live", connections=1),
    }


def median_figures(runs: list[Figures]) -> Figures:
    """Each figure's median over runs."""
    return {
        name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]}
        for name in runs[0]
    }


ROWS: Final[list[tuple[str, str, Callable[[dict[str, float]], str]]]] = [
    ("GET /live, busy frontend (req/s)", "live", lambda f: f"{f['rps']:,.0f}"),
    ("chat answered 529, fleet busy (req/s)", "shed", lambda f: f"{f['rps']:,.0f}"),
    ("chat max_tokens 1, fast mocker (req/s)", "chat", lambda f: f"{f['rps']:,.0f}"),
    ("chat, unknown model 404 (req/s)", "unknown", lambda f: f"{f['rps']:,.0f}"),
    (
        "one connection: chat p50 / p99 (ms)",
        "chat1",
        lambda f: f"{f.get('p50_ms', float('nan')):.2f} / {f.get('p99_ms', float('nan')):.2f}",
    ),
    (
        "one connection: /live p50 / p99 (ms)",
        "live1",
        lambda f: f"{f.get('p50_ms', float('nan')):.2f} / {f.get('p99_ms', float('nan')):.2f}",
    ),
]


def _non_2xx(figure: dict[str, float]) -> str:
    return f"{figure['non_2xx'] / figure['requests']:.0%}" if figure["requests"] else "n/a"


def report(columns: dict[str, Figures]) -> str:
    """The figures as a Markdown table, one column per system, then the ratios within each."""
    names = list(columns)
    lines = [
        "| figure | " + " | ".join(names) + " | non-2xx share |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for label, key, show in ROWS:
        cells = [show(columns[name][key]) for name in names]
        checks = " / ".join(_non_2xx(columns[name][key]) for name in names)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {checks} |")
    lines.append("")
    lines.append("| ratio, within each system | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for label, top, bottom in (
        ("529s / GET /live", "shed", "live"),
        ("chat / GET /live", "chat", "live"),
        ("404s / GET /live", "unknown", "live"),
    ):
        cells = [f"{columns[n][top]['rps'] / columns[n][bottom]['rps']:.2f}" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for name in names:
        chat1, live1 = columns[name]["chat1"], columns[name]["live1"]
        added = chat1.get("p50_ms", float("nan")) - live1.get("p50_ms", float("nan"))
        cells.append(f"{added:.2f} ms")
    lines.append("| one connection: chat p50 - /live p50 | " + " | ".join(cells) + " |")
    if len(names) == 2:
        ours, theirs = names
        lines.append("")
        lines.append(f"| ratio, {ours} / {theirs} (same run) | requests/s |")
        lines.append("|---|---|")
        for label, key, _ in ROWS[:4]:
            ratio = columns[ours][key]["rps"] / columns[theirs][key]["rps"]
            lines.append(f"| {label.removesuffix(' (req/s)')} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dynamo-python",
        default=str(ROOT / ".venv-dynamo" / "bin" / "python"),
        help="an interpreter that can import dynamo.frontend and dynamo.mocker",
    )
    parser.add_argument("--dynamo-log", default="warn", help="DYN_LOG of the Dynamo processes")
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    options = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (apt-get install -y wrk)")
    version = dynamo_version(options.dynamo_python)
    if version is None:
        print(
            f"Dynamo: skipped, {options.dynamo_python} cannot import dynamo.frontend and"
            " dynamo.mocker (see this module's docstring to install them)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        scratch = options.logs or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        wrk = {
            "get": Wrk(options.seconds, options.connections, ""),
            "chat": Wrk(options.seconds, options.connections, _lua(scratch / "chat.lua", CHAT)),
            "unknown": Wrk(
                options.seconds, options.connections, _lua(scratch / "unknown.lua", UNKNOWN)
            ),
        }
        runs: dict[str, list[Figures]] = {}
        ours = "dynamo-shim"
        theirs = f"Dynamo {version}"
        with contextlib.ExitStack() as stack:
            deployments = {ours: stack.enter_context(shim_deployment(scratch))}
            if version is not None:
                deployments[theirs] = stack.enter_context(
                    dynamo_deployment(options.dynamo_python, scratch, options.dynamo_log)
                )
            names = list(deployments)
            for repeat in range(options.repeats):
                turn = repeat % len(names)
                for name in [*names[turn:], *names[:turn]]:
                    print(f"repeat {repeat + 1}: {name}", file=sys.stderr)
                    runs.setdefault(name, []).append(measure(deployments[name], wrk))
    print(
        f"wrk: {options.connections} connections (one for the last two rows),"
        f" {options.seconds:g} s per figure, medians of {options.repeats} repeats"
    )
    print()
    print(report({name: median_figures(figures) for name, figures in runs.items()}))


if __name__ == "__main__":
    main()
