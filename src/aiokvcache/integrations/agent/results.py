"""What the vLLM connector's transfers report to the engine's thread: the
requests that ended and the loads' metrics, behind one lock."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

from ...metrics import PHASES, TransferRecord

__all__ = ["FAILURE_REASONS", "Results", "TransferResults"]

#: Load failures by reason (the keys of :meth:`Results.take_metrics`).
FAILURE_REASONS = ("timeout", "refused", "link", "prefill", "layout", "aborted", "other")


@dataclass
class TransferResults:
    """One snapshot of what ended since the last one."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class _Metrics:
    """What :meth:`Results.take_metrics` hands out (since its last call)."""

    seconds: list[float] = field(default_factory=list)  # one entry per load
    bytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    leases_expired: int = 0
    #: op -> status -> transfer calls (from aiokvcache's records, see .calls)
    calls: dict[str, collections.Counter[str]] = field(default_factory=dict)
    #: op -> phase -> seconds summed over those calls
    phases: dict[str, dict[str, float]] = field(default_factory=dict)


class Results:
    """Filled on the agent's loop thread, swapped out by the engine's thread:
    each swap replaces the sets with empty ones under the lock (no loop round
    trip, nothing polled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results = TransferResults()
        self._metrics = _Metrics()

    def take(self) -> TransferResults:
        """What ended since the last call."""
        with self._lock:
            out, self._results = self._results, TransferResults()
        return out

    def take_metrics(self) -> dict[str, Any]:
        """What happened since the last call (see ``TransferAgent.take_metrics``)."""
        with self._lock:
            m, self._metrics = self._metrics, _Metrics()
        return {
            "seconds": m.seconds,
            "bytes": m.bytes,
            "descriptors": m.descriptors,
            "failures": dict(m.failures),
            "leases_expired": m.leases_expired,
            "calls": {op: dict(c) for op, c in m.calls.items()},
            "phases": m.phases,
        }

    def called(self, rec: TransferRecord) -> None:
        """P and D: one transfer call of a load or push ended (its record)."""
        phases = rec.phases()
        with self._lock:
            m = self._metrics
            by_status = m.calls.get(rec.op)
            if by_status is None:
                by_status = m.calls[rec.op] = collections.Counter()
                m.phases[rec.op] = dict.fromkeys(PHASES, 0.0)
            by_status[rec.status] += 1
            sums = m.phases[rec.op]
            for name, seconds in phases.items():
                sums[name] += seconds

    def sent(self, rid: str) -> None:
        """P: request ``rid``'s blocks may go back to the engine."""
        with self._lock:
            self._results.finished_sending.add(rid)

    def loaded(self, rid: str, seconds: float, nbytes: int, descriptors: int) -> None:
        """D: request ``rid`` loaded in ``seconds``; ``nbytes`` and ``descriptors``
        (segments) are what its transfer calls' records say they moved."""
        with self._lock:
            self._results.finished_recving.add(rid)
            m = self._metrics
            m.seconds.append(seconds)
            m.bytes.append(nbytes)
            m.descriptors.append(descriptors)

    def failed(self, rid: str, local_ids: list[int], reason: str) -> None:
        """D: request ``rid``'s load ended without its KV (``"aborted"``: the
        engine gave it up; else ``local_ids`` hold no valid KV)."""
        with self._lock:
            self._metrics.failures[reason] += 1
            if reason != "aborted":
                self._results.failed_recving.add(rid)
                self._results.invalid_block_ids.update(local_ids)
            self._results.finished_recving.add(rid)

    def leases_expired(self, n: int) -> None:
        """P: ``n`` more held requests were released unread."""
        with self._lock:
            self._metrics.leases_expired += n
