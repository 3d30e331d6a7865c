"""The ``openai`` engine: the admission gate in front of a real OpenAI-compatible server.

:func:`create` (what ``--engine openai`` loads) builds an :class:`OpenAIUpstreamEngine`; its
docstring (:mod:`worker_ingress.engines.upstream._engine`) says what is forwarded and how the
limits and the load are read. The modules under it, one concern each:

- ``_engine``: the engine itself (prepare, generate, the configuration announced, the load);
- ``_client``: HTTP to the upstream (httpx with LLM-serving timeouts, cancellation, the
  keep-alive retry rule) and the server-sent events decoder;
- ``_discovery``: what is asked of the upstream outside requests (readiness, limits, load);
- ``_probes`` and ``_metrics``: sans-IO parsers of its ``/props``, ``/get_server_info``,
  ``/slots`` and ``/metrics`` answers;
- ``_in_flight``: the load this engine has put on the upstream, as running totals (sans-IO).
"""

from worker_ingress.engines.upstream._engine import OpenAIUpstreamEngine as OpenAIUpstreamEngine
from worker_ingress.engines.upstream._engine import UpstreamError as UpstreamError
from worker_ingress.engines.upstream._engine import create as create
