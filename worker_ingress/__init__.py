"""The worker side: an admission gate in front of an inference engine, served over websockets.

Only these modules talk to the network: :mod:`worker_ingress._server` (the websocket listener,
access and drain), :mod:`worker_ingress._frame_bound` (the bound on a client's frames, in front
of the websocket library), :mod:`worker_ingress._planes` (what goes over each websocket
connection), :mod:`worker_ingress._system` (the HTTP system port, through
:mod:`shim_common._httpserver`), and the ``openai`` engine's
:mod:`worker_ingress.engines.upstream` (HTTP to its upstream server).

Public here: what a frontend needs for its ``--local-workers`` children, whose flags are declared
once, by the worker's command: :func:`local_worker_parameters` (those flags, for the frontend's
command to take) and :func:`validate_worker_args` (the worker's own check of what it was given);
and :mod:`worker_ingress.engines`, the engine protocol. Everything else is private (a leading
underscore).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from worker_ingress._version import __version__ as __version__

__all__ = ["local_worker_parameters", "validate_worker_args"]


def local_worker_parameters(group: str) -> list[inspect.Parameter]:
    """The worker flags a frontend passes on to its ``--local-workers`` children, in order, as
    keyword parameters for the frontend's cyclopts command (the worker's types and checks, no
    environment variable, default ``None``).

    Args:
        group: the help group to list them under.
    """
    # Imported here: importing the package must not pay for the command line.
    from worker_ingress._cli import local_worker_parameters as parameters

    return parameters(group)


def validate_worker_args(argv: Sequence[str]) -> None:
    """Check worker flags as ``worker-ingress`` would, without starting anything.

    The ``DYN_*`` environment is read too, as the worker would read it.

    Raises:
        shim_common._cli.CliError: an invalid flag, variable or combination (one line).
    """
    # Imported here: importing the package must not pay for the command line.
    from worker_ingress._cli import parse_args

    parse_args(argv)
