"""Engines the worker ingress can wrap: the Engine protocol and what an engine needs to build one.

An in-process engine (``--engine package.module:factory``) needs only these names: the protocol
and its types (from :mod:`worker_ingress.engines._base`), and :class:`ChangeSignal`, which an
engine bumps when its load changes.
"""

from shim_common.wire import RankLoad as RankLoad
from worker_ingress._watch import ChangeSignal as ChangeSignal
from worker_ingress.engines._base import Engine as Engine
from worker_ingress.engines._base import EngineConfig as EngineConfig
from worker_ingress.engines._base import EngineInputError as EngineInputError
from worker_ingress.engines._base import EngineOutput as EngineOutput
from worker_ingress.engines._base import PreparedRequest as PreparedRequest
