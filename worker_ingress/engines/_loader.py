"""Turn ``--engine`` into an engine object: ``mocker``, ``instant``, ``openai`` or
``package.module:factory``.

A factory is a callable taking the :class:`~worker_ingress._config.WorkerSettings` and returning an
object that follows :class:`~worker_ingress.engines._base.Engine`. Loading happens before the worker
binds any port, so a wrong path stops the process with exit code 2 and a clear line, as does a
``--disaggregation-mode`` other than ``agg`` for an engine that cannot hand KV off.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from worker_ingress._config import WorkerSettings
from worker_ingress.engines._base import Engine, hands_off_kv

__all__ = ["EngineLoadError", "load_engine"]

_BUILT_IN = {
    "mocker": "worker_ingress.engines._mocker:create",
    "instant": "worker_ingress.engines._instant:create",
    "openai": "worker_ingress.engines.upstream:create",
}


class EngineLoadError(Exception):
    """The engine named by ``--engine`` cannot be imported or built."""


def load_engine(settings: WorkerSettings) -> Engine:
    """Import and build the engine that ``settings.engine`` names.

    Raises:
        EngineLoadError: the module or factory does not exist, or the factory failed.
    """
    path = _BUILT_IN.get(settings.engine, settings.engine)
    module_name, _, factory_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineLoadError(
            f'--engine "{settings.engine}": cannot import module "{module_name}": {exc}'
        ) from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise EngineLoadError(
            f'--engine "{settings.engine}": module "{module_name}" has no callable "{factory_name}"'
        )
    try:
        engine = cast(Callable[[WorkerSettings], Engine], factory)(settings)
    except (ValueError, TypeError) as exc:
        raise EngineLoadError(f'--engine "{settings.engine}": {exc}') from exc
    mode = settings.disaggregation_mode
    if mode != "agg" and not hands_off_kv(engine):
        # A role the engine cannot serve: frontends would send it hops it must refuse.
        raise EngineLoadError(
            f'--engine "{settings.engine}" cannot hand KV off, so it cannot be a {mode} worker '
            "(--disaggregation-mode)"
        )
    return engine
