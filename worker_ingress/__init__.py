"""The worker side: an admission gate in front of an inference engine, served over websockets.

No module here talks to the network except :mod:`worker_ingress._server` (the websocket planes),
:mod:`shim_common._httpserver` and :mod:`worker_ingress._system` (the HTTP system port).

Public here: :func:`validate_worker_args`, through which the frontend checks the worker flags it
passes on to ``--local-workers`` children, and :mod:`worker_ingress.engines`, the engine protocol.
Everything else is private (a leading underscore).
"""

from __future__ import annotations

from collections.abc import Sequence

__version__ = "0.1.0"

__all__ = ["validate_worker_args"]


def validate_worker_args(argv: Sequence[str]) -> None:
    """Check worker flags as ``worker-ingress`` would, without starting anything.

    The ``DYN_*`` environment is read too, as the worker would read it.

    Raises:
        shim_common._cli.CliError: an invalid flag, variable or combination (one line).
    """
    # Imported here: importing the package must not pay for the command line.
    from worker_ingress._cli import parse_args

    parse_args(argv)
