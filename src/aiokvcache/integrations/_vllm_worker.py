"""What a vLLM worker-side ``AioKVConnector`` does with each step's metadata
(``bind_connector_metadata``): hand the scheduler's decisions to its
:class:`.kvlink.TransferAgent`, for its own tensor-parallel rank. No vLLM
import here: the metadata's fields are read as the scheduler wrote them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .agent.kvlink import TransferAgent
from .agent.kvtypes import HeadSpan, Peer, Source

__all__ = ["WorkerBinding"]

log = logging.getLogger("aiokvcache.vllm")


class WorkerBinding:
    """Rank ``rank``'s view of the scheduler's metadata: which prefill worker,
    key and transfer id of a request are its own. ``lease``: this
    instance's ``kv_lease_duration`` (renewals go at a sixth of the prefill's,
    which its params carry; this one when they do not); ``tp_size``: this
    instance's tensor-parallel size; ``heads``: the KV heads a block of this
    rank holds, ``total_heads`` the model's (0: the layout is not head-major,
    or heads are replicated: only a prefill of this tensor-parallel size)."""

    def __init__(
        self,
        rank: int,
        block_size: int,
        lease: float,
        tp_size: int = 1,
        heads: int = 1,
        total_heads: int = 0,
    ) -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.heads = heads
        self.total_heads = total_heads
        self.block_size = block_size
        self.lease = lease
        # Transfer ids are per tensor-parallel rank: rank r pushes to rank r.
        self.suffix = f"/{rank}"

    def bind(self, agent: TransferAgent, meta: Any) -> list[str]:
        """Hand ``meta`` to ``agent``; returns the transfer ids this step's
        layers are pushed for (``save_kv_layer``)."""
        for rid, (lease, blocks, until) in meta.holds.items():
            agent.hold(rid, lease, blocks, until)
        pushes = self._push_steps(agent, meta)
        self._loads(agent, meta)
        for rid in meta.cancel_recv:
            agent.cancel_recv(rid)
        self._renewals(agent, meta)
        self._drops(agent, meta)
        return pushes

    def _push_steps(self, agent: TransferAgent, meta: Any) -> list[str]:
        pushes = []
        for rid, (xid, groups, end, final, client_key, prompt) in meta.push_steps.items():
            mine = xid + self.suffix
            key = client_key or None
            bs = self.block_size
            agent.push_step(mine, rid, groups[0], bs, end, final, key, groups, prompt)
            pushes.append(mine)
        for rid, (xid, aborted, groups) in meta.push_release.items():
            agent.push_release(xid + self.suffix, rid, aborted, groups)
        if meta.push_settle:
            # Their out-of-window blocks were freed for this step to reuse:
            # a push still reading them ends before the step runs.
            agent.push_settle([xid + self.suffix for xid in meta.push_settle.values()])
        return pushes

    def _loads(self, agent: TransferAgent, meta: Any) -> None:
        for rid, r in meta.recv.items():
            log.debug("worker: load %s (%s, %d blocks)", rid, r.mode, len(r.local_block_ids))
            try:
                if r.error:
                    raise ValueError(r.error)
                if r.mode == "push":
                    sources = self.push_sources(r.peers, r.tp_size, r.push_keys, r.transfer_key)
                else:
                    sources = self.sources(r.peers, r.tp_size, r.grant_keys)
            except ValueError as exc:  # the params name no prefill worker for this rank
                log.error("aiokvcache: request %s: %s", rid, exc)
                agent.refuse_load(rid, r.local_block_ids, str(exc))
                continue
            if r.mode == "push":
                # Transfer ids are per prefill rank: transfer_id/rank.
                agent.expect_push(
                    rid,
                    None,
                    r.transfer_id,
                    r.local_block_ids,
                    r.first,
                    layout=r.layout,
                    sources=sources,
                    groups=r.groups,
                    tokens=r.end or None,
                )
            else:
                agent.pull(
                    rid,
                    None,
                    r.remote_request_id,
                    r.remote_block_ids,
                    r.local_block_ids,
                    r.layout,
                    until_ms=r.grant_until,
                    first=r.first,
                    picks=r.picks,
                    sources=sources,
                )

    def _renewals(self, agent: TransferAgent, meta: Any) -> None:
        for rid, ref in meta.renew_start.items():
            # A sixth of the prefill's lease (its params say it; else ours).
            every = max(0.1, min(self.lease, ref.lease or self.lease) / 6)
            for s in self._sources_or_none(rid, ref):
                agent.renew_start(
                    rid,
                    s.peer,
                    ref.remote_request_id,
                    s.key,
                    ref.grant_until,
                    ref.remote_block_ids,
                    every,
                )
        for rid in meta.renew_stop:
            agent.renew_stop(rid)

    def _drops(self, agent: TransferAgent, meta: Any) -> None:
        for drop in meta.drops:
            if drop.mode == "push":
                for s in self._sources_or_none(drop.remote_request_id, drop):
                    agent.drop_push(s.peer, f"{drop.transfer_id}/{s.rank}", s.key, s)
                continue
            for s in self._sources_or_none(drop.remote_request_id, drop):
                agent.free_remote(
                    s.peer,
                    drop.remote_request_id,
                    s.key,
                    drop.grant_until,
                    drop.remote_block_ids,
                )

    def grant_key(self, keys: list[str]) -> str:
        """This rank's grant key (rank r claims from the prefill's rank r)."""
        return str(keys[self.rank]) if len(keys) > self.rank else ""

    def push_sources(
        self, peers: list[list[Any]], remote_tp: int, keys: list[str], transfer_key: str
    ) -> list[Source]:
        """The prefill workers that push a request to this rank (see
        :meth:`sources`), each with its push key: the prefill's scheduler's
        (prefill first, one per prefill worker), or the one the client gave
        both requests (decode first)."""
        return [
            dataclasses.replace(s, key=s.key or transfer_key)
            for s in self.sources(peers, remote_tp, keys)
        ]

    def peer(self, peers: list[list[Any]], remote_tp: int = 0) -> Peer:
        """This rank's prefill worker among a request's (``[host, port,
        cluster_id]`` each, as its params list them); ``remote_tp``: the
        prefill's tensor-parallel size, as its params say (0: not said).
        ``ValueError`` when the params name none for this rank: checked,
        never guessed."""
        if remote_tp < 0:
            raise ValueError("the params' tp_size is not a tensor-parallel size")
        if remote_tp and remote_tp != self.tp_size:
            raise ValueError(
                f"the prefill instance runs tensor parallel size {remote_tp} and this decode "
                f"instance {self.tp_size}: no single prefill worker holds this rank's KV"
            )
        if not isinstance(peers, (list, tuple)):
            raise ValueError(f"the params' prefill workers: a {type(peers).__name__}, not a list")
        try:
            if len(peers) == self.tp_size:
                p = peers[self.rank]
                return Peer(str(p[0]), int(p[1]), int(p[2]))
            if len(peers) == 1 and not remote_tp:
                # One address for a TP engine, no size said (a client's
                # decode-first params): rank r listens on port + r with
                # cluster id + r (the config rule, docs/vllm.md).
                p = peers[0]
                return Peer(str(p[0]), int(p[1]) + self.rank, int(p[2]) + self.rank)
        except (TypeError, LookupError, OverflowError) as exc:
            raise ValueError(f"a prefill worker's address in the params is bad: {exc}") from exc
        raise ValueError(
            f"the params list {len(peers)} prefill workers for this decode instance's "
            f"tensor parallel size {self.tp_size}"
        )

    def sources(self, peers: list[list[Any]], remote_tp: int, keys: list[str]) -> list[Source]:
        """The prefill workers this rank reads a request from, and which heads
        of each block (``peers``, ``remote_tp`` and ``keys`` as the params
        give them). One of the same rank when both sizes are equal; else the
        workers that hold this rank's KV heads. ``ValueError`` for a pair of
        sizes it cannot read across: checked, never guessed."""
        if not remote_tp or remote_tp == self.tp_size:
            return [Source(self.peer(peers, remote_tp), self.grant_key(keys), rank=self.rank)]
        total, mine = self.total_heads, self.heads
        small, big = sorted((max(remote_tp, 0), self.tp_size))
        if remote_tp < 1 or not total or total % remote_tp or big % small:
            raise ValueError(
                f"the prefill instance runs tensor parallel size {remote_tp} and this decode "
                f"instance {self.tp_size}: KV is read across sizes only when one divides the "
                f"other and neither replicates the model's KV heads ({total or 'unknown'}; "
                f"docs/vllm.md)"
            )
        if not isinstance(peers, (list, tuple)) or len(peers) != remote_tp:
            n = len(peers) if isinstance(peers, (list, tuple)) else type(peers).__name__
            raise ValueError(
                f"the params list {n} prefill workers for tensor parallel size {remote_tp}"
            )
        try:
            if len({int(p[2]) for p in peers}) != remote_tp:
                raise ValueError("the params list one prefill worker for two ranks")
        except (TypeError, LookupError, OverflowError) as exc:
            raise ValueError(f"a prefill worker's address in the params is bad: {exc}") from exc
        theirs = total // remote_tp
        lo, hi = self.rank * mine, (self.rank + 1) * mine  # this rank's heads, of the model's
        out = []
        for i in range(lo // theirs, (hi - 1) // theirs + 1):
            a, b = max(lo, i * theirs), min(hi, (i + 1) * theirs)
            try:
                p = peers[i]
                peer = Peer(str(p[0]), int(p[1]), int(p[2]))
            except (TypeError, LookupError, OverflowError, ValueError) as exc:
                raise ValueError(f"a prefill worker's address in the params is bad: {exc}") from exc
            key = str(keys[i]) if len(keys) > i else ""
            span = HeadSpan(theirs, a - i * theirs, a - lo, b - a)
            out.append(Source(peer, key, span, max(1, theirs // mine), i))
        return out

    def _sources_or_none(self, rid: str, ref: Any) -> list[Source]:
        """A drop's or renewal's prefill workers (``ref``: a ``_Drop``)."""
        try:
            if ref.mode == "push":
                return self.push_sources(ref.peers, ref.tp_size, ref.push_keys, ref.transfer_key)
            return self.sources(ref.peers, ref.tp_size, ref.grant_keys)
        except ValueError as exc:
            log.warning("aiokvcache: request %s: %s", rid, exc)
            return []
