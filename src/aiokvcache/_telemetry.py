"""Per-call transfer timing, the one source :mod:`aiokvcache.metrics` exports.

Off (the default, no sink registered) a transfer pays one module-attribute
test at its start and one per job group: nothing is timed, nothing is kept.
On, each public transfer call (``push_cache``, ``pull_blocks``, ...,
``transfer_cache_async``, ``notify``) becomes one :class:`TransferRecord`
handed to every sink when the call ends:

* ``began_ns``     the call started (its arguments are checked after this);
* ``submitted_ns`` its first job group was handed to the native engine
  (checked, looked up at the peer, planned);
* ``posted_ns``    the progress thread posted the last operation of its jobs;
* ``done_ns``      the last job's bytes were done (a put: flushed to the peer)
  and its completion queued;
* ``seen_ns``      the owner loop read that completion from the eventfd;
* ``ended_ns``     the call returned or raised.

The native engine stamps ``posted_ns``/``done_ns`` on every job with
CLOCK_MONOTONIC, the clock :func:`time.monotonic_ns` reads, so the phases
line up across threads. A call that needs no job (a same-host copy done on
the caller's thread, a failed check) has no ``submitted_ns`` etc.: 0.

The call is found through a context variable set only while a sink is on:
the runner's hooks read it, and a call's layer tasks (copies of its context)
add to the same record.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from time import monotonic_ns
from typing import Any, TypeVar

__all__ = [
    "PHASES",
    "TransferRecord",
    "add_sink",
    "copied",
    "ended",
    "measure",
    "remove_sink",
    "restart",
    "submitted",
]

log = logging.getLogger("aiokvcache")

T = TypeVar("T")

#: The phases of a call, each named by the event that ends it (see the module).
PHASES: tuple[str, ...] = ("submitted", "posted", "done", "seen")

#: True while at least one sink is registered: the hot path's only test.
active: bool = False

_sinks: list[Callable[[TransferRecord], None]] = []
#: Sinks the library registers for itself (the vLLM connector's): they turn
#: recording on but are not what :func:`aiokvcache.metrics.enabled` reports.
_internal: list[Callable[[TransferRecord], None]] = []

#: Called with (peer cluster id, status, seconds) after each link set-up
#: this process started, while metrics are on.
link_observer: Callable[[int, str, float], None] | None = None

#: The live runtimes (one per initialized LLMDataDist): their engines'
#: counters are exported on scrape.
runtimes: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_call: contextvars.ContextVar[TransferRecord | None] = contextvars.ContextVar(
    "aiokvcache_call", default=None
)


@dataclass(slots=True, eq=False)
class TransferRecord:
    """One transfer call: what it was, with whom, how it ended, and when each
    phase ended (CLOCK_MONOTONIC ns; 0: never reached)."""

    op: str
    peer: int  # the peer's cluster id (-1: several or none)
    #: "ok", "cancelled", the LLM status without LLM_ in lower case
    #: ("timeout", "link_failed", ...), or "error" (any other exception).
    status: str = "ok"
    nbytes: int = 0  # bytes the jobs moved
    segments: int = 0  # segments (descriptors) the jobs carried
    jobs: int = 0
    began_ns: int = 0
    submitted_ns: int = 0
    posted_ns: int = 0
    done_ns: int = 0
    seen_ns: int = 0
    ended_ns: int = 0

    @property
    def seconds(self) -> float:
        """The whole call."""
        return (self.ended_ns - self.began_ns) / 1e9

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase it reached, in order; a phase whose end
        was never stamped is left out."""
        out: dict[str, float] = {}
        prev = self.began_ns
        for name, at in zip(
            PHASES, (self.submitted_ns, self.posted_ns, self.done_ns, self.seen_ns), strict=True
        ):
            if not at:
                break
            out[name] = max(0, at - prev) / 1e9
            prev = max(prev, at)
        return out


def add_sink(sink: Callable[[TransferRecord], None], internal: bool = False) -> None:
    """Call ``sink(record)`` at the end of every transfer call from now on
    (on the caller's loop, in the caller's context: keep it short).
    ``internal``: the library's own, left out of :func:`visible`."""
    global active
    with _lock:
        if sink not in _sinks:
            _sinks.append(sink)
            if internal:
                _internal.append(sink)
        active = True


def remove_sink(sink: Callable[[TransferRecord], None]) -> None:
    """Stop calling ``sink``; with none left the hot path is untimed again."""
    global active
    with _lock:
        if sink in _sinks:
            _sinks.remove(sink)
        if sink in _internal:
            _internal.remove(sink)
        active = bool(_sinks)


def visible() -> bool:
    """A sink other than the library's own is on (``metrics.enabled()``)."""
    with _lock:
        return len(_sinks) > len(_internal)


def _status(exc: BaseException) -> str:
    code = getattr(exc, "status_code", None)
    if code is not None:
        return str(code.name).removeprefix("LLM_").lower()
    if type(exc).__name__ in ("CancelledError", "Cancelled"):
        return "cancelled"
    return "error"


def _emit(rec: TransferRecord) -> None:
    for sink in tuple(_sinks):
        try:
            sink(rec)
        except Exception:  # a sink's bug must not fail the transfer
            log.exception("aiokvcache: metrics sink %r failed", sink)


async def measure(
    op: str,
    peer: int,
    coro: Coroutine[Any, Any, T],
    outcome: Callable[[], BaseException | None] | None = None,
) -> T:
    """Await ``coro`` (one public call) as one :class:`TransferRecord`.

    ``outcome``: for a call that reports its failure without raising (a
    ``transfer_cache_async`` task keeps its error for ``synchronize()``),
    read after ``coro`` returned: the error it ended with, or None.
    """
    rec = TransferRecord(op, peer, began_ns=monotonic_ns())
    token = _call.set(rec)
    try:
        result = await coro
        failed = outcome() if outcome is not None else None
        if failed is not None:
            rec.status = _status(failed)
        return result
    except BaseException as exc:
        rec.status = _status(exc)
        raise
    finally:
        _call.reset(token)
        rec.ended_ns = monotonic_ns()
        _emit(rec)


def restart() -> None:
    """The current call starts over (``push_blocks`` by key asking the peer
    again after its recorded cache went): what the first attempt did is not
    what the call moved."""
    rec = _call.get()
    if rec is None:
        return
    rec.nbytes = rec.segments = rec.jobs = 0
    rec.submitted_ns = rec.posted_ns = rec.done_ns = rec.seen_ns = 0


def submitted(jobs: Sequence[tuple[Any, ...]]) -> None:
    """A job group of the current call is being handed to the engine (runner hook)."""
    rec = _call.get()
    if rec is None:
        return
    if not rec.submitted_ns:
        rec.submitted_ns = monotonic_ns()
    rec.jobs += len(jobs)
    rec.segments += sum(len(job[2]) for job in jobs)


def ended(results: Sequence[Any], seen_ns: int) -> None:
    """A job group of the current call ended (runner hook): its bytes and the
    native stamps of its last job."""
    rec = _call.get()
    if rec is None:
        return
    for r in results:
        if r is None:
            continue
        rec.nbytes += r.nbytes
        if r.posted_ns > rec.posted_ns:
            rec.posted_ns = r.posted_ns
        if r.done_ns > rec.done_ns:
            rec.done_ns = r.done_ns
    if seen_ns > rec.seen_ns:
        rec.seen_ns = seen_ns


def copied(began_ns: int, nbytes: int, segments: int) -> None:
    """The current call copied its bytes on its own thread (same-host, into
    mapped memory), from ``began_ns`` to now: no job; that copy is its
    "done" phase, and nothing is left to post or see."""
    rec = _call.get()
    if rec is None:
        return
    now = monotonic_ns()
    rec.nbytes += nbytes
    rec.segments += segments
    rec.submitted_ns = rec.posted_ns = rec.submitted_ns or began_ns
    rec.done_ns = rec.seen_ns = now
