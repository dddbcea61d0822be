"""What the vLLM connector's transfer agent and its sides share: the KV
layout, a peer's address, a failed transfer, and block-run arithmetic."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GRACE_S",
    "RUNS_PER_PART",
    "KVLayout",
    "Peer",
    "TransferFailed",
    "block_digest",
    "block_runs",
]

#: Extra time a grant (pull) or D's wait (push) lasts beyond ``timeout``.
GRACE_S = 5.0
#: Block-id runs per registration notification (keeps each tag under 4 KiB).
RUNS_PER_PART = 200


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache as aiokvcache sees it.

    ``addrs`` holds ``num_layers * tensors_per_layer`` host addresses, layer
    by layer (a "layer" is one memory unit: layers of several KV cache groups
    laid over the same memory are one); in each tensor block ``b`` is bytes ``[b*block_bytes,
    (b+1)*block_bytes)``. ``block_size`` is in tokens.
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

    def digest(self) -> str:
        """What both sides must agree on (not the block count nor addresses)."""
        key = "/".join(
            map(str, (self.num_layers, self.tensors_per_layer, self.block_bytes, self.block_size))
        )
        key += f"/{self.dtype}"
        if self.groups:
            key += f"/groups={self.groups}"
        return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Peer:
    """Where a remote worker's aiokvcache engine listens."""

    host: str
    port: int
    cluster_id: int


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
