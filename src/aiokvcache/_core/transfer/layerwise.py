"""Layer-wise pipelining: ``transfer_cache_async`` and :class:`CacheTask`.

``await cm.transfer_cache_async(...)`` checks every argument and resolves
every destination (remote metadata, bounds) first (:mod:`.layerprep`), so
bad input raises there and nothing moves. Then one task of the owner's loop
(an asyncio task, or a trio system task of the instance) walks the source layers: for
layer *i* it awaits the layer synchronizer, submits layer *i* to every
config that includes it — one native job per (config, layer) — and goes on
to layer *i + 1* without waiting for those jobs. The native progress thread
moves layer *i* while the caller computes layer *i + 1*. The task awaits all
jobs at the end; cancelling it cancels them natively and waits until the
engine has released them (quiescence) before it ends.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Coroutine, Generator, Sequence
from typing import Any

from ... import _telemetry
from ..._bridge import OP_PUT
from ..._loopside import TaskHandle
from ..memory.state import LocalCache
from ..model.errors import (
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    landed_text,
    make_error,
    param_invalid,
)
from ..model.types import TransferConfig, TransferWithCacheKeyConfig, check_uint32
from . import planner as blocks
from .layerprep import Config, Prepare, Target, describe
from .runner import time_left
from .transfers import Transfers

__all__ = ["CacheTask", "transfer_cache_async"]

log = logging.getLogger("aiokvcache")


class CacheTask:
    """The handle ``transfer_cache_async`` returns.

    * ``await task`` **[ours]** waits for the whole transfer: returns None
      when every config succeeded, else raises :class:`LLMException` (the
      first failed config's status; the message names every config's
      outcome). Like awaiting an ``asyncio.Task``, cancelling the awaiting
      coroutine (a task cancel, a timeout, a trio or anyio cancel scope)
      cancels the transfer, and the await ends once it is quiescent.
    * ``await task.synchronize(timeout_in_millis=None)`` → the first
      non-success status, else ``LLM_SUCCESS``; ``LLM_TIMEOUT`` if the task
      is not done in time (the task goes on).
    * ``await task.get_results(timeout_in_millis=None)`` → one status per
      config, None for a config whose transfer was stopped early because of
      another config's layer (LLM-DataDist's semantics); all ``LLM_TIMEOUT``
      if the task is not done in time.
    * ``task.cancel()``: stops sending, cancels what is in flight and ends
      once nothing can be written any more (quiescent). Unfinished configs
      then read ``LLM_FAILED``; ``await task`` raises ``CancelledError`` under
      asyncio and ``LLMException(LLM_FAILED)`` under trio (whose cancellation
      belongs to a cancel scope of the caller's, not to a task).
    """

    def __init__(self, num_configs: int) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._error: BaseException | None = None
        self._task: TaskHandle | None = None

    def _attach(self, task: TaskHandle) -> None:
        self._task = task

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        assert self._task is not None
        await self._task.join()  # asyncio: raises CancelledError if it was cancelled
        if self._error is not None:
            raise self._error
        if self._task.cancelled():
            raise make_error(
                LLMStatusCode.LLM_FAILED, "transfer_cache_async was cancelled (task.cancel())"
            )

    def done(self) -> bool:
        """True once the transfer has ended (success, failure or cancellation)."""
        return self._task is not None and self._task.done()

    def cancelled(self) -> bool:
        """True if the transfer ended because it was cancelled."""
        return self._task is not None and self._task.cancelled()

    def cancel(self) -> bool:
        """Request cancellation (see the class docstring); False if already done."""
        return self._task is not None and self._task.cancel()

    async def _finished(self, timeout_in_millis: int | None) -> bool:
        assert self._task is not None
        timeout = None
        if timeout_in_millis is not None:
            timeout = check_uint32("timeout_in_millis", timeout_in_millis) / 1000
        if self._task.done():
            return True
        return await self._task.wait_done(timeout)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the transfer; the first non-success status, else ``LLM_SUCCESS``."""
        if not await self._finished(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for r in self._results:
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        return LLMStatusCode.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Wait for the transfer; one status (or None) per transfer config."""
        if not await self._finished(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"CacheTask({state}, results={[r and r.name for r in self._results]})"


# --------------------------------------------------------------------------
# entry point and the pipeline


def _check_synchronizer(layer_synchronizer: Any) -> Any:
    fn = getattr(layer_synchronizer, "synchronize_layer", None)
    if not callable(fn):
        raise TypeError(
            "layer_synchronizer must be a LayerSynchronizer (an object with "
            f"synchronize_layer(layer_index, timeout_in_millis)), got "
            f"{type(layer_synchronizer).__name__}"
        )
    return fn


def _check_configs(transfer_configs: Any) -> list[Config]:
    if not isinstance(transfer_configs, (list, tuple)):
        raise TypeError(
            "transfer_configs must be a list of TransferConfig / TransferWithCacheKeyConfig, "
            f"got {type(transfer_configs).__name__}"
        )
    for i, c in enumerate(transfer_configs):
        if not isinstance(c, (TransferConfig, TransferWithCacheKeyConfig)):
            raise TypeError(
                f"transfer_configs[{i}] must be TransferConfig or TransferWithCacheKeyConfig, "
                f"got {type(c).__name__}"
            )
    return list(transfer_configs)


async def transfer_cache_async(
    cm: Transfers,
    src: LocalCache,
    layer_synchronizer: Any,
    transfer_configs: Sequence[Config],
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    tmo: float | None,
) -> CacheTask:
    """See ``CacheManager.transfer_cache_async``; ``tmo`` already checked."""
    sync = _check_synchronizer(layer_synchronizer)
    configs = _check_configs(transfer_configs)
    prep = Prepare(cm, src, src_block_indices, dst_block_indices, dst_block_memory_size)
    if configs:
        cm.require_remote_access("transfer_cache_async")
    links = [cm.state.link_for(c.dst_cluster_id) for c in configs]
    side = cm.side
    start = side.time()
    try:
        async with side.deadline(tmo):
            pending = [
                prep.target(i, c, lk) for i, (c, lk) in enumerate(zip(configs, links, strict=True))
            ]
            targets = await side.gather(pending)
    except TimeoutError:
        raise LLMTimeoutError(
            "transfer_cache_async timed out looking up the destinations"
        ) from None
    tmo = time_left(tmo, start, side.time)
    task = CacheTask(len(configs))
    runner = _Pipeline(cm, prep, src, targets, sync, task, tmo)
    run = runner.run
    if _telemetry.active:  # the whole task, every layer to every destination, as one call
        peer = configs[0].dst_cluster_id if len(configs) == 1 else -1

        def run() -> Coroutine[Any, Any, None]:
            # The task keeps its error for synchronize(): read it as the status.
            return _telemetry.measure(
                "transfer_cache_async", peer, runner.run(), lambda: task._error
            )

    task._attach(cm.spawn(run, "aiokvcache.transfer_cache_async"))
    return task


class _Pipeline:
    def __init__(
        self,
        cm: Transfers,
        prep: Prepare,
        src: LocalCache,
        targets: list[Target],
        sync: Any,
        task: CacheTask,
        timeout: float | None,
    ) -> None:
        self.cm = cm
        self.prep = prep
        self.src = src
        self.targets = targets
        self.sync = sync
        self.task = task
        self.timeout = timeout
        self.sync_error: Exception | None = None
        self.runner = cm.runner

    async def run(self) -> None:
        side = self.cm.side
        deadline = side.deadline(self.timeout)
        try:
            async with deadline:
                await self._send_all()
                await self._wait_all()
        except TimeoutError as exc:
            interrupted = await self._release_all()
            self._settle(LLMStatusCode.LLM_TIMEOUT)
            # Ours, or the synchronizer's own TimeoutError.
            if deadline.expired():
                err = LLMTimeoutError("transfer_cache_async timed out; " + self._summary())
                whole = getattr(self.timeout, "whole", self.timeout)
                self.task._error = self._stamp(err, f"timeout={whole:g} s")
            else:
                self.task._error = exc
            if interrupted is not None:
                raise interrupted from None
        except side.Cancelled:
            # Under trio the cancellation stays on (the scope is cancelled)
            # while we release: what _release_all saw is this one again.
            await self._release_all()
            if self.cm.state.finalized:
                # finalize() stopped us, not the caller: say so.
                self._settle(LLMStatusCode.LLM_ENGINE_FINALIZED)
                self.task._error = make_error(
                    LLMStatusCode.LLM_ENGINE_FINALIZED,
                    "finalized during transfer_cache_async; " + self._summary(),
                )
                return
            self._settle(LLMStatusCode.LLM_FAILED)
            raise
        except Exception as exc:  # the engine went away under us
            interrupted = await self._release_all()
            code = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_FAILED
            self._settle(code)
            self.task._error = exc
            if interrupted is not None:
                raise interrupted from None
        else:
            self._finish()
        finally:
            self._untrack()

    # ------------------------------------------------------------ sending

    async def _send_all(self) -> None:
        per_job_ms = self.cm.state.options.sync_kv_timeout_ms
        for layer in range(self.prep.num_layers):
            concerned = [t for t in self.targets if layer in t.src_range]
            live = [t for t in concerned if not t.stopped and not self._check_failed(t)]
            if not live:
                continue
            try:
                ok = self.sync(layer, None)
                if inspect.isawaitable(ok):
                    ok = await ok
            except Exception as exc:
                # Like False (what was sent may land), but the task re-raises it.
                self.sync_error = exc
                ok = None
            if not ok:
                for t in concerned:
                    if not t.stopped and t.error is None:
                        t.error = (
                            param_invalid(
                                f"layer_synchronizer returned {ok!r} for layer {layer}; "
                                "nothing from that layer on was sent"
                            )
                            if self.sync_error is None
                            else make_error(
                                LLMStatusCode.LLM_FAILED,
                                f"layer_synchronizer raised {self.sync_error!r} for layer "
                                f"{layer}; nothing from that layer on was sent",
                            )
                        )
                for t in self.targets:
                    if t.src_range.stop > layer:
                        t.stopped = True  # layers from this one on are not sent
                log.warning(
                    "aiokvcache: transfer_cache_async stopped at layer %d: %s",
                    layer,
                    f"synchronizer returned {ok!r}"
                    if self.sync_error is None
                    else f"synchronizer raised {self.sync_error!r}",
                )
                return
            for t in live:
                spec = t.layers[layer]
                rows = blocks.layer_rows(t.plan, spec.local_addrs, spec.remote_addrs, spec.rkeys)
                payload = t.payload(spec)
                try:
                    group = self.runner.start(
                        [(OP_PUT, t.link.ep, rows, payload, per_job_ms, spec.guard)],
                        None,
                        self.src,
                        t.remotes,
                    )
                except LLMException as exc:  # a cache went away: this destination stops
                    t.error = t.error or exc
                    continue
                t.groups.append((group, spec.dst_layer, group.job_ids))
                t.watch(group)

    def _check_failed(self, t: Target) -> bool:
        if not t.failed():
            return False
        if not t.cancelled_rest:
            # Stop this destination: what is still in flight for it is cancelled.
            t.cancelled_rest = True
            for g, _, _ in t.groups:
                self.runner.bridge.cancel_group(g)
        return True

    # ------------------------------------------------------------ waiting

    async def _wait_all(self) -> None:
        for t in self.targets:
            for g, layer, _ in t.groups:
                try:
                    await self.runner.wait(g, [f"layer {layer}"])
                except LLMException as exc:
                    if t.error is None:
                        t.error = self.runner.explain(exc, self.src, t.remotes)
                    for g2, _, _ in t.groups:
                        self.runner.bridge.cancel_group(g2)

    async def _release_all(self) -> BaseException | None:
        """Cancel every group and wait until each is released, whatever
        cancellation arrives meanwhile: the one that did, for the caller."""
        groups = [g for t in self.targets for g, _, _ in t.groups]
        for g in groups:
            self.runner.bridge.cancel_group(g)
        side = self.cm.side
        interrupted: BaseException | None = None
        for g in groups:  # every group, even if a cancel arrives on the way
            try:
                await side.settle(g.released)
            except side.Cancelled as exc:
                interrupted = exc
        return interrupted

    def _untrack(self) -> None:
        for t in self.targets:
            for g, _, _ in t.groups:
                self.runner.release(g)

    # ------------------------------------------------------------ results

    def _landed(self, t: Target) -> list[int]:
        """The destination layers of ``t`` whose bytes landed."""
        return [
            layer
            for g, layer, _ in t.groups
            if g.results and all(r is not None and r.ok for r in g.results)
        ]

    def _finish(self) -> None:
        results = self.task._results
        for t in self.targets:
            if t.error is not None:
                results[t.index] = t.error.status_code
            elif not t.stopped:
                results[t.index] = LLMStatusCode.LLM_SUCCESS
            # else: stopped by another destination's layer → None
        first = next((t for t in self.targets if t.error is not None), None)
        if self.sync_error is not None:
            self.task._error = self.sync_error
        elif first is not None:
            err = make_error(
                first.error.status_code if first.error else LLMStatusCode.LLM_FAILED,
                f"transfer_cache_async failed; {self._summary()}",
            )
            self.task._error = self._stamp(err, first.error.deadline if first.error else None)

    def _stamp(self, err: LLMException, deadline: str | None) -> LLMException:
        """``err`` with what landed (the destination layers that landed at
        every destination: never more than any of them holds) and the
        deadline that ended the call (None: none did)."""
        landed: set[int] | None = None
        for t in self.targets:
            mine = set(self._landed(t))
            landed = mine if landed is None else landed & mine
        err.landed = frozenset(landed or ())
        err.deadline = deadline
        return err

    def _settle(self, code: LLMStatusCode) -> None:
        """After a timeout, cancellation or error: unfinished destinations get ``code``."""
        results = self.task._results
        for t in self.targets:
            if t.error is not None:
                results[t.index] = t.error.status_code
            elif t.groups and len(self._landed(t)) == len(t.src_range):
                results[t.index] = LLMStatusCode.LLM_SUCCESS
            else:
                results[t.index] = code

    def _summary(self) -> str:
        parts = []
        for t in self.targets:
            landed_layers = self._landed(t)
            if t.error is not None:
                state = f"{t.error.status_code.name}: {t.error.message}"
            elif t.stopped:
                state = "stopped"
            else:
                state = "ok" if len(landed_layers) == len(t.src_range) else "not finished"
            landed = landed_text(landed_layers)
            parts.append(f"{describe(t.index, t.config)}: {state} (landed: {landed})")
        return "; ".join(parts)
