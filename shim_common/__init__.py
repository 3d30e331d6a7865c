"""What the worker ingress and the frontend shim both speak.

- :mod:`shim_common.wire`: the msgpack protocol of record between frontends and workers
  (messages, plane paths, close codes, chunk merging); public.
- :mod:`shim_common.prefix`: the one tokenisation and block naming of prompts (a prefix cache's
  keys, on both sides); public.
- the HTTP/1.1 server both sides serve on (private): ``_httpserver`` (the entry points, the
  ordered shutdown), ``_http_connection`` (one connection's tasks and rules), ``_http_parser``
  (llhttp, sans-IO), ``_http_cycle`` (the states of a request/response cycle, sans-IO),
  ``_http_head_writer`` (response heads), ``_http_idle`` (the idle connections and slow uploads,
  closed first when the process runs out of descriptors), ``_socket_io`` (a connection's reads
  and writes with the system call tried first) and ``_http_exchange`` (what a handler sees: the
  request, the responder, the limits);
- its shared status routes (``_status``), the CLI helpers of both console scripts (``_cli``),
  small network helpers (``_net``), bearer tokens and TLS (``_access``), the kinds of number
  taken from outside with their one check each (``_numbers``), the one rule for quoting client
  text in a message and the one wording of a 404 and a 405 (``_client_text``), and the busy
  thresholds with the busy rule of a rank (``_busy``; the thresholds are a wire type, imported
  as :class:`shim_common.wire.BusyThresholds`).

Both sides import this package; neither imports the other's internals (import-linter contracts
in pyproject.toml, run by ``scripts/check``, and ``tests/test_layout.py``).
"""
