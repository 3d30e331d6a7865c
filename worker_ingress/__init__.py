"""The worker side: an admission gate in front of an inference engine, served over websockets.

No module here talks to the network except :mod:`worker_ingress.server` (the websocket planes),
:mod:`worker_ingress.httpserver` and :mod:`worker_ingress.system` (the HTTP system port).
"""

__version__ = "0.1.0"
