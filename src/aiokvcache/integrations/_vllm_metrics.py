"""The vLLM connector's metrics, as vLLM carries and exports them: its
periodic "KV Transfer metrics" log line and its Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .agent.results import FAILURE_REASONS

__all__ = ["AioKVPromMetrics", "AioKVStats"]


def _empty_stats() -> dict[str, Any]:
    return {
        "transfer_duration": [],
        "bytes_transferred": [],
        "num_descriptors": [],
        "failures": dict.fromkeys(FAILURE_REASONS, 0),
        "num_kv_expired_reqs": 0,
        "calls": {},  # op -> status -> transfer calls
        "phases": {},  # op -> phase -> seconds summed over those calls
    }


def _merge(into: dict[str, dict[str, Any]], other: Any) -> None:
    """Add ``other``'s two-level counts (op -> name -> number) into ``into``."""
    for op, by_name in (other or {}).items():
        mine = into.setdefault(str(op), {})
        for name, n in by_name.items():
            mine[str(name)] = mine.get(str(name), 0) + n


@dataclass
class AioKVStats(KVConnectorStats):  # type: ignore[misc,unused-ignore]
    """One interval's transfers, as vLLM carries them from workers to its loggers.

    ``data``: one entry per successful load in ``transfer_duration`` (seconds,
    the engine's hand-over to the last byte), ``bytes_transferred`` and
    ``num_descriptors``; ``failures`` (reason -> count) and
    ``num_kv_expired_reqs`` (the prefill side's leases that ran out unread);
    ``calls`` (op -> status -> count) and ``phases`` (op -> phase -> seconds
    summed) of the transfer calls the loads and pushes made, from the records
    :mod:`aiokvcache.metrics` exports (bytes and descriptors come from them too).
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty_stats()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for key in ("transfer_duration", "bytes_transferred", "num_descriptors"):
            self.data[key].extend(o.get(key, ()))
        for reason, n in o.get("failures", {}).items():
            self.data["failures"][reason] = self.data["failures"].get(reason, 0) + int(n)
        self.data["num_kv_expired_reqs"] += int(o.get("num_kv_expired_reqs", 0))
        _merge(self.data.setdefault("calls", {}), o.get("calls"))
        _merge(self.data.setdefault("phases", {}), o.get("phases"))
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not (
            d["transfer_duration"]
            or any(d["failures"].values())
            or d["num_kv_expired_reqs"]
            or d.get("calls")
        )

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        times = sorted(d["transfer_duration"])
        n = len(times)
        mib = sum(d["bytes_transferred"]) / 2**20
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(sum(times) / n * 1e3, 3) if n else 0,
            "P90 xfer time (ms)": round(times[min(n - 1, int(0.9 * n))] * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(mib / n, 3) if n else 0,
            "Throughput (MB/s)": round(mib / sum(times), 3) if n and sum(times) > 0 else 0,
            "Avg number of descriptors": round(sum(d["num_descriptors"]) / n, 1) if n else 0,
            "Num failed transfers": sum(d["failures"].values()),
            "Num KV expired reqs": d["num_kv_expired_reqs"],
        }
        for reason, count in d["failures"].items():
            if count:
                out[f"Failed ({reason})"] = count
        for op, by_status in sorted(d.get("calls", {}).items()):
            calls = sum(by_status.values())
            out[f"{op} calls"] = calls
            for phase, seconds in d.get("phases", {}).get(op, {}).items():
                if calls:
                    out[f"Avg {op} {phase} (ms)"] = round(seconds / calls * 1e3, 3)
        return out


class AioKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,unused-ignore]
    """``vllm:aiokvcache_*`` series, made with the metric classes vLLM passes."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        # 100 µs to 60 s: a small shm load to a starved or slow peer.
        seconds = [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0]
        self._time = per_engine(
            self._histogram_cls(
                name="vllm:aiokvcache_xfer_time_seconds",
                documentation="aiokvcache KV loads: seconds from the engine's hand-over "
                "to the last byte (push: includes the prefill's compute).",
                buckets=seconds,
                labelnames=labelnames,
            )
        )
        self._bytes = per_engine(
            self._histogram_cls(
                name="vllm:aiokvcache_bytes_transferred",
                documentation="aiokvcache KV loads: bytes per load.",
                buckets=[2.0 ** (10 + 2 * i) for i in range(13)],  # 1 KiB .. 16 GiB
                labelnames=labelnames,
            )
        )
        self._descs = per_engine(
            self._histogram_cls(
                name="vllm:aiokvcache_num_descriptors",
                documentation="aiokvcache KV loads: contiguous block runs times tensors per load.",
                buckets=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536],
                labelnames=labelnames,
            )
        )
        failed = self._counter_cls(
            name="vllm:aiokvcache_num_failed_transfers",
            documentation="aiokvcache KV loads that failed, by reason: "
            + ", ".join(FAILURE_REASONS),
            labelnames=[*labelnames, "reason"],
        )
        self._failed = {
            i: {r: failed.labels(*v, r) for r in FAILURE_REASONS}
            for i, v in per_engine_labelvalues.items()
        }
        self._expired = per_engine(
            self._counter_cls(
                name="vllm:aiokvcache_num_kv_expired_reqs",
                documentation="Requests whose held KV blocks nobody read before their "
                "lease ran out (tracked on the prefill instance).",
                labelnames=labelnames,
            )
        )

        self._add_call_series(labelnames, per_engine_labelvalues)

    def _add_call_series(
        self, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> None:
        """The transfer calls the loads and pushes made, and their phase sums."""
        calls = self._counter_cls(
            name="vllm:aiokvcache_calls",
            documentation="aiokvcache transfer calls the connector's loads and pushes "
            "made, by op and status (aiokvcache.metrics' records).",
            labelnames=[*labelnames, "op", "status"],
        )
        phases = self._counter_cls(
            name="vllm:aiokvcache_call_phase_seconds",
            documentation="Seconds those calls spent in each phase (submitted, posted, "
            "done, seen), summed: divide by vllm:aiokvcache_calls for the mean.",
            labelnames=[*labelnames, "op", "phase"],
        )
        self._calls = {i: (calls, v) for i, v in per_engine_labelvalues.items()}
        self._phases = {i: (phases, v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for value in d.get("transfer_duration", ()):
            self._time[engine_idx].observe(value)
        for value in d.get("bytes_transferred", ()):
            self._bytes[engine_idx].observe(value)
        for value in d.get("num_descriptors", ()):
            self._descs[engine_idx].observe(value)
        failed = self._failed[engine_idx]
        for reason, count in d.get("failures", {}).items():
            if count and reason in failed:
                failed[reason].inc(count)
        if d.get("num_kv_expired_reqs"):
            self._expired[engine_idx].inc(d["num_kv_expired_reqs"])
        calls, values = self._calls[engine_idx]
        for op, by_status in d.get("calls", {}).items():
            for status, n in by_status.items():
                if n:
                    calls.labels(*values, op, status).inc(n)
        phases, values = self._phases[engine_idx]
        for op, by_phase in d.get("phases", {}).items():
            for phase, seconds in by_phase.items():
                if seconds > 0:
                    phases.labels(*values, op, phase).inc(seconds)
