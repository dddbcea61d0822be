"""SGLang's transfer-backend classes over aiokvcache (imported by SGLang
through :func:`aiokvcache.integrations.sglang.register`).

The control plane is SGLang's own (``common/conn.py``: the bootstrap
server, each rank's ZMQ socket, the status and abort messages, the decode's
heartbeat to the prefill); the data plane is aiokvcache (:mod:`.engine`):
each rank's KV pages and aux rows are blocks caches of a rank-local
``LLMDataDist``, and the prefill pushes a request's pages, then its aux row,
then reports Success. What is ours on the wire (Common leaves both to the
backend): the decode's registration, ``[b"AKV_REG", ip, port, session,
engine host, engine port, engine cluster id, JSON row sizes]``, and its
per-request metadata, ``[room, ip, port, session, int32 page ids, aux row,
destinations, decode prefix]``.

What the scheduler calls never waits for the network: ``send`` posts a
chunk to the engine's thread, ``poll`` reads a dict. Decode KV release is
deferred (``supports_deferred_decode_kv_release``): after a failure or an
abort the decode keeps the request's pages until the prefill acknowledges
that none of its pushes can write any more.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import sys
import threading
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from .engine import Buffers, Peer, RankEngine

__all__ = ["AioKVBootstrapServer", "AioKVManager", "AioKVReceiver", "AioKVSender"]

log = logging.getLogger("aiokvcache.sglang")

REG_TAG = b"AKV_REG"
#: Rooms a prefill remembers as aborted, for a decode's metadata that comes after.
ABORTED_ROOMS = 4096
#: Rooms a prefill rank tells requests apart in, the newest (an older room's
#: results count for whichever request holds it, as if never taken again).
MAX_REQUESTS = 65536
#: Decode ranks a prefill rank keeps registrations of (the oldest go first).
MAX_REGISTRATIONS = 1024
#: The largest registration shape and page list a prefill reads from a decode.
MAX_SHAPE_BYTES = 64 << 10
MAX_PAGE_BYTES = 16 << 20


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _lower_switch_interval(setting: str) -> None:
    """The scheduler runs busy Python while it steps, and Python hands the
    GIL to another thread only every switch interval (5 ms by default):
    each hop of a push through the engine's thread would wait that long.
    Lowered to ``setting`` seconds (never raised); ``"none"`` leaves it."""
    if setting.strip().lower() == "none":
        return
    try:
        value = float(setting)
    except ValueError:
        log.warning("aiokvcache: AIOKVCACHE_SGLANG_SWITCH_INTERVAL=%r is not a number", setting)
        return
    if 0 < value < sys.getswitchinterval():
        sys.setswitchinterval(value)


@dataclasses.dataclass
class _Registration:
    """A decode rank, as its registration names it."""

    peer: Peer
    refused: str  # why its layout cannot take our pages ("" if it can)
    kv_rows: int  # pages in each of its KV buffers
    aux_rows: int  # rows in each of its aux buffers


@dataclasses.dataclass
class _Destination:
    """Where one decode rank wants a request's pages and aux row."""

    endpoint: str
    dst_port: int
    session: str
    kv: np.ndarray
    aux: int | None
    required_dst_info_num: int
    decode_prefix_len: int

    @property
    def is_dummy(self) -> bool:
        return self.aux is None and len(self.kv) == 0

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> _Destination:
        kv = np.frombuffer(msg[4], dtype=np.int32).copy() if msg[4] else np.zeros(0, np.int32)
        return cls(
            endpoint=msg[1].decode("ascii"),
            dst_port=int(msg[2]),
            session=msg[3].decode("ascii"),
            kv=kv,
            aux=int(msg[5]) if msg[5] else None,
            required_dst_info_num=int(msg[6]),
            decode_prefix_len=int(msg[7]) if len(msg) > 7 and msg[7] else 0,
        )


class AioKVManager(CommonKVManager):  # type: ignore[misc]
    """A scheduler rank's transfer manager: its aiokvcache engine and SGLang's sockets."""

    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.attn_tp_size != 1 or self.pp_size != 1 or self.attn_cp_size != 1:
            raise ValueError(
                "aiokvcache's SGLang backend supports tensor, pipeline and context "
                "parallel size 1 only (for now)"
            )
        if args.state_types:
            raise ValueError("aiokvcache's SGLang backend does not move state buffers (yet)")
        if str(getattr(server_args, "device", "cpu")) != "cpu":
            raise ValueError("aiokvcache's SGLang backend moves KV pools in host memory only (yet)")
        kv = Buffers.of(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        aux = Buffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        self.engine = RankEngine(
            kv,
            aux,
            host=self.local_ip,
            transport=os.environ.get("AIOKVCACHE_SGLANG_TRANSPORT", "auto"),
            timeout=_env_float("AIOKVCACHE_SGLANG_TIMEOUT", 20.0),
        )
        self.engine.start()
        _lower_switch_interval(os.environ.get("AIOKVCACHE_SGLANG_SWITCH_INTERVAL", "0.0002"))
        self.session_id = f"{self.local_ip}:{self.rank_port}"
        self._lock = threading.Lock()  # the room counters below
        self._waiting_last: dict[int, int] = {}  # rooms whose last chunk is in flight
        # Status messages go out in order from one thread: a send to a dead
        # decode may wait out the socket's timeout, never on the engine's.
        self._status = concurrent.futures.ThreadPoolExecutor(1, "aiokvcache-sglang-status")
        self._registrations: collections.OrderedDict[str, _Registration] = collections.OrderedDict()
        # Rooms aborted here, newest last: a decode whose metadata arrives
        # after the abort is told at once (it would wait out its timeout).
        self._aborted: collections.OrderedDict[int, None] = collections.OrderedDict()
        # room -> its current request (a token each sender makes): the
        # results of an earlier request's pushes are told from its own.
        self._requests: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._stopped = False
        target = self._prefill_loop if self._is_prefill else self._decode_loop
        threading.Thread(target=target, name="aiokvcache-sglang-ctl", daemon=True).start()
        if not self._is_prefill:
            self._start_heartbeat_checker_thread()

    @property
    def _is_prefill(self) -> bool:
        return bool(self.disaggregation_mode == DisaggregationMode.PREFILL)

    def _shape(self) -> dict[str, list[int]]:
        return {"kv": self.engine.kv.shape(), "aux": self.engine.aux.shape()}

    def _registration(self) -> dict[str, list[int]]:
        """Our buffers' row sizes and how many rows (pages) each kind has."""
        return {**self._shape(), "rows": [self.engine.kv.rows(), self.engine.aux.rows()]}

    # ------------------------------------------------------------ decode

    def build_receiver_registration_message(self) -> list[bytes]:
        host, port = self.engine.address.rsplit(":", 1)
        return [
            REG_TAG, self.local_ip.encode(), str(self.rank_port).encode(),
            self.session_id.encode(), host.encode(), port.encode(),
            str(self.engine.cluster_id).encode(), json.dumps(self._registration()).encode(),
        ]  # fmt: skip

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: Any,
        aux_index: int | None,
        state_indices: Any,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: Any = None,
    ) -> list[bytes]:
        pages = b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes()
        aux = b"" if is_dummy or aux_index is None else str(int(aux_index)).encode()
        return [
            str(bootstrap_room).encode(), self.local_ip.encode(), str(self.rank_port).encode(),
            self.session_id.encode(), pages, aux, str(required_dst_info_num).encode(),
            str(decode_prefix_len or 0).encode(),
        ]  # fmt: skip

    def _decode_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None or self.handle_abort_ack_message(msg):
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                continue
            room, status, rank, reason = parsed
            self.apply_prefill_status(
                bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason
            )

    # ------------------------------------------------------------ prefill

    def _prefill_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if not msg:
                continue
            try:
                if msg[0] == ABORT_TAG:
                    self._on_abort(msg)
                elif msg[0] == REG_TAG:
                    self._on_registration(msg)
                else:
                    self._on_metadata(msg)
            except Exception as exc:  # a peer's bytes: this loop must go on
                log.warning("aiokvcache: dropped a malformed message from a decode: %r", exc)

    def _on_registration(self, msg: list[bytes]) -> None:
        if len(msg) != 8 or len(msg[7]) > MAX_SHAPE_BYTES:
            raise ValueError("a registration of the wrong size")
        session = msg[3].decode("ascii")
        if session != f"{msg[1].decode('ascii')}:{int(msg[2])}":
            raise ValueError("a registration whose session is not its address")
        peer = Peer(msg[4].decode("ascii"), int(msg[5]), int(msg[6]))
        theirs = json.loads(msg[7])
        if not isinstance(theirs, dict) or not isinstance(theirs.get("rows"), list):
            raise ValueError("a registration without its buffers' row sizes and counts")
        rows = [int(r) for r in theirs["rows"]]
        shape = {"kv": theirs.get("kv"), "aux": theirs.get("aux")}
        refused = ""
        if shape != self._shape() or len(rows) != 2:
            refused = (
                f"aiokvcache: the decode's buffers ({shape}) are not laid out as the "
                f"prefill's ({self._shape()}): same model, dtype and page size on both sides?"
            )
            log.error("%s (decode %s)", refused, session)
            rows = [0, 0]
        with self._lock:
            dropped = [r.peer for r in (self._registrations.get(session),) if r is not None]
            self._registrations[session] = _Registration(peer, refused, rows[0], rows[1])
            self._registrations.move_to_end(session)
            while len(self._registrations) > MAX_REGISTRATIONS:
                dropped.append(self._registrations.popitem(last=False)[1].peer)
            kept = {r.peer.cluster_id for r in self._registrations.values()}
        for old in dropped:
            if old.cluster_id not in kept:  # a restarted or forgotten decode rank
                self.engine.forget(old)
        if not refused:
            self.engine.link(peer)  # ahead of its first request

    def _on_metadata(self, msg: list[bytes]) -> None:
        if len(msg) != 8 or len(msg[4]) > MAX_PAGE_BYTES:
            raise ValueError("request metadata of the wrong size")
        room = int(msg[0])
        dest = _Destination.from_zmq(msg)
        if room in self._aborted:
            self._send_status([(dest.endpoint, dest.dst_port)], room, "aborted on the prefill")
            return
        if dest.required_dst_info_num != 1:
            why = "aiokvcache: one decode rank per request only (tensor parallel size 1)"
            self._send_status([(dest.endpoint, dest.dst_port)], room, why)
            return
        infos = self.transfer_infos.setdefault(room, {})
        if infos:  # its decode rank is set (a replay or a second claim: ignored)
            log.warning("aiokvcache: room %d already has its decode rank; dropped another", room)
            return
        infos[dest.session] = dest
        self.req_to_decode_prefix_len[room] = dest.decode_prefix_len
        self.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, msg: list[bytes]) -> None:
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        room = note.room
        target = note.deferred_ack_target()
        with self._lock:  # no chunk is posted between this and the count's check
            status = self.request_status.get(room)
            if status is not None and status != KVPoll.Success:
                self._record(room, "aborted by the decode")
                self.update_status(room, KVPoll.Failed)
            self.engine.cancel(room)
            if target is not None:
                self.register_deferred_ack_target(room, target)
            acks = self._drained_acks(room)
        if acks:
            self._status.submit(self._send_abort_acks, room, acks)
        elif target is None and note.decode_ip is not None and note.decode_port is not None:
            ack = [ABORT_ACK_TAG, str(room).encode("ascii")]
            endpoint = f"tcp://{note.decode_ip}:{note.decode_port}"
            self._status.submit(self._send_multipart_locked, endpoint, ack)

    def _drained_acks(self, room: int) -> Any:
        """Under ``_lock``: the room's ACK targets if none of its pushes can
        write any more (taken: each is sent once), else None."""
        if self._staging_outstanding.get(room, 0) > 0:
            return None
        if room in self._deferred_ack_poisoned_rooms:
            self._deferred_ack_targets.pop(room, None)
            return None
        return self._deferred_ack_targets.pop(room, None)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        *,
        wait_event: Any = None,
        indices_event: Any = None,
        trace_ctx: Any = None,
    ) -> None:
        """A chunk the scheduler computed: post its pushes (never waits on the network)."""
        for event in (wait_event, indices_event):
            if event is not None:
                event.synchronize()  # the chunk's KV is written (a GPU stream's event)
        src_all = np.asarray(
            kv_indices.cpu().numpy() if hasattr(kv_indices, "cpu") else kv_indices, np.int64
        )
        room = bootstrap_room
        with self._lock:  # an abort is handled wholly before or after this
            failed = self._post_chunk(room, src_all, index_slice, is_last_chunk, aux_index)
        if failed:
            self._conclude(room, False, failed)

    def _post_chunk(
        self, room: int, src_all: Any, index_slice: slice, last: bool, aux_index: int | None
    ) -> str:
        """Under ``_lock``: count and post the chunk's push; why it cannot be, or ""."""
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return ""
        dest = next(iter(self.transfer_infos.get(room, {}).values()), None)
        if dest is None:
            return ""
        if dest.is_dummy:
            if last:
                self.update_status(room, KVPoll.Success)
            return ""
        reg = self._registrations.get(dest.session)
        if reg is None or reg.refused:
            return reg.refused if reg else f"aiokvcache: decode {dest.session} never registered"
        dst = dest.kv[index_slice].astype(np.int64)
        src = src_all[: len(dst)]
        dst = dst[: len(src)]
        aux = None
        if last:
            if aux_index is None or dest.aux is None:
                return "aiokvcache: the last chunk has no aux row"
            aux = (int(aux_index), int(dest.aux))
        rows = (reg.kv_rows, reg.aux_rows)
        # The result counts for this request only: a room taken again by a
        # new request (SGLang's re-bootstrap resets its counts) is not
        # concluded, counted down or ACKed by the earlier one's pushes.
        request = self._requests.get(room)
        on_result = functools.partial(self._on_result, request=request)
        try:
            self.engine.push(room, reg.peer, (src, dst), aux, on_result, rows)
        except (ValueError, RuntimeError) as exc:
            return f"aiokvcache: {exc}"
        if last:
            self._waiting_last[room] = 1
        self._staging_outstanding[room] += 1
        return ""

    def _on_result(
        self, room: int, ok: bool, reason: str, last: bool, request: object = None
    ) -> None:
        """A chunk's pushes ended, and can write no more (on the engine's
        thread); ``request``: the room's request when it was posted."""
        conclude: bool | None = None
        with self._lock:
            current = self._requests.get(room)
            if current is not None and current is not request:
                log.debug("aiokvcache: room %d: an earlier request's push ended", room)
                return
            left = self._staging_outstanding.get(room, 0) - 1
            if left > 0:
                self._staging_outstanding[room] = left
            else:
                self._staging_outstanding.pop(room, None)
            if not ok:
                conclude = False
            elif last and self._waiting_last.pop(room, None) is not None:
                conclude = True
            acks = self._drained_acks(room) if left <= 0 else None
        if acks:
            self._status.submit(self._send_abort_acks, room, acks)
        if conclude is not None:
            self._conclude(room, conclude, reason)

    def _record(self, room: int, reason: str) -> None:
        """Keep the first cause of a live room's failure (a cleared room's is dropped)."""
        with self.failure_lock:
            if room in self.request_status:
                self.failure_records.setdefault(room, reason)

    def _send_status(self, targets: list[tuple[str, int]], room: int, reason: str) -> None:
        """Failed, to ``targets``, from the status thread (in order)."""
        self._status.submit(
            self.send_kv_status_message, targets=targets, bootstrap_room=room,
            status=KVPoll.Failed, failure_reason=reason,
        )  # fmt: skip

    def _conclude(self, room: int, ok: bool, reason: str) -> None:
        """Tell the room's decode rank how it ended. A failure's targets are
        read now: the scheduler may clear the room before the status thread runs."""
        if ok:
            self._status.submit(self.conclude_transfer, bootstrap_room=room, status=KVPoll.Success)
            return
        with self._lock:
            self._waiting_last.pop(room, None)
        targets = self._room_notify_targets(room)
        self._record(room, reason)
        self.update_status(room, KVPoll.Failed)
        if targets:
            self._send_status(targets, room, reason)

    def aborted(self, room: int) -> None:
        """``room`` was aborted here: stop its pushes, tell its decode rank
        (now, or when its metadata comes)."""
        with self._lock:
            self._aborted[room] = None
            self._aborted.move_to_end(room)
            while len(self._aborted) > ABORTED_ROOMS:
                self._aborted.popitem(last=False)
            self.engine.cancel(room)
            targets = self._room_notify_targets(room)
        if targets:
            self._send_status(targets, room, "aborted on the prefill")

    def new_request(self, room: int) -> None:
        """A sender takes ``room`` for a new request: the earlier request's
        abort is forgotten, and its pushes' results are its own."""
        with self._lock:
            self._aborted.pop(room, None)
            self._requests[room] = object()
            self._requests.move_to_end(room)
            while len(self._requests) > MAX_REQUESTS:
                self._requests.popitem(last=False)
        self.engine.reopen(room)

    def teardown(self) -> None:
        self._stopped = True
        self.engine.close()
        self._status.shutdown(wait=False)


class AioKVSender(CommonKVSender):  # type: ignore[misc]
    """A request's prefill side; on an abort its pushes stop and its decode is told."""

    supports_host_tensor_indices = False

    def __init__(self, mgr: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(mgr, *args, **kwargs)
        if isinstance(mgr, AioKVManager):  # a room used again (SGLang's re-bootstrap)
            mgr.new_request(self.bootstrap_room)

    def abort(self) -> None:
        super().abort()
        mgr = self.kv_mgr
        if isinstance(mgr, AioKVManager):
            mgr.aborted(self.bootstrap_room)

    def clear(self) -> None:
        mgr = self.kv_mgr
        if isinstance(mgr, AioKVManager) and self.conclude_state != KVPoll.Success:
            mgr.engine.cancel(self.bootstrap_room)
        super().clear()


class AioKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """A request's decode side: SGLang's, unchanged."""


class AioKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """The prefill's bootstrap server: SGLang's, unchanged."""
