"""The connector's transfer calls, counted from aiokvcache's own per-call
records (:mod:`aiokvcache.metrics`' source), not recomputed beside them.

While an agent runs, one process-wide metrics sink is on. A load (D) or a
push transfer (P) runs its calls inside :func:`counting` with its own
:class:`Tally`: the sink is called in the calling task's context, so each
record lands in the tally of the load or push that made it (two agents in one
process never mix: each task sees only its own). What a tally gathered (bytes
and segments moved) is what the connector reports for that request; each
record's phases go to the agent's interval metrics as well.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator

from ... import _telemetry, metrics

__all__ = ["Tally", "attach", "counting", "detach"]

#: Calls that move KV bytes (``notify`` carries a tag, not KV).
MOVES = frozenset({"push_cache", "pull_cache", "push_blocks", "pull_blocks"})

_current: contextvars.ContextVar[Tally | None] = contextvars.ContextVar(
    "aiokvcache_vllm_tally", default=None
)
_lock = threading.Lock()
_agents = 0


class Tally:
    """What one load or push transfer's calls moved, from their records."""

    __slots__ = ("nbytes", "on_call", "segments")

    def __init__(self, on_call: Callable[[metrics.TransferRecord], None]) -> None:
        self.nbytes = 0
        self.segments = 0
        self.on_call = on_call  # every record, for the interval's phase metrics

    def add(self, rec: metrics.TransferRecord) -> None:
        if rec.op in MOVES:
            self.nbytes += rec.nbytes
            self.segments += rec.segments
        self.on_call(rec)


def current() -> Tally | None:
    """The tally of the load or push the calling task runs for, if any."""
    return _current.get()


@contextlib.contextmanager
def counting(tally: Tally) -> Iterator[Tally]:
    """Transfer calls made in this block (and in tasks it starts) count in ``tally``."""
    token = _current.set(tally)
    try:
        yield tally
    finally:
        _current.reset(token)


def _on_record(rec: metrics.TransferRecord) -> None:
    tally = _current.get()
    if tally is not None:
        tally.add(rec)


def attach() -> None:
    """An agent starts: records are made from now on (one sink for all agents)."""
    global _agents
    with _lock:
        _agents += 1
        if _agents == 1:
            _telemetry.add_sink(_on_record, internal=True)  # not metrics.enabled()


def detach() -> None:
    """An agent stopped; the last one turns the sink off."""
    global _agents
    with _lock:
        _agents = max(0, _agents - 1)
        if _agents == 0:
            _telemetry.remove_sink(_on_record)
