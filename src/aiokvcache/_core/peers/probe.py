"""The data-path probe of a link, and our key to the peer's control region.

A link is up only once its data path moved bytes both ways. Two ways to
prove it, both one probe per side over its own endpoint:

* **put probe** (both sides new): each side puts a nonce into a probe slot
  of the other's control region, and each finds the other's nonce in its own
  slot. The initiator sends its nonce and the slot with ``probe_back``; the
  acceptor answers once its own put is done and it found the initiator's
  nonce, with the nonce it put, which the initiator then finds. One job a
  side (a put and its flush).
* **read-back probe**: each side puts a nonce into the peer's slot and reads
  it back (a put, then a get). Used with a peer that does not offer put
  probes (``put_probe`` in its handshake's probe slot), or that asks for it.

The probe also installs the link's key to the peer's control region, which
the retirement guards of the peer's caches need.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

import numpy as np

from ..._bridge import OP_GET, OP_PUT
from ..._loader import native
from ..memory.ctlregion import PROBE_BYTES
from ..memory.state import Lease, Link, State
from ..model.errors import LLMException
from ..wire.messages import PROBE_NONCE_BYTES, BadReply, ProbeInfo, ProbeSlot, ask
from .servicethread import ReleaseWatch, ServiceThread, until

__all__ = ["PROBE_MAX_S", "Prober", "new_nonce", "offers_put_probe"]

# The longest probe a peer may ask of us (probe_back); longer asks are cut.
PROBE_MAX_S = 30.0


def new_nonce() -> bytes:
    """A fresh probe nonce (never all zeros: an unused slot holds zeros)."""
    while True:
        nonce = secrets.token_bytes(PROBE_NONCE_BYTES)
        if any(nonce):
            return nonce


def offers_put_probe(slot: object) -> bool:
    """Whether a probe slot from the peer's handshake offers put probes."""
    return isinstance(slot, dict) and slot.get("put_probe") is True


class Prober:
    """Probes a link's data path over our endpoint (service loop)."""

    def __init__(self, state: State, thread: ServiceThread) -> None:
        self._state = state
        self._thread = thread
        self._releases = ReleaseWatch(state.engine)

    def close(self) -> None:
        """Stop watching the engine's releases (service loop, at finalize)."""
        self._releases.close()

    def probe_info(self) -> ProbeSlot:
        """A probe slot of ours for the peer, and the key to our control region."""
        ctl = self._state.ctl
        return ProbeSlot(ctl.probe_slot(), PROBE_BYTES, ctl.base, ctl.size, ctl.rkey)

    def probe_payload(self) -> dict[str, Any]:
        """:meth:`probe_info` as the handshake carries it (``LocalInfo.probe``),
        saying that we take put probes."""
        return {**self.probe_info().encode(), "put_probe": True}

    def install_ctl(self, link: Link, slot: ProbeSlot) -> tuple[int, int]:
        """Unpack the peer's control-region key once per link (ValueError when
        the region moved). Returns (the peer's probe slot address, our rkey id
        for it)."""
        st = self._state
        base, span = slot.base, slot.span
        if link.ctl_rkey is None:
            rkey = st.engine.rkey_unpack(link.ep, slot.rkey, base, span)
            with st.lock:
                if link.ctl_rkey is None:
                    link.ctl_rkey, link.ctl_span = rkey, (base, span)
                    rkey = -1
            if rkey != -1:  # a concurrent probe installed it first
                with contextlib.suppress(native.NativeError):
                    st.engine.rkey_release(rkey)
        elif (base, span) != link.ctl_span:
            raise ValueError("the peer's control region moved")
        assert link.ctl_rkey is not None
        return slot.addr, link.ctl_rkey

    async def probe(self, link: Link, timeout: float) -> str:
        """Move a nonce to the peer and back over our endpoint; '' or what failed.

        Both sides' buffers are probe slots in the two control regions, which
        live as long as their engines: a put or get that outlives this probe
        (a frozen peer) can never land in memory that was reused. Our jobs
        hold a lease on our control region like any transfer's on a cache.
        """
        st = self._state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout  # the whole probe, every step
        target = await self._peer_slot(link, timeout)
        if isinstance(target, str):
            return target
        peer_slot, rkey = target
        local = st.ctl.probe_slot()
        nonce = new_nonce()
        st.ctl.write(local, nonce + bytes(PROBE_NONCE_BYTES))
        ms = max(1, int(min(timeout, PROBE_MAX_S) * 1000))
        put = [[local, peer_slot, PROBE_NONCE_BYTES, rkey]]
        get = [[local + PROBE_NONCE_BYTES, peer_slot, PROBE_NONCE_BYTES, rkey]]
        for what, op, rows in (("put", OP_PUT, put), ("get", OP_GET, get)):
            left = max(deadline - loop.time(), 0.001)
            problem = await self._probe_job(link, what, op, rows, ms, left)
            if problem:
                return problem
        if st.ctl.read(local + PROBE_NONCE_BYTES, PROBE_NONCE_BYTES) != nonce:
            return "the bytes did not make the round trip (a put or get failed)"
        return ""

    async def half(self, link: Link, timeout: float, nonce: bytes = b"") -> tuple[str, int]:
        """Our half of a link's data-path check, over our endpoint: a put
        probe of ``nonce`` when one is given, else a read-back probe. Returns
        ('' or what failed, the address of the peer's slot a put probe put
        into, for the peer to look in; 0 for a read-back probe)."""
        if nonce:
            return await self._put_probe(link, nonce, timeout)
        return await self.probe(link, timeout), 0

    async def _put_probe(self, link: Link, nonce: bytes, timeout: float) -> tuple[str, int]:
        """Put ``nonce`` into the peer's probe slot (one job, done once the
        peer has it)."""
        st = self._state
        target = await self._peer_slot(link, timeout)
        if isinstance(target, str):
            return target, 0
        peer_slot, rkey = target
        local = st.ctl.probe_slot()
        st.ctl.write(local, nonce)
        ms = max(1, int(min(timeout, PROBE_MAX_S) * 1000))
        rows = [[local, peer_slot, PROBE_NONCE_BYTES, rkey]]
        return await self._probe_job(link, "put", OP_PUT, rows, ms, timeout), peer_slot

    async def nonce_arrived(self, link: Link, slot: int, nonce: bytes, timeout: float) -> str:
        """'' once the peer's ``nonce`` is in our probe slot at ``slot`` (its
        put may still be on the way: then we look again, for ``timeout`` s at
        most), or what is wrong."""
        ctl = self._state.ctl
        wrong = self.bad_nonce_slot(slot, nonce)
        if wrong:
            return wrong

        def arrived() -> bool:
            return link.broken or ctl.read(slot, PROBE_NONCE_BYTES) == nonce

        if not await until(arrived, timeout, fine=True) or link.broken:
            return "the nonce put never arrived"
        return ""

    def bad_nonce_slot(self, slot: int, nonce: bytes) -> str:
        """What is wrong with a peer's word that it put ``nonce`` into our
        probe slot at ``slot`` ('' when nothing is)."""
        if not self._state.ctl.is_probe_slot(slot):
            return "the slot named is no probe slot here"
        if not any(nonce):
            return "the nonce named is empty"
        return ""

    async def _peer_slot(self, link: Link, timeout: float) -> tuple[int, int] | str:
        """The peer's probe slot to put into and our key to it, or what failed."""
        try:
            # The first probe of a link takes the slot the peer's handshake
            # gave; any later one (a peer's repeated probe_back) asks for a
            # slot of its own, so that no two share one.
            given, link.conn.peer_probe = link.conn.peer_probe, None
            if given is None:
                slot = await ask(link.conn, ProbeInfo(), timeout)
            elif isinstance(given, dict):
                slot = ProbeSlot.decode(given)
            else:
                raise BadReply("the peer sent a bad probe buffer")
        except (LLMException, ValueError) as exc:
            return f"no probe buffer from the peer ({exc})"
        try:
            return self.install_ctl(link, slot)
        except ValueError as exc:
            return f"the peer's probe buffer is unusable ({exc})"
        except native.NativeError as exc:
            return f"our endpoint to the peer cannot take its key ({exc})"

    async def _probe_job(
        self, link: Link, what: str, op: int, rows: list[list[int]], ms: int, timeout: float
    ) -> str:
        """One probe job, under a lease on our control region; '' or what failed."""
        st = self._state
        segs = np.array(rows, dtype=np.uint64)
        try:
            lease = st.lease((st.ctl,), lambda: [st.engine.submit(op, link.ep, segs, b"", ms)])
        except (native.NativeError, LLMException) as exc:
            return f"the probe's {what} could not start ({exc})"
        try:
            # Woken by the engine's release signal: a link's set-up waits on
            # its put and its get in turn, and polls saw each about 1 ms late
            # (the default backoff up to 4 ms).
            if not await self._releases.until(lambda: st.leases_over((lease,)), timeout):
                return f"the probe's {what} did not end in time"
        finally:
            if st.leases_over((lease,)):
                st.end_lease(lease)
            else:  # the engine ends it (its deadline passed): then give it back
                self._thread.spawn(self._end_when_over(lease))
        return ""

    async def _end_when_over(self, lease: Lease) -> None:
        await until(lambda: self._state.leases_over((lease,)))
        self._state.end_lease(lease)
