"""The one transfer runner: leases, native deadlines, cancel-and-settle, error mapping.

Every transfer — ``push_*``, ``pull_*`` and each layer of
``transfer_cache_async`` — goes through :meth:`Runner.start` (submit the jobs
and lease the caches they touch, in one critical section of the state lock)
and :meth:`Runner.finish` (await the group through the bridge, map native
statuses to LLM-DataDist errors, give the leases back). The bridge has
already made the group quiescent when it returns or raises.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ... import _telemetry
from ..._bridge import Bridge, BridgeError, GroupFailed, JobGroup, JobResult, Jobs
from ..._loader import native
from ..memory.state import Lease, LocalCache, RemoteCache, State
from ..model.errors import InternalError, LLMException, LLMStatusCode, landed_text, make_error

__all__ = [
    "STATUS_CODE",
    "Runner",
    "check_timeout",
    "engine_finalized",
    "failure",
    "run_jobs",
    "status_code",
    "time_left",
]

#: Native job status -> the LLM-DataDist code it stands for, from the engine's table.
STATUS_CODE: dict[int, LLMStatusCode] = {
    value: LLMStatusCode[llm] for value, _name, _words, llm in native.STATUSES
}


def status_code(status: int) -> LLMStatusCode:
    """Map a native job status to the LLM-DataDist status code it stands for."""
    return STATUS_CODE.get(status, LLMStatusCode.LLM_FAILED)


#: Longer timeouts are no limit at all (None): past this the native
#: deadline's clock arithmetic would overflow, and no transfer waits a century.
MAX_TIMEOUT_S = 1e9


def check_timeout(timeout: Any) -> float | None:
    """A whole-call ``timeout=`` in seconds: None (or ``inf``: no limit), or a
    positive number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    value = float(timeout)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return None if value >= MAX_TIMEOUT_S else value


class TimeLeft(float):
    """What is left of a call's ``timeout=`` (seconds), knowing the whole of it
    (``whole``): a timeout's message names the call's, not what was left."""

    whole: float


def time_left(timeout: float | None, start: float, clock: Callable[[], float]) -> float | None:
    """What is left of ``timeout`` (seconds) since loop time ``start`` by the
    loop's ``clock`` (read only when there is a timeout); never 0."""
    if timeout is None:
        return None
    left = TimeLeft(max(timeout - (clock() - start), 1e-6))
    left.whole = getattr(timeout, "whole", timeout)
    return left


def _deadline(group: JobGroup, *, timed_out: bool) -> tuple[str, str]:
    """Which deadline ended ``group`` (its ``LLMException.deadline``) and how a
    message says so. A job's native deadline is the earlier of its own
    (sync_kv_timeout) and the call's ``timeout=`` (Bridge.submit_group)."""
    call, own_ms = group.call_timeout, group.job_timeout_ms
    # What the jobs were given of the call's timeout (what was left of it
    # after a look-up), against their own: the smaller fired.
    left_ms = group.call_left_ms or (0 if call is None else call * 1000)
    if call is not None and (timed_out or own_ms <= 0 or left_ms <= own_ms):
        return f"timeout={call:g} s", f"the call's timeout={call:g} s passed"
    whole = "" if call is None else f" (the call's timeout={call:g} s had not)"
    return (
        f"sync_kv_timeout={own_ms} ms",
        f"its sync_kv_timeout of {own_ms} ms per layer job passed{whole}",
    )


def _layers(names: Sequence[str], indices: Iterable[int]) -> frozenset[int] | None:
    """The layer numbers of jobs labelled ``"layer N"`` (None: not layer jobs)."""
    layers = set()
    for i in indices:
        head, _, number = names[i].partition(" ")
        if head != "layer" or not number.isdigit():
            return None
        layers.add(int(number))
    return frozenset(layers)


def failure(group: JobGroup, labels: Sequence[str] | None, *, timed_out: bool) -> LLMException:
    """The error a failed group raises: the root cause (naming the deadline,
    when one ended it), then what landed (also as ``exc.landed``)."""
    names = list(labels) if labels is not None else [f"job {i}" for i in range(len(group.results))]
    ok = [i for i, r in enumerate(group.results) if r is not None and r.ok]
    failed = [(names[i], r) for i, r in enumerate(group.results) if r is not None and not r.ok]
    # The root cause first: a timeout or link failure, not the jobs we
    # cancelled because of it.
    failed.sort(key=lambda item: item[1].status == native.ST_CANCELLED)
    deadline = None
    if timed_out or (failed and failed[0][1].status == native.ST_TIMEOUT):
        code = LLMStatusCode.LLM_TIMEOUT
        deadline, why = _deadline(group, timed_out=timed_out)
        reason = f"timed out: {why}" if timed_out else f"{failed[0][0]} timed out: {why}"
    elif failed:
        code = status_code(failed[0][1].status)
        reason = f"{failed[0][0]} failed: {failed[0][1].describe()}"
    else:  # pragma: no cover - a failure without a failed job
        code = LLMStatusCode.LLM_FAILED
        reason = "failed"
    landed = _layers(names, range(len(names)))
    if landed is not None:
        landed = _layers(names, ok)
        what = landed_text(landed)
    else:
        what = ", ".join(names[i] for i in ok) or "none"
    exc = make_error(code, f"{reason}; landed: {what}")
    exc.results = list(group.results)
    exc.landed, exc.deadline = landed, deadline
    return exc


def engine_finalized() -> LLMException:
    """What a transfer raises when the native engine is already closed."""
    return make_error(LLMStatusCode.LLM_ENGINE_FINALIZED, "the engine is finalized")


def _submit(bridge: Bridge, jobs: Jobs, timeout: float | None, checked: bool = False) -> JobGroup:
    if _telemetry.active:  # stamped as the jobs go: the progress thread may post at once
        _telemetry.submitted(jobs)
    try:
        return bridge.submit_group(jobs, timeout=timeout, checked=checked)
    except native.EngineClosedError as exc:
        raise engine_finalized() from exc


async def _wait(bridge: Bridge, group: JobGroup, labels: Sequence[str] | None) -> list[JobResult]:
    try:
        return await bridge.wait(group)
    except GroupFailed as exc:
        raise failure(exc.group, labels, timed_out=exc.timed_out) from None
    except BridgeError as exc:
        raise InternalError(str(exc)) from exc
    finally:
        if _telemetry.active:
            _telemetry.ended(group.results, group.seen_ns)


async def run_jobs(
    bridge: Bridge,
    jobs: Jobs,
    *,
    timeout: float | None = None,
    labels: Sequence[str] | None = None,
) -> list[JobResult]:
    """Submit jobs as one group and await them, with LLM-DataDist errors.

    Raises an :class:`LLMException` naming the jobs that landed when one
    fails (its ``results`` attribute lists each job's result),
    :class:`LLMTimeoutError` when ``timeout`` (seconds, whole group, a native
    deadline) passes, and re-raises cancellation; always after every job is
    released. No cache leases: this is the engine-level path.
    """
    return await _wait(bridge, _submit(bridge, jobs, timeout), labels)


class Runner:
    """Runs job groups on caches, holding a lease on each cache while jobs live."""

    __slots__ = ("_bridge", "_leases", "_state")

    def __init__(self, state: State, bridge: Bridge) -> None:
        self._state = state
        self._bridge = bridge
        self._leases: dict[int, Lease] = {}  # id(group) -> its lease

    @property
    def bridge(self) -> Bridge:
        """The owner loop's bridge."""
        return self._bridge

    def start(
        self,
        jobs: Jobs,
        timeout: float | None,
        local: LocalCache,
        remotes: Iterable[RemoteCache],
        checked: bool = False,
    ) -> JobGroup:
        """Submit ``jobs`` under a lease on ``local`` and ``remotes``
        (``checked``: built from a checked plan, see Bridge.submit_group).

        Refuses with KV_CACHE_NOT_EXIST when one of the caches was retired
        meanwhile (:meth:`.state.State.lease`: the check and the submit share
        one critical section). Give the lease back with :meth:`release`.
        """
        made: list[JobGroup] = []

        def submit() -> list[int]:
            group = _submit(self._bridge, jobs, timeout, checked)
            made.append(group)
            return group.job_ids

        lease = self._state.lease((local, *remotes), submit, frozenset(j[1] for j in jobs))
        group = made[0]
        if lease.jobs:
            self._leases[id(group)] = lease
        return group

    async def finish(
        self,
        group: JobGroup,
        labels: Sequence[str] | None,
        local: LocalCache,
        remotes: Iterable[RemoteCache],
    ) -> None:
        """Await ``group``; map its failure; give the lease back (always)."""
        try:
            await _wait(self._bridge, group, labels)
        except LLMException as exc:
            raise self.explain(exc, local, list(remotes)) from exc
        finally:
            self.release(group)

    async def run(
        self,
        jobs: Jobs,
        labels: Sequence[str],
        timeout: float | None,
        local: LocalCache,
        remote: RemoteCache,
        checked: bool = False,
    ) -> None:
        """:meth:`start` then :meth:`finish`: the whole call's path."""
        group = self.start(jobs, timeout, local, (remote,), checked)
        await self.finish(group, labels, local, (remote,))

    async def wait(self, group: JobGroup, labels: Sequence[str] | None) -> list[JobResult]:
        """Await ``group`` (LLM-DataDist errors, no lease bookkeeping)."""
        return await _wait(self._bridge, group, labels)

    def release(self, group: JobGroup) -> None:
        """Give back the lease of ``group`` (every job of it released by now)."""
        lease = self._leases.pop(id(group), None)
        if lease is not None:
            self._state.end_lease(lease)

    @staticmethod
    def explain(
        exc: LLMException, local: LocalCache, remotes: Sequence[RemoteCache]
    ) -> LLMException:
        """Jobs cancelled because a cache went away, or refused because its key
        was released meanwhile, read as KV_CACHE_NOT_EXIST."""
        code = exc.status_code
        if code not in (LLMStatusCode.LLM_FAILED, LLMStatusCode.LLM_PARAM_INVALID):
            return exc
        if any(not rc.valid for rc in remotes):
            why = "the remote cache was deallocated during the transfer"
        elif not local.valid:
            why = "the local cache was deallocated during the transfer"
        elif code == LLMStatusCode.LLM_PARAM_INVALID:
            why = "destination cache went away:"
        else:
            return exc
        sep = " " if why.endswith(":") else "; "
        gone = make_error(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"{why}{sep}{exc.message}")
        gone.results, gone.landed, gone.deadline = exc.results, exc.landed, exc.deadline
        return gone
