"""What the vLLM connector's transfer agent and its sides share: the KV
layout, a peer's address, a failed transfer, and block-run arithmetic."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GRACE_S",
    "NULL_BLOCK",
    "RUNS_PER_PART",
    "HeadSpan",
    "KVLayout",
    "Peer",
    "Source",
    "TransferFailed",
    "block_digest",
    "block_runs",
    "head_units",
]

#: Extra time a grant (pull) or D's wait (push) lasts beyond ``timeout``.
GRACE_S = 5.0
#: Block-id runs per registration notification (keeps each tag under 4 KiB).
RUNS_PER_PART = 200
#: vLLM's null block: a placeholder for a freed (out-of-window) block.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache as aiokvcache sees it.

    ``addrs`` holds ``num_layers * tensors_per_layer`` host addresses, layer
    by layer (a "layer" is one memory unit: layers of several KV cache groups
    laid over the same memory are one); in each tensor block ``b`` is bytes
    ``[b*block_bytes, (b+1)*block_bytes)``. ``block_size`` is in tokens.

    ``heads``: the KV heads a block holds one after another (``[num_blocks,
    heads, ...]``, vLLM's CPU layout), each ``unit_bytes`` long. The engine
    registers the cache in those units, so that an instance of another
    tensor-parallel size can read or write a head range of a block.
    ``total_heads``: the model's KV heads over all ranks (0: not head-major,
    tensor-parallel sizes must then be equal).
    """

    num_layers: int
    tensors_per_layer: int
    num_blocks: int
    block_bytes: int
    block_size: int
    addrs: tuple[int, ...]
    dtype: str = "?"
    #: The KV cache groups (vLLM's hybrid allocator), "" for one: part of the digest.
    groups: str = ""
    heads: int = 1
    total_heads: int = 0
    #: Each KV cache group's sliding window in tokens (0: full attention).
    windows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if len(self.addrs) != self.num_layers * self.tensors_per_layer:
            raise ValueError(
                f"addrs has {len(self.addrs)} entries, expected "
                f"{self.num_layers} layers x {self.tensors_per_layer} tensors"
            )
        if min(self.num_layers, self.tensors_per_layer, self.num_blocks) < 1:
            raise ValueError("a KV layout needs at least one layer, tensor and block")
        if self.block_bytes < 1 or self.block_size < 1:
            raise ValueError("block_bytes and block_size must be positive")
        if self.heads < 1 or self.block_bytes % self.heads:
            raise ValueError(f"{self.block_bytes} bytes a block is not {self.heads} heads")
        if self.total_heads and self.total_heads % self.heads:
            raise ValueError(f"{self.total_heads} KV heads in all is not {self.heads} a rank")

    @property
    def unit_bytes(self) -> int:
        """The bytes of one KV head of one block: the unit the engine registers."""
        return self.block_bytes // self.heads

    def units(self, block_ids: Sequence[int], head: int = 0, count: int = 0) -> list[int]:
        """The registered units of heads ``[head, head + count)`` (all: 0) of
        each of ``block_ids``, in order."""
        return head_units(block_ids, self.heads, head, count or self.heads - head)

    def digest(self, per_rank: bool = False) -> str:
        """What both sides must agree on (not the block count nor addresses);
        ``per_rank``: also the heads a block holds (a push writes whole
        blocks: both sides of one tensor-parallel size)."""
        # Head-major: the bytes of one head and the model's heads, so that
        # instances of different tensor-parallel sizes agree.
        unit = self.unit_bytes if self.total_heads else self.block_bytes
        key = "/".join(map(str, (self.num_layers, self.tensors_per_layer, unit, self.block_size)))
        key += f"/{self.dtype}"
        if self.total_heads:
            key += f"/kvheads={self.total_heads}"
        if self.groups:
            key += f"/groups={self.groups}"
        if per_rank:
            key += f"/heads={self.heads}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def head_units(block_ids: Sequence[int], heads: int, head: int, count: int) -> list[int]:
    """The units (one KV head of one block, a cache of ``heads`` a block) of
    heads ``[head, head + count)`` of each of ``block_ids``, in order."""
    if not 0 <= head < head + count <= heads:
        raise ValueError(f"heads [{head}, {head + count}) of a block of {heads}")
    if heads == 1:
        return [int(b) for b in block_ids]
    return [int(b) * heads + head + k for b in block_ids for k in range(count)]


@dataclass(frozen=True)
class HeadSpan:
    """What a pull reads of each block: ``count`` KV heads from the prefill's
    head ``remote_head`` (its blocks hold ``remote_heads``) into this side's
    heads from ``local_head`` (tensor-parallel sizes that differ)."""

    remote_heads: int
    remote_head: int
    local_head: int
    count: int


@dataclass(frozen=True)
class Peer:
    """Where a remote worker's aiokvcache engine listens."""

    host: str
    port: int
    cluster_id: int


@dataclass(frozen=True)
class Source:
    """A prefill worker a load reads from: ``key`` its grant key for the
    request (pull) or push key (push), ``span`` what of each block (None:
    whole blocks, one tensor-parallel size), ``readers`` how many decode
    workers read the request from it, ``rank`` its tensor-parallel rank (a
    push's transfer id names it)."""

    peer: Peer
    key: str = ""
    span: HeadSpan | None = None
    readers: int = 1
    rank: int = 0


class TransferFailed(Exception):
    """One request's transfer failed; ``reason`` is one of the load failure
    reasons the metrics count."""

    def __init__(self, message: str, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


def block_runs(ids: Sequence[int]) -> list[list[int]]:
    """``[start, count]`` runs of consecutive ids, in order."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([int(b), 1])
    return runs


def block_digest(layout: KVLayout, block_ids: Sequence[int]) -> str:
    """A hash of blocks ``block_ids`` of ``layout``'s memory, every layer, in order."""
    h = hashlib.blake2b(digest_size=16)
    for addr in layout.addrs:
        for b in block_ids:
            h.update(ctypes.string_at(addr + int(b) * layout.block_bytes, layout.block_bytes))
    return h.hexdigest()
