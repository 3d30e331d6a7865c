"""Engines the worker ingress can wrap; :mod:`worker_ingress.engines._base` defines the protocol."""

from worker_ingress.engines._base import (
    Engine as Engine,
)
from worker_ingress.engines._base import (
    EngineConfig as EngineConfig,
)
from worker_ingress.engines._base import (
    EngineInputError as EngineInputError,
)
from worker_ingress.engines._base import (
    EngineOutput as EngineOutput,
)
from worker_ingress.engines._base import (
    PreparedRequest as PreparedRequest,
)
