"""``wrk`` (an HTTP load generator in C: ``apt-get install -y wrk``) on the load CPU, its summary
read back as figures.

A benchmark that measures our servers at their limit loads them with wrk rather than with
Python, which would saturate its core long before a server does: one thread, on the load CPU,
``connections`` keep-alive connections for ``seconds``, every request the same (a ``GET``, or a
``POST`` of a JSON body, written to a Lua script once per body).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

from bench.kit.processes import pinned

__all__ = ["LOAD_CPU", "SERVER_CPU", "Wrk", "need_wrk"]

#: Where the servers a benchmark measures run, and where wrk (and the benchmark) runs.
SERVER_CPU: Final = 0
LOAD_CPU: Final = 1
_LATENCY_UNITS: Final = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def need_wrk() -> None:
    """Exit with a line saying how to install wrk where it is missing."""
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (apt-get install -y wrk)")


class Wrk:
    """Runs wrk and reads its summary.

    Args:
        seconds: Seconds per run (whole seconds: wrk's unit; at least 1).
        connections: Keep-alive connections of a run, unless a run says otherwise.
        scratch: A folder for the Lua scripts of the bodies posted.
    """

    def __init__(self, seconds: float, connections: int, scratch: Path) -> None:
        self.seconds = seconds
        self.connections = connections
        self.scratch = scratch

    def _script(self, body: str) -> str:
        path = self.scratch / f"post-{hashlib.sha1(body.encode()).hexdigest()[:12]}.lua"
        if not path.exists():
            path.write_text(
                'wrk.method = "POST"\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(body)}\n"
            )
        return str(path)

    def run(
        self,
        url: str,
        *,
        body: str | None = None,
        connections: int | None = None,
        seconds: float | None = None,
    ) -> dict[str, float]:
        """Load ``url`` (a ``GET``, or a ``POST`` of ``body``) and return the figures.

        Returns:
            ``rps`` (requests per second), ``requests``, ``non_2xx`` (answers that were not
            2xx or 3xx) and, when wrk printed them, ``p50_ms`` and ``p99_ms``.
        """
        args = [
            "wrk",
            "-t1",
            f"-c{connections or self.connections}",
            f"-d{max(1, round(seconds or self.seconds))}s",
            "--latency",
        ]
        if body is not None:
            args += ["-s", self._script(body)]
        output = subprocess.run(
            pinned(LOAD_CPU, [*args, url]), capture_output=True, text=True, check=True
        ).stdout
        rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
        if rate is None:
            raise RuntimeError(f"unexpected wrk output:\n{output}")
        total = re.search(r"(\d+) requests in", output)
        non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
        figures = {
            "rps": float(rate[1]),
            "requests": float(total[1]) if total else 0.0,
            "non_2xx": float(non_2xx[1]) if non_2xx else 0.0,
        }
        for label, key in (("50%", "p50_ms"), ("99%", "p99_ms")):
            match = re.search(rf"{re.escape(label)}\s+([\d.]+)(us|ms|s)\b", output)
            if match:
                figures[key] = float(match[1]) * _LATENCY_UNITS[match[2]]
        return figures
