"""The SGLang backend's data plane: one aiokvcache instance per scheduler
rank, on a thread of its own, holding that rank's KV and aux buffers.

SGLang describes a rank's memory as lists of buffers (``KVArgs``): the KV
pool's (K of every layer, then V), each a run of pages of ``item`` bytes,
and the metadata ("aux") buffers, each a run of rows (the first output
token travels in one). Buffers of one row size become one blocks cache
(model id 0, 1, ... in their order), so a page is a block of every KV
buffer and an aux row a block of every aux buffer of its size.

The prefill pushes: :meth:`RankEngine.push` writes a chunk's pages into the
decode's (runs consecutive on both sides go as one segment per buffer),
and the request's last chunk, once every earlier chunk of it landed, its
aux row; then it reports. A push returns once the bytes are in the peer's
memory (the core's remote completion), so a reported success holds them.
:meth:`RankEngine.cancel` stops a request's pushes and reports once none
of them can write any more (the core's cancellation is quiescent); a
chunk that fails ends its request alike (its other chunks stop, and a chunk
posted later moves nothing: no aux row lands after a lost page). No
SGLang import here: the SGLang classes are in :mod:`.conn`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from ..agent.kvtypes import Peer, TransferFailed
from ..agent.links import PeerLinks
from ..agent.loopthread import LoopThread

__all__ = ["Buffers", "Peer", "RankEngine"]

log = logging.getLogger("aiokvcache.sglang")

#: (room, ok, reason, last): how a pushed chunk ended (``reason`` "" when ok).
OnResult = Callable[[int, bool, str, bool], None]
#: Rooms an engine remembers as ended, cancelled or failed (a push posted
#: after that reports at once, moving nothing).
ENDED_ROOMS = 4096


@dataclass(frozen=True)
class Buffers:
    """One kind of a rank's buffers (KV or aux): base addresses, byte
    lengths and row (page) bytes, as ``KVArgs`` lists them."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    items: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.ptrs) == len(self.lens) == len(self.items):
            raise ValueError("buffer pointers, lengths and row sizes differ in number")
        if any(i <= 0 or n < i for n, i in zip(self.lens, self.items, strict=True)):
            raise ValueError("a buffer is shorter than one row, or its row size is not positive")

    @classmethod
    def of(cls, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> Buffers:
        return cls(tuple(map(int, ptrs)), tuple(map(int, lens)), tuple(map(int, items)))

    def groups(self) -> list[tuple[int, list[int]]]:
        """Row size and buffer indices of each group of one row size, in order."""
        out: dict[int, list[int]] = {}
        for i, item in enumerate(self.items):
            out.setdefault(item, []).append(i)
        return list(out.items())

    def shape(self) -> list[int]:
        """What both sides must agree on: each buffer's row size, in order."""
        return list(self.items)

    def rows(self) -> int:
        """Rows (pages) every buffer has: a block id below it is valid in all."""
        return min((n // i for n, i in zip(self.lens, self.items, strict=True)), default=0)


class RankEngine(LoopThread):
    """One ``LLMDataDist`` on a daemon thread, for one SGLang scheduler rank.

    Thread-safe: :meth:`push`, :meth:`cancel` and :meth:`link` return at
    once; results come through the callbacks, on the engine's thread.
    """

    thread_name = "aiokvcache-sglang"

    def __init__(
        self,
        kv: Buffers,
        aux: Buffers,
        *,
        host: str = "127.0.0.1",
        transport: str = "auto",
        timeout: float = 30.0,
        link_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self.kv, self.aux = kv, aux
        self.cluster_id = secrets.randbits(48) + 1
        self.timeout = float(timeout)
        self._host, self._transport = host, transport
        self.links = PeerLinks(link_timeout, self._spawn)
        self._caches: list[tuple[int, Any, int]] = []  # (model id, cache, row bytes)
        self._rooms: dict[int, list[asyncio.Task[None]]] = {}
        # room -> why its pushes end (cancelled, or an earlier chunk failed)
        self._ended: collections.OrderedDict[int, str] = collections.OrderedDict()

    # ------------------------------------------------------------ lifecycle

    async def _init(self) -> str:
        cfg = LLMConfig()
        cfg.listen_ip_info = f"{self._host}:0"
        cfg.transport = self._transport
        cfg.enable_remote_cache_accessible = True
        dd = LLMDataDist(LLMRole.MIX, self.cluster_id)
        await dd.init(cfg.generate_options())
        self.links.dd, self.links.cm = dd, dd.cache_manager
        model = 0
        for bufs in (self.kv, self.aux):
            for item, idx in bufs.groups():
                rows = min(bufs.lens[i] // item for i in idx)
                desc = CacheDesc(len(idx), [rows, item], DataType.DT_UINT8, Placement.HOST)
                key = BlocksCacheKey(self.cluster_id, model)
                addrs = [bufs.ptrs[i] for i in idx]
                cache = dd.cache_manager.register_blocks_cache(desc, addrs, key, True)
                self._caches.append((model, cache, item))
                model += 1
        assert dd.listen_address is not None
        return str(dd.listen_address)

    async def _shutdown(self) -> None:
        await self._cancel_tasks()  # a push posted while closing is cancelled too
        if self.links.dd is not None:
            await self.links.dd.finalize()

    # ------------------------------------------------------------ prefill

    def link(self, peer: Peer) -> None:
        """Start linking to ``peer`` now (a push links first anyway)."""
        self._post(lambda: self._spawn(self._try_link(peer)))

    def forget(self, peer: Peer) -> None:
        """Drop the link to ``peer`` (a decode rank that restarted under a new
        cluster id, or whose registration was dropped): its pushes in flight
        fail, and a later push links anew."""
        self._post(lambda: self._spawn(self.links.forget(peer.cluster_id)))

    async def _try_link(self, peer: Peer) -> None:
        with contextlib.suppress(Exception):
            await self.links.link(peer)

    def push(
        self,
        room: int,
        peer: Peer,
        pages: tuple[np.ndarray, np.ndarray],
        aux_rows: tuple[int, int] | None,
        on_result: OnResult,
        peer_rows: tuple[int, int] | None = None,
    ) -> None:
        """Write pages ``pages[0]`` here into pages ``pages[1]`` of ``peer``;
        with ``aux_rows`` (here, there: the request's last chunk), once every
        earlier chunk of ``room`` landed, its aux row too. ``on_result``
        says how it ended, once it can write no more. ``peer_rows``: the
        peer's page and aux-row counts, as its registration gave them.
        ``ValueError`` for a page or aux row outside either side's buffers
        (checked before any byte moves); ``RuntimeError`` once the engine is
        closing (nothing was posted either way)."""
        src, dst = (np.asarray(p, dtype=np.int64) for p in pages)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
        if len(src) and not (0 <= src.min() and src.max() < self.kv.rows()):
            raise ValueError("a source page is outside this rank's KV pool")
        if aux_rows is not None and not 0 <= aux_rows[0] < self.aux.rows():
            raise ValueError("the source aux row is outside this rank's aux buffers")
        if peer_rows is not None:
            if len(dst) and not (0 <= dst.min() and dst.max() < peer_rows[0]):
                raise ValueError("a destination page is outside the peer's KV pool")
            if aux_rows is not None and not 0 <= aux_rows[1] < peer_rows[1]:
                raise ValueError("the destination aux row is outside the peer's aux buffers")
        deadline = time.monotonic() + self.timeout
        args = (room, peer, src, dst, aux_rows, deadline, on_result)
        self._post(self._start_push, *args)

    def _start_push(
        self,
        room: int,
        peer: Peer,
        src: np.ndarray,
        dst: np.ndarray,
        aux_rows: tuple[int, int] | None,
        deadline: float,
        on_result: OnResult,
    ) -> None:
        last = aux_rows is not None
        ended = self._ended.get(room)
        if ended is not None:  # posted after its room was cancelled or failed
            on_result(room, False, ended, last)
            return
        tasks = self._rooms.setdefault(room, [])
        earlier = list(tasks)
        task = self._spawn(self._push(peer, src, dst, aux_rows, earlier, deadline))

        def done(t: asyncio.Task[None]) -> None:
            # Whether the request that posted it still holds the room (a
            # reopen hands the room to a new request: the earlier one's
            # pushes end on their own and neither wait for nor end the new).
            current = self._rooms.get(room) is tasks
            tasks.remove(t)
            if current and not tasks:
                del self._rooms[room]
            if t.cancelled():
                on_result(room, False, (current and self._ended.get(room)) or "cancelled", last)
            elif t.exception() is not None:
                reason = _reason(t.exception())
                if current:
                    # The request cannot succeed: its other chunks stop, later
                    # ones move nothing (its aux row never lands after a loss).
                    self._end_room(room, f"an earlier chunk of the request failed: {reason}")
                on_result(room, False, reason, last)
            else:
                on_result(room, True, "", last)

        tasks.append(task)
        task.add_done_callback(done)

    async def _push(
        self,
        peer: Peer,
        src: np.ndarray,
        dst: np.ndarray,
        aux_rows: tuple[int, int] | None,
        earlier: list[asyncio.Task[None]],
        deadline: float,
    ) -> None:
        cm = self.links.cm
        assert cm is not None
        await asyncio.wait_for(self.links.relink(peer), _left(deadline))
        n_kv = len(self.kv.groups())
        for model, cache, _ in self._caches[:n_kv]:
            if len(src):
                await cm.push_blocks(
                    BlocksCacheKey(peer.cluster_id, model), cache, src, dst,
                    tensor_num_per_layer=1, timeout=_left(deadline),
                )  # fmt: skip
        if aux_rows is None:
            return
        for t in earlier:  # the request's earlier chunks landed first
            await asyncio.wait_for(asyncio.shield(t), _left(deadline))
        here, there = aux_rows
        for model, cache, _ in self._caches[n_kv:]:
            await cm.push_blocks(
                BlocksCacheKey(peer.cluster_id, model), cache, [here], [there],
                tensor_num_per_layer=1, timeout=_left(deadline),
            )  # fmt: skip

    def cancel(self, room: int) -> None:
        """Stop ``room``'s pushes: each reports through its ``on_result`` once
        it can write no more (the core's cancellation is quiescent)."""
        self._post(self._cancel, room)

    def _cancel(self, room: int) -> None:
        self._end_room(room, "cancelled")

    def _end_room(self, room: int, reason: str) -> None:
        """``room``'s pushes stop, and later ones report ``reason`` at once."""
        self._ended.setdefault(room, reason)
        self._ended.move_to_end(room)
        while len(self._ended) > ENDED_ROOMS:
            self._ended.popitem(last=False)
        for t in list(self._rooms.get(room, ())):
            t.cancel()

    def reopen(self, room: int) -> None:
        """``room`` starts a new request (SGLang reuses a room on a
        re-bootstrap): pushes for it are taken again."""
        self._post(self._reopen, room)

    def _reopen(self, room: int) -> None:
        self._ended.pop(room, None)
        self._rooms.pop(room, None)  # the earlier request's pushes: no longer its

    def busy(self, room: int) -> bool:
        """Whether a push of ``room`` is in flight (read from any thread)."""
        return bool(self._rooms.get(room))


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer's deadline passed")
    return left


def _reason(exc: BaseException | None) -> str:
    if isinstance(exc, TransferFailed):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "aiokvcache: the transfer did not complete within its deadline"
    return f"aiokvcache: {type(exc).__name__}: {exc}"
