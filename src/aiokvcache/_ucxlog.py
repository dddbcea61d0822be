"""UCX's own log lines, through the ``aiokvcache.ucx`` logger.

The native module installs a UCX log handler when it loads: UCX no longer
prints ``[...] UCX WARN ...`` lines to stderr itself; they wait in a bounded
native queue (256 lines) until :func:`drain` hands them to Python's logging,
where the application decides what to show. The library drains after an
engine starts (or fails to), on each completion wakeup that finds lines
waiting, and when an engine closes. ``UCX_LOG_LEVEL`` still chooses which
levels UCX emits at all (default: warnings and errors).
"""

from __future__ import annotations

import logging

from ._loader import native

__all__ = ["drain", "log"]

log = logging.getLogger("aiokvcache.ucx")

#: ucs_log_level_t -> logging level (fatal, error, warn, diag, info, debug...).
_LEVELS = (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO, logging.INFO)


#: UCX warnings that tell the application nothing it could act on, logged at
#: DEBUG: objects UCX still held when its worker was destroyed, which a
#: forced close leaves by design (the keys its purged requests named; the
#: memory goes with the worker). A peer process printed them on its way out,
#: after the test that froze it had ended.
_QUIET = ("was not returned to mpool",)


def drain() -> None:
    """Log every UCX line captured so far (cheap when there is none)."""
    if not native.ucx_log_pending():
        return
    lines, dropped = native.ucx_log_take()
    for level, component, where, text in lines:
        py_level = _LEVELS[level] if 0 <= level < len(_LEVELS) else logging.DEBUG
        if level != 0 and any(quiet in text for quiet in _QUIET):
            py_level = logging.DEBUG
        log.log(py_level, "%s: %s (%s)", component or "UCX", text, where)
    if dropped:
        log.warning("UCX: %d earlier log lines were dropped (queue full)", dropped)
