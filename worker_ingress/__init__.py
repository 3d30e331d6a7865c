"""The worker side: an admission gate in front of an inference engine, served over websockets.

No module here talks to the network except :mod:`worker_ingress._server` (the websocket planes),
:mod:`shim_common._httpserver` and :mod:`worker_ingress._system` (the HTTP system port).
"""

__version__ = "0.1.0"
