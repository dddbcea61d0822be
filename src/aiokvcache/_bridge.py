"""The event-loop side of the native completion queue.

The native progress thread never touches Python. It pushes completions into a
queue and bumps one eventfd; :class:`Bridge` watches that eventfd with
``loop.add_reader``, drains everything, and resolves futures on the loop's own
thread. A group of jobs (one per layer of a push) is awaited as one unit:

* it returns when every job has completed successfully;
* on the first failure, cancellation or timeout it cancels the rest natively,
  waits until the engine has *released* every job (nothing in flight, nothing
  can be written any more), and only then raises.

The bridge speaks native statuses only: a failed group raises
:class:`GroupFailed` carrying every job's :class:`JobResult`; the core's
runner turns that into LLM-DataDist's errors. It knows nothing above it.

The loop is asyncio or trio: the bridge watches the eventfd, makes its
waiters and waits out a release through the instance's
:class:`~._loopside.LoopSide` (under asyncio: ``add_reader`` and asyncio
futures, as always).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic_ns
from typing import Any, NamedTuple

import numpy as np

from . import _loopside, _telemetry, _ucxlog
from ._loader import native
from ._loopside import LoopSide, Waiter

__all__ = ["Bridge", "BridgeError", "GroupFailed", "JobGroup", "JobResult", "Jobs"]

log = logging.getLogger("aiokvcache")

OP_PUT: int = native.OP_PUT
OP_GET: int = native.OP_GET
ST_OK: int = native.ST_OK
KIND_JOB: int = native.KIND_JOB
KIND_NOTIFY: int = native.KIND_NOTIFY
KIND_ENDPOINT: int = native.KIND_ENDPOINT

#: Human words per native status, from the engine's own status table.
WORDS: dict[int, str] = {value: words for value, _name, words, _llm in native.STATUSES}

#: One job as the engine takes it: (op, endpoint id, segments, payload,
#: timeout_ms), optionally followed by its retirement guard (rkey id, address,
#: expected word) or None (see ext/job.hpp).
Job = tuple[Any, ...]
Jobs = Sequence[Job]


class JobResult(NamedTuple):
    """How one native job ended (a tuple: built once per job, on the hot path)."""

    job_id: int
    status: int
    ucs_status: int
    nbytes: int
    #: When the engine posted the job's last operation and when it reported
    #: the job (CLOCK_MONOTONIC ns, as time.monotonic_ns(); 0: never posted).
    posted_ns: int = 0
    done_ns: int = 0

    @property
    def ok(self) -> bool:
        """True when the job moved all its bytes (and, for a put, they landed)."""
        return self.status == ST_OK

    def describe(self) -> str:
        """A short human-readable reason."""
        text = WORDS.get(self.status, f"status {self.status}")
        if self.ucs_status:
            text += f" ({native.ucs_status_string(self.ucs_status)})"
        return text


@dataclass(slots=True, eq=False)
class JobGroup:
    """The jobs of one transfer call, awaited as one unit.

    ``index`` maps each job id still in flight to its position; ``results``
    fills in as jobs complete. Both waiters belong to the bridge's loop
    (``make`` makes one); ``released`` is made only when someone must wait
    for the rest after ``first`` (a failure, a cancel): a group that succeeds
    costs one waiter.
    """

    results: list[JobResult | None]
    pending: int
    first: Waiter[None]  # resolved at the first failure or when all are done
    make: Callable[[], Waiter[None]]
    index: dict[int, int] = field(default_factory=dict)
    bad: int = 0  # jobs that ended without success
    #: When this loop read the group's last completion (monotonic ns), while
    #: metrics are on (aiokvcache.metrics); else 0.
    seen_ns: int = 0
    #: The deadlines its jobs were given: the call's ``timeout=`` (seconds,
    #: None: none) and the longest of the jobs' own (ms, 0: none). A job that
    #: timed out ran into the earlier of the two (see submit_group).
    call_timeout: float | None = None
    job_timeout_ms: int = 0
    #: What was left of the call's timeout when the jobs were submitted (ms,
    #: 0: no timeout): the deadline they were given, with their own.
    call_left_ms: int = 0
    _released: Waiter[None] | None = None

    @property
    def released(self) -> Waiter[None]:
        """Resolved when every job of the group is released."""
        fut = self._released
        if fut is None:
            fut = self._released = self.make()
            if self.pending == 0:
                fut.set_result(None)
        return fut

    @property
    def job_ids(self) -> list[int]:
        """Ids of the jobs not yet reported released."""
        return list(self.index)

    def failed(self) -> bool:
        """True once some job of the group ended without success."""
        return self.bad > 0


class BridgeError(RuntimeError):
    """The native engine went away under waiting jobs (an internal fault)."""


class GroupFailed(Exception):
    """A job group did not fully succeed; raised only after every job is released.

    ``timed_out`` is True when the wait's own asyncio deadline passed (not a
    job's native deadline: that is a job status).
    """

    def __init__(self, group: JobGroup, *, timed_out: bool) -> None:
        super().__init__("job group failed" + (" (timed out)" if timed_out else ""))
        self.group = group
        self.timed_out = timed_out


def _check_job(i: int, op: int, segs: Any, payload: bytes) -> None:
    if op not in (OP_PUT, OP_GET):
        raise ValueError(f"jobs[{i}]: op must be OP_PUT or OP_GET, got {op!r}")
    if not (
        isinstance(segs, np.ndarray)
        and segs.dtype == np.uint64
        and segs.ndim == 2
        and segs.shape[1] == 4
        and segs.flags.c_contiguous
    ):
        raise TypeError(f"jobs[{i}]: segments must be a C-contiguous uint64 array of shape (n, 4)")
    if not isinstance(payload, bytes):
        raise TypeError(f"jobs[{i}]: payload must be bytes")
    if len(payload) > native.MAX_PAYLOAD:
        raise ValueError(f"jobs[{i}]: notification payload too large ({len(payload)} bytes)")
    if payload and op == OP_GET:
        raise ValueError(f"jobs[{i}]: get jobs carry no payload")


class Bridge:
    """Binds one native ``Engine`` to the running event loop (asyncio or trio)."""

    def __init__(self, engine: Any, side: LoopSide | None = None) -> None:
        self._engine = engine
        self._side = side if side is not None else _loopside.current()
        self._is_current = self._side.is_current
        self._new_waiter = self._side.future
        self._fd: int = engine.event_fd
        self._groups: dict[int, JobGroup] = {}
        self._closed = False
        #: Called with (the sending link's cluster id, payload) for each
        #: notification a linked peer sent us.
        #: (source cluster id, payload, id of the endpoint it came on)
        self.on_notify: Callable[[int, bytes, int], None] | None = None
        #: Called with (endpoint id, UCX status) when an endpoint fails.
        self.on_endpoint_error: Callable[[int, int], None] | None = None
        self._side.watch_fd(self._fd, self._on_readable, self._busy)

    # ------------------------------------------------------------ plumbing

    @property
    def engine(self) -> Any:
        """The native engine."""
        return self._engine

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def side(self) -> LoopSide:
        """The loop (asyncio or trio) whose waiters this bridge resolves."""
        return self._side

    @property
    def pending_jobs(self) -> int:
        """Jobs submitted through this bridge and not yet reported released."""
        return len(self._groups)

    def _busy(self) -> bool:
        return bool(self._groups)

    def _on_readable(self) -> None:
        # One native call resets the eventfd and drains the queue: an entry
        # pushed after the drain bumps the eventfd again (the empty ->
        # non-empty edge), so this wakeup needs no second look.
        try:
            entries = self._engine.take()
        except Exception as exc:  # engine torn down: fail what waits
            self._fail_everything(exc)
            return
        self._dispatch(entries)
        _ucxlog.drain()  # UCX's log lines, if any came meanwhile (cheap when none)

    def _dispatch_all(self) -> None:
        # After close: drain until empty, nothing bumps any more.
        while True:
            try:
                entries = self._engine.drain()
            except Exception as exc:  # engine torn down: fail what waits
                self._fail_everything(exc)
                return
            if not entries:
                return
            self._dispatch(entries)

    def _dispatch(self, entries: list[tuple[int, int, int, int, int, bytes, int, int]]) -> None:
        for kind, ident, status, ucs, nbytes, payload, posted, done in entries:
            try:
                if kind == KIND_JOB:
                    self._job_done(JobResult(ident, status, ucs, nbytes, posted, done))
                elif kind == KIND_NOTIFY:
                    if self.on_notify is not None:
                        self.on_notify(ident, payload, posted)  # posted: the endpoint
                elif kind == KIND_ENDPOINT:
                    if self.on_endpoint_error is not None:
                        self.on_endpoint_error(ident, ucs)
            except Exception:
                # A handler bug must not escape into the loop nor leave a
                # waiter hanging; the job's own group was resolved above.
                log.exception("aiokvcache: completion handler failed (kind %d)", kind)

    def _job_done(self, res: JobResult) -> None:
        group = self._groups.pop(res.job_id, None)
        if group is None:
            return
        group.results[group.index.pop(res.job_id)] = res
        group.pending -= 1
        if res.status != ST_OK:
            group.bad += 1
            if not group.first.done():
                group.first.set_result(None)
        if group.pending == 0:
            if _telemetry.active:
                group.seen_ns = monotonic_ns()
            if not group.first.done():
                group.first.set_result(None)
            released = group._released
            if released is not None and not released.done():
                released.set_result(None)

    def _fail_everything(self, exc: BaseException) -> None:
        groups = {id(g): g for g in self._groups.values()}
        self._groups.clear()
        for g in groups.values():
            for fut in (g.first, g.released):
                if not fut.done():
                    fut.set_exception(BridgeError(f"native engine failed: {exc}"))

    # ----------------------------------------------------------- submission

    def submit_group(
        self, jobs: Jobs, *, timeout: float | None = None, checked: bool = False
    ) -> JobGroup:
        """Submit (op, endpoint id, segments, payload, timeout_ms) jobs as one group.

        ``timeout`` (seconds, the whole group) becomes every job's native
        deadline (the earlier of it and the job's own): the engine then ends
        late jobs with TIMEOUT itself, and nobody arms an asyncio timer per
        call. The group goes to the engine in one call, all or nothing.
        ``checked``: the caller built the jobs from a checked plan, so their
        form is not checked again.
        """
        if not self._is_current():
            # Completions are resolved on the loop that made the bridge:
            # a group awaited anywhere else could never be woken.
            raise RuntimeError(
                "aiokvcache transfers must run on the event loop that ran init(); "
                f"this is {self._side.describe_current()}"
            )
        if not isinstance(jobs, list):
            jobs = list(jobs)
        own_ms = max((j[4] for j in jobs), default=0)  # the jobs' own deadlines
        cap = 0
        if timeout is not None:
            cap = max(1, math.ceil(timeout * 1000))
            jobs = [
                (op, ep, sg, pl, cap if t <= 0 else min(t, cap), *rest)
                for op, ep, sg, pl, t, *rest in jobs
            ]
        if not checked:
            for i, (op, _ep, segs, payload, *_rest) in enumerate(jobs):
                _check_job(i, op, segs, payload)
        if self._closed:
            raise native.EngineClosedError("the engine is closed")
        make = self._new_waiter
        group = JobGroup([None] * len(jobs), len(jobs), make(), make)
        # What is left of a call's timeout (runner.TimeLeft) knows the whole.
        group.call_timeout = getattr(timeout, "whole", timeout)
        group.job_timeout_ms = int(own_ms)
        group.call_left_ms = cap
        if not jobs:
            group.first.set_result(None)
            return group
        # One crossing; the engine checks every job before it takes any.
        ids = self._engine.submit_many(jobs)
        group.index = {jid: i for i, jid in enumerate(ids)}
        groups = self._groups
        for jid in ids:
            groups[jid] = group
        return group

    async def wait(self, group: JobGroup, *, timeout: float | None = None) -> list[JobResult]:
        """Await a group from :meth:`submit_group`; every job's result on success.

        Raises :class:`GroupFailed` when a job failed or ``timeout`` (an
        asyncio deadline on the wait; prefer the native deadline that
        :meth:`submit_group` arms, which costs nothing per call) passed, and
        re-raises cancellation; in every case only after all jobs are released.
        """
        # ``first`` is awaited unshielded: if this task is cancelled it is
        # cancelled too, which _job_done tolerates; ``released`` is the future
        # that must survive, and _release shields it.
        try:
            if timeout is None:
                await group.first
            else:
                async with self._side.deadline(timeout):
                    await group.first
        except TimeoutError:
            await self._release(group)
            raise GroupFailed(group, timed_out=True) from None
        except BaseException:
            await self._release(group)
            raise
        if group.pending:
            await self._release(group)
        if group.bad:
            raise GroupFailed(group, timed_out=False)
        return group.results  # type: ignore[return-value]  # all filled in by now

    def cancel_group(self, group: JobGroup) -> None:
        """Ask the engine to cancel every job of ``group`` still in flight."""
        for jid in list(group.index):
            with contextlib.suppress(native.EngineClosedError):
                self._engine.cancel(jid)

    async def _release(self, group: JobGroup) -> None:
        """Cancel what is left of a group and wait until the engine lets go."""
        self.cancel_group(group)
        await self._side.settle(group.released)

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Close the engine, resolve every pending job, stop watching the eventfd.

        Idempotent. Jobs still in flight are reported released with
        ENGINE_FINALIZED once the native engine has stopped them.
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._engine.close()  # joins the progress thread: all jobs reported
        self._dispatch_all()
        _ucxlog.drain()
        self._fail_everything(BridgeError("engine closed"))
        with contextlib.suppress(Exception):
            self._side.unwatch_fd(self._fd)
