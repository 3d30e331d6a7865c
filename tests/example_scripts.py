"""The example scripts, loaded from their paths, and a scripted HTTP handler to run them against.

The example scripts are not a package; :func:`load_example` loads one from its path, once per
test run, so every test module sees the same module object. :class:`ScriptedServer` is served by
the project's own HTTP server on loopback, so the clients are checked against real sockets, not
only against fakes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from shim_common._httpserver import HTTPRequest, HTTPResponder, json_headers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@functools.cache
def load_example(name: str) -> ModuleType:
    """The script ``examples/<name>.py`` as a module (loaded once, then the same object)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class ScriptedServer:
    """An HTTP handler that sheds every ``shed_every``-th request with 529 and Retry-After."""

    def __init__(self, shed_first: int = 0, shed_every: int = 0) -> None:
        self.shed_first = shed_first
        self.shed_every = shed_every
        self.requests = 0

    async def handle(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        self.requests += 1
        n = self.requests
        if n <= self.shed_first or (self.shed_every and n % self.shed_every == 0):
            # Like the frontend's fast shed: answered before the body is read, so the server
            # closes the connection afterwards and the client must reconnect.
            body = b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
            await responder.send(529, json_headers((b"retry-after", b"1")), body)
            return
        await request.read_body()
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
        await responder.send(200, json_headers(), json.dumps(reply).encode())
