"""Layer-wise pipelining: the :class:`CacheTask` that ``transfer_cache_async`` returns.

``await cm.transfer_cache_async(...)`` checks every argument and resolves
every destination first, so bad input raises there and nothing moves; then
one task walks the source layers, submitting layer *i* to every config that
includes it as soon as the layer synchronizer says it is ready, while the
caller computes layer *i + 1*. The pipeline itself lives in the private
core (``aiokvcache._core.transfer.layerwise``) and shares the planner and runner of
every other transfer.
"""

from __future__ import annotations

from ._core.transfer.layerwise import CacheTask

__all__ = ["CacheTask"]
