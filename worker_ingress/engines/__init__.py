"""Engines the worker ingress can wrap; :mod:`worker_ingress.engines.base` defines the protocol."""

from worker_ingress.engines.base import (
    Engine as Engine,
)
from worker_ingress.engines.base import (
    EngineConfig as EngineConfig,
)
from worker_ingress.engines.base import (
    EngineInputError as EngineInputError,
)
from worker_ingress.engines.base import (
    EngineOutput as EngineOutput,
)
from worker_ingress.engines.base import (
    PreparedRequest as PreparedRequest,
)
