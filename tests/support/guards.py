"""Test-only instrumentation the product carries no hooks for.

* :func:`track_bridges`: every :class:`aiokvcache._bridge.Bridge` made from
  now on, weakly, so a fixture can check that no native job outlives the test
  that started it (the library's own guarantee, asserted from outside).
* :class:`ServiceErrors`: what the peer-service loops logged on the
  ``aiokvcache.service`` logger at ERROR (an error that reached a service
  loop's exception handler: always a bug).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from aiokvcache import LLMDataDist, _bridge

__all__ = ["BRIDGES", "ServiceErrors", "engine_of", "track_bridges"]

#: Every bridge made since :func:`track_bridges`.
BRIDGES: weakref.WeakSet[_bridge.Bridge] = weakref.WeakSet()


def track_bridges() -> None:
    """Record every Bridge made from now on in :data:`BRIDGES` (idempotent)."""
    cls = _bridge.Bridge
    if getattr(cls.__init__, "_tracked", False):
        return
    original = cls.__init__

    def init(self: _bridge.Bridge, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        BRIDGES.add(self)

    init._tracked = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[method-assign]


class ServiceErrors(logging.Handler):
    """Collects the ERROR records of the ``aiokvcache.service`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> ServiceErrors:
        logging.getLogger("aiokvcache.service").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("aiokvcache.service").removeHandler(self)

    def describe(self) -> str:
        return "; ".join(r.getMessage() for r in self.records)


def engine_of(dd: LLMDataDist) -> Any:
    """The native engine of an initialized instance (its counters, its UCX
    configuration), also after finalize."""
    rt = dd._rt
    assert rt is not None, "not initialized"
    return rt.engine
