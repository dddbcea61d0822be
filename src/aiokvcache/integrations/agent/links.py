"""The transfer agent's aiokvcache engine as its sides use it: the engine's
handles, the links to peers, and the connector's messages sent over them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ... import LLMClusterInfo, LLMDataDist, LLMException, LLMStatusCode
from ...cache_manager import CacheManager
from .kvtypes import Peer, TransferFailed
from .wire import Message

__all__ = ["PeerLinks"]

log = logging.getLogger("aiokvcache.vllm")


class PeerLinks:
    """Links to peers, each made once and made again once when it went away,
    and the sends of :mod:`.wire` messages over them. ``spawn`` runs a task
    the agent cancels at shutdown. ``dd``, ``cm`` and ``cache`` (the
    registered blocks cache) are set once the engine started."""

    def __init__(
        self, link_timeout: float, spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    ) -> None:
        self.link_timeout = link_timeout
        self._spawn = spawn
        self._links: dict[int, asyncio.Task[None]] = {}
        self.dd: LLMDataDist | None = None
        self.cm: CacheManager | None = None
        self.cache: Any = None

    async def link(self, peer: Peer) -> None:
        """Link to ``peer`` (one attempt at a time; a failed one is retried)."""
        task = self._links.get(peer.cluster_id)
        if task is None or (task.done() and task.exception() is not None):
            task = self._links[peer.cluster_id] = self._spawn(self._do_link(peer))
        await asyncio.shield(task)

    async def relink(self, peer: Peer) -> None:
        """:meth:`link`, making the link again if the one made before went
        away since (the peer restarted, unlinked, or was declared dead)."""
        task = self._links.get(peer.cluster_id)
        made = task is not None and task.done() and task.exception() is None
        if made and not self.alive(peer.cluster_id):
            await self.forget(peer.cluster_id)
        await self.link(peer)

    async def _do_link(self, peer: Peer) -> None:
        assert self.dd is not None
        info = LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_remote_ip_info(peer.host, int(peer.port))
        _, (st,) = await self.dd.link_clusters([info], timeout=int(self.link_timeout * 1000))
        if st not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise TransferFailed(f"cannot link to {peer.host}:{peer.port}: {st.name}", "link")

    async def send_to(self, peer: Peer, msg: Message, timeout: float) -> None:
        """Link (once) and send ``msg``, within ``timeout``. A link that went
        away since (the peer restarted, unlinked, or was declared dead) is
        made again, once, rather than failing this transfer."""
        assert self.cm is not None
        tag = msg.encode()
        end = time.monotonic() + timeout
        for attempt in (0, 1):
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(self.link(peer), left)
                left = end - time.monotonic()
                await self.cm.notify(
                    peer.cluster_id, tag, timeout=max(0.001, min(self.link_timeout, left))
                )
                return
            except LLMException as exc:
                gone = exc.status_code in (
                    LLMStatusCode.LLM_NOT_YET_LINK,
                    LLMStatusCode.LLM_LINK_FAILED,
                )
                if attempt or not gone:
                    raise TransferFailed(f"cannot reach the peer: {exc}", "link") from exc
                await self.forget(peer.cluster_id)

    async def send(self, cluster_id: int, msg: Message) -> None:
        """A reply or a notice that need not arrive (the peer's deadlines cover it)."""
        assert self.cm is not None
        try:
            await self.cm.notify(cluster_id, msg.encode(), timeout=self.link_timeout)
        except Exception as exc:
            log.info("aiokvcache: notification to cluster %d lost: %s", cluster_id, exc)

    def current(self, cluster_id: int) -> Any:
        """The link to ``cluster_id`` as it is now: the id of its endpoint,
        what a notification that came on it carries (``None`` when there is
        none, or no engine: tests). A link made again after the peer
        restarted, or after an unlink, is another."""
        if self.dd is None:
            return None
        link = self.dd._links.get(cluster_id)
        return None if link is None or link.broken else int(link.ep)

    def alive(self, cluster_id: int) -> bool:
        """Whether a link to ``cluster_id`` is up (always, without an engine: tests)."""
        if self.dd is None:
            return True
        link = self.dd._links.get(cluster_id)
        return link is not None and not link.broken

    async def quiesce(self, cluster_id: int) -> None:
        """Unlink ``cluster_id`` and have it confirm: its engine answers only
        once its own transfers on the link were released, so nothing it
        posted lands after this returns (or it is cut off: see the core's
        retirement). The next send links anew."""
        self._links.pop(cluster_id, None)
        if self.dd is not None:
            info = LLMClusterInfo()
            info.remote_cluster_id = cluster_id
            with contextlib.suppress(Exception):
                await self.dd.unlink_clusters([info], timeout=int(self.link_timeout * 1000))

    async def forget(self, cluster_id: int) -> None:
        """Drop our side of a link (one that went away, or a peer no longer
        wanted), so that it is made afresh if needed again."""
        self._links.pop(cluster_id, None)
        if self.dd is not None:
            info = LLMClusterInfo()
            info.remote_cluster_id = cluster_id
            with contextlib.suppress(Exception):
                await self.dd.unlink_clusters([info], force=True)
