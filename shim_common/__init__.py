"""What the worker ingress and the frontend shim both speak.

- :mod:`shim_common.wire`: the msgpack protocol of record between frontends and workers
  (messages, plane paths, close codes, chunk merging); public.
- the HTTP/1.1 server both sides serve on (private ``_httpserver``), its shared status routes
  (``_status``), the CLI helpers of both console scripts (``_cli``), small network helpers
  (``_net``), and the busy thresholds with the busy rule of a rank (``_busy``).

Both sides import this package; neither imports the other's internals (import-linter contracts
in pyproject.toml, run by ``scripts/check``, and ``tests/test_layout.py``).
"""
