"""Transfer metrics and traces: which transfers, how long in each phase, between whom.

Off by default, and then free: a transfer pays one flag test. Turned on, every
public transfer call (``push_cache``, ``pull_cache``, ``push_blocks``,
``pull_blocks``, ``transfer_cache_async``, ``notify``) becomes one
:class:`TransferRecord`: op, peer cluster id, status, bytes, segments, jobs,
and the end of each phase (CLOCK_MONOTONIC ns):

============  ===========================================================
phase         ends when
============  ===========================================================
``submitted`` the call's first job group was handed to the native engine
              (checks, lookups at the peer, planning, the submit)
``posted``    the progress thread posted the last operation of its jobs
``done``      the last job's bytes were done (a put: flushed to the peer)
``seen``      the owner loop read that completion from the eventfd
============  ===========================================================

Exports:

* :func:`enable` registers a Prometheus collector (``pip install
  'aiokvcache[metrics]'``: ``prometheus_client``) with the default registry
  or the one you pass: ``aiokvcache_transfer_seconds`` and
  ``aiokvcache_transfer_phase_seconds`` histograms (buckets from 1 µs to
  10 s), per-peer call, byte and segment counters, link set-up times and the
  native engines' counters (``aiokvcache_engine_*``).
* With ``opentelemetry-api`` installed and a tracer provider set, one span
  per call (``aiokvcache.push_blocks`` ...), a child of the caller's current
  span, with an event per phase: :func:`enable` turns it on when a provider
  is set, :func:`enable_tracing` on its own.
* :func:`recent` the last records; :func:`snapshot` the aggregates as a dict;
  :func:`add_sink` your own callback per record.

Everything aggregates per process, over every ``LLMDataDist`` in it.
"""

from __future__ import annotations

import bisect
import collections
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from . import _telemetry
from ._telemetry import PHASES, TransferRecord, add_sink, remove_sink

__all__ = [
    "BUCKETS",
    "PHASES",
    "TransferRecord",
    "add_sink",
    "disable",
    "enable",
    "enable_tracing",
    "enabled",
    "recent",
    "remove_sink",
    "reset",
    "snapshot",
]

#: Histogram bucket bounds (seconds): 1 µs to 10 s, 1-2.5-5 steps.
BUCKETS: tuple[float, ...] = (
    *tuple(m * 10.0**e for e in range(-6, 1) for m in (1.0, 2.5, 5.0)),
    10.0,
)

#: Native engine counters that only grow (exported as Prometheus counters;
#: the rest of ``CacheManager.stats()`` are gauges).
_MONOTONIC = frozenset(
    {
        "jobs_submitted",
        "jobs_completed",
        "jobs_failed",
        "bytes_put",
        "bytes_get",
        "bytes_direct",
        "notifications_sent",
        "notifications_received",
        "notifications_dropped",
        "endpoint_errors",
        "inline_copies",
        "copy_faults",
        "dropped_tag_records",
        "dropped_notifications",
        "bad_notifications",
    }
)


class _Hist:
    """A fixed-bucket histogram (Prometheus' cumulative form on read)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one: over 10 s
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.sum += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip(BUCKETS, self.counts, strict=False):
            acc += n
            out.append((repr(bound), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile ``q`` (inf past 10 s)."""
        total = self.count
        if not total:
            return 0.0
        want, acc = q * total, 0
        for i, n in enumerate(self.counts):
            acc += n
            if acc >= want:
                return BUCKETS[i] if i < len(BUCKETS) else float("inf")
        return float("inf")


class _Aggregate:
    """What the collector and :func:`snapshot` read: the sink :func:`enable` adds.

    A call only appends its record (two deque appends: the hot path stays
    short); records are folded into the histograms and counters in batches,
    when 4096 are pending or someone reads (a scrape, :func:`snapshot`).
    """

    FOLD_AT = 4096

    def __init__(self, keep: int = 1024) -> None:
        self.lock = threading.Lock()
        self.recent: collections.deque[TransferRecord] = collections.deque(maxlen=keep)
        self.pending: collections.deque[TransferRecord] = collections.deque()
        self.calls: dict[tuple[str, int, str], int] = {}
        self.bytes: dict[tuple[str, int], int] = {}
        self.segments: dict[str, int] = {}
        self.seconds: dict[tuple[str, str], _Hist] = {}
        self.phases: dict[tuple[str, str], _Hist] = {}
        self.phase_hists: dict[str, list[_Hist]] = {}  # op -> its phases' (PHASES order)
        self.links: dict[str, _Hist] = {}

    def reset(self) -> None:
        with self.lock:
            for table in (self.recent, self.pending, self.calls, self.bytes, self.segments):
                table.clear()
            for hists in (self.seconds, self.phases, self.phase_hists, self.links):
                hists.clear()

    def __call__(self, rec: TransferRecord) -> None:
        self.recent.append(rec)
        pending = self.pending
        pending.append(rec)
        if len(pending) >= self.FOLD_AT:
            with self.lock:
                self.fold()

    def fold(self) -> None:
        """Fold the pending records in (under ``lock``): the histograms'
        buckets found with one bisect each, the phases without a dict."""
        pending = self.pending
        calls, nbytes, segments = self.calls, self.bytes, self.segments
        seconds, per_op = self.seconds, self.phase_hists
        find = bisect.bisect_left
        bounds = BUCKETS
        while pending:
            try:
                rec = pending.popleft()
            except IndexError:  # another thread took the last one
                break
            op = rec.op
            key = (op, rec.peer, rec.status)
            calls[key] = calls.get(key, 0) + 1
            bk = (op, rec.peer)
            nbytes[bk] = nbytes.get(bk, 0) + rec.nbytes
            segments[op] = segments.get(op, 0) + rec.segments
            hk = (op, rec.status)
            h = seconds.get(hk)
            if h is None:
                h = seconds[hk] = _Hist()
            v = (rec.ended_ns - rec.began_ns) * 1e-9
            h.counts[find(bounds, v)] += 1
            h.sum += v
            hists = per_op.get(op)
            if hists is None:
                hists = per_op[op] = [self._hist(self.phases, (op, n)) for n in PHASES]
            prev = rec.began_ns
            for h, at in zip(
                hists, (rec.submitted_ns, rec.posted_ns, rec.done_ns, rec.seen_ns), strict=True
            ):
                if not at:
                    break
                if at > prev:
                    v = (at - prev) * 1e-9
                    prev = at
                else:
                    v = 0.0
                h.counts[find(bounds, v)] += 1
                h.sum += v

    @staticmethod
    def _hist(table: dict[Any, _Hist], key: Any) -> _Hist:
        h = table.get(key)
        if h is None:
            h = table[key] = _Hist()
        return h

    def link(self, peer: int, status: str, seconds: float) -> None:
        with self.lock:
            self._hist(self.links, status).observe(seconds)


_agg = _Aggregate()
_registered: weakref.WeakSet[Any] = weakref.WeakSet()
_collector: Any = None
_tracer: Any = None


def enabled() -> bool:
    """True while any record sink is on (this module's or yours; not the
    vLLM connector's own, which records for its figures alone)."""
    return _telemetry.visible()


def _link_observer(peer: int, status: str, seconds: float) -> None:
    _agg.link(peer, status, seconds)


def enable(registry: Any = None, *, prometheus: bool = True, tracing: bool | None = None) -> None:
    """Record every transfer call from now on.

    ``prometheus``: register the collector with ``registry`` (default:
    ``prometheus_client.REGISTRY``; once per registry); needs
    ``prometheus_client`` (ImportError otherwise, and nothing is turned on).
    ``tracing``: None: spans when ``opentelemetry`` is imported and a tracer
    provider is set; True: spans through whatever provider is set (none set:
    OpenTelemetry's no-op); False: no spans.
    """
    if prometheus:
        from prometheus_client import REGISTRY  # the extra: a clear ImportError

        reg = REGISTRY if registry is None else registry
        if reg not in _registered:
            reg.register(_get_collector())
            _registered.add(reg)
    if tracing or (tracing is None and _tracer_provider_set()):
        enable_tracing()
    _telemetry.link_observer = _link_observer
    add_sink(_agg)


def disable() -> None:
    """Stop recording (this module's sinks; yours stay). Registered collectors
    stay registered and keep what was recorded."""
    remove_sink(_agg)
    remove_sink(_span)
    _telemetry.link_observer = None


def reset() -> None:
    """Forget every aggregate and recent record (counters restart at 0)."""
    _agg.reset()


def recent(n: int | None = None) -> list[TransferRecord]:
    """The last ``n`` (default all kept: 1024) records, oldest first."""
    items = list(_agg.recent)
    return items if n is None else items[-n:]


def snapshot() -> dict[str, Any]:
    """The aggregates: per op, calls and bytes by peer and status, and for the
    whole call and each phase the count, sum and bucket-bound p50/p99 (s)."""
    out: dict[str, Any] = {}
    with _agg.lock:
        _agg.fold()
        for (op, peer, status), n in _agg.calls.items():
            d = out.setdefault(op, {"calls": {}, "bytes": {}, "seconds": {}, "phases": {}})
            d["calls"][(peer, status)] = n
        for (op, peer), n in _agg.bytes.items():
            out[op]["bytes"][peer] = n
        for (op, status), h in _agg.seconds.items():
            out[op]["seconds"][status] = _summary(h)
        for (op, name), h in _agg.phases.items():
            out[op]["phases"][name] = _summary(h)
        out["_links"] = {status: _summary(h) for status, h in _agg.links.items()}
    return out


def _summary(h: _Hist) -> dict[str, float]:
    return {"count": h.count, "sum": h.sum, "p50": h.quantile(0.5), "p99": h.quantile(0.99)}


# ------------------------------------------------------------- Prometheus


def _get_collector() -> Any:
    global _collector
    if _collector is None:
        _collector = _Collector()
    return _collector


class _Collector:
    """The ``aiokvcache_*`` series, read from the aggregate and the live engines."""

    def describe(self) -> list[Any]:
        return []  # collected on scrape only

    def collect(self) -> Iterator[Any]:
        yield from _transfer_families()
        yield from _engine_families()


def _transfer_families() -> list[Any]:
    """The per-call series, folded from the aggregate."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    seconds = HistogramMetricFamily(
        "aiokvcache_transfer_seconds",
        "Transfer calls, start to return, by op and status",
        labels=["op", "status"],
    )
    phases = HistogramMetricFamily(
        "aiokvcache_transfer_phase_seconds",
        "Time in each phase of a transfer call (submitted, posted, done, seen)",
        labels=["op", "phase"],
    )
    links = HistogramMetricFamily(
        "aiokvcache_link_setup_seconds",
        "Link set-up (handshake, UCX wire-up, data-path probe), by status",
        labels=["status"],
    )
    calls = CounterMetricFamily(
        "aiokvcache_transfers", "Transfer calls", labels=["op", "peer", "status"]
    )
    nbytes = CounterMetricFamily(
        "aiokvcache_transfer_bytes", "Bytes moved by transfer calls", labels=["op", "peer"]
    )
    segs = CounterMetricFamily(
        "aiokvcache_transfer_segments",
        "Segments (descriptors) transfer calls carried",
        labels=["op"],
    )
    with _agg.lock:
        _agg.fold()
        for (op, status), h in _agg.seconds.items():
            seconds.add_metric([op, status], h.cumulative(), h.sum)
        for (op, name), h in _agg.phases.items():
            phases.add_metric([op, name], h.cumulative(), h.sum)
        for status, h in _agg.links.items():
            links.add_metric([status], h.cumulative(), h.sum)
        for (op, peer, status), n in _agg.calls.items():
            calls.add_metric([op, str(peer), status], n)
        for (op, peer), n in _agg.bytes.items():
            nbytes.add_metric([op, str(peer)], n)
        for op, n in _agg.segments.items():
            segs.add_metric([op], n)
    return [seconds, phases, links, calls, nbytes, segs]


def _engine_families() -> Iterator[Any]:
    """``CacheManager.stats()`` of every live instance, labelled by cluster id."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    engines: dict[str, Any] = {}
    for rt in list(_telemetry.runtimes):
        try:
            stats = rt.stats()
        except Exception:  # finalized meanwhile
            continue
        cid = str(rt.state.cluster_id)
        for name, value in stats.items():
            fam = engines.get(name)
            if fam is None:
                kind = CounterMetricFamily if name in _MONOTONIC else GaugeMetricFamily
                fam = engines[name] = kind(
                    f"aiokvcache_engine_{name}",
                    f"CacheManager.stats()['{name}']",
                    labels=["cluster_id"],
                )
            fam.add_metric([cid], value)
    yield from engines.values()


# ---------------------------------------------------------- OpenTelemetry


def _tracer_provider_set() -> bool:
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")


def enable_tracing() -> None:
    """One OpenTelemetry span per transfer call, through the global tracer
    provider (ImportError without ``opentelemetry-api``)."""
    global _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer("aiokvcache")
    add_sink(_span)


def _span(rec: TransferRecord) -> None:
    # Made when the call ends, in the caller's context: the caller's current
    # span is its parent. Monotonic stamps become wall-clock ones.
    from opentelemetry.trace import Status, StatusCode

    shift = time.time_ns() - time.monotonic_ns()
    span = _tracer.start_span(
        f"aiokvcache.{rec.op}",
        start_time=rec.began_ns + shift,
        attributes={
            "aiokvcache.peer": rec.peer,
            "aiokvcache.status": rec.status,
            "aiokvcache.bytes": rec.nbytes,
            "aiokvcache.segments": rec.segments,
            "aiokvcache.jobs": rec.jobs,
        },
    )
    for name, at in zip(
        PHASES, (rec.submitted_ns, rec.posted_ns, rec.done_ns, rec.seen_ns), strict=True
    ):
        if at:
            span.add_event(name, timestamp=at + shift)
    if rec.status != "ok":
        span.set_status(Status(StatusCode.ERROR, rec.status))
    span.end(end_time=rec.ended_ns + shift)
