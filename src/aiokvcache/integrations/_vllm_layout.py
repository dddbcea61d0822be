"""How vLLM's per-layer KV tensors map onto one aiokvcache blocks cache."""

from __future__ import annotations

import re

import torch

from .agent.kvtypes import KVLayout

__all__ = ["kv_layout"]


def _layer_key(name: str) -> tuple[int, ...]:
    """Sort ``model.layers.10`` after ``model.layers.2``."""
    return tuple(int(x) for x in re.findall(r"\d+", name))


def _block_tensors(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Layer ``name``'s tensor ``t`` as the tensors whose first dimension is
    the block (one, or K and V); ``ValueError`` for any other layout."""
    if t.device.type != "cpu":
        raise ValueError(
            f"kv_caches[{name!r}] is on {t.device}: aiokvcache moves host memory only "
            "(vLLM's CPU backend)"
        )
    if t.dim() >= 2 and t.shape[0] == num_blocks and t.is_contiguous():
        return [t]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks and t.is_contiguous():
        return [t[0], t[1]]
    raise ValueError(
        f"kv_caches[{name!r}]: unsupported KV layout shape={tuple(t.shape)} "
        f"stride={t.stride()} for {num_blocks} blocks: expected a contiguous "
        "[num_blocks, ...] or [2, num_blocks, ...] tensor"
    )


def kv_layout(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
) -> tuple[KVLayout, list[str], list[torch.Tensor]]:
    """How vLLM's per-layer KV tensors map onto one aiokvcache blocks cache.

    Accepted per-layer layouts (all layers alike), block ``b`` contiguous in
    each tensor:

    - ``[num_blocks, ...]``: K and V of a block together (vLLM's CPU
      backend, ``[num_blocks, kv_heads, block_size, 2 * head_size]``;
      FlashInfer's ``[num_blocks, 2, ...]``; MLA): one tensor per layer;
    - ``[2, num_blocks, ...]``: K and V apart (FlashAttention's
      ``[2, num_blocks, block_size, kv_heads, head_size]``): two tensors
      per layer, K then V.

    Returns the layout, the layer names in layer order and the tensors
    (kept alive by the caller while registered). Raises ``ValueError``
    naming the layer for anything else, and for device memory: aiokvcache
    moves host memory.
    """
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    names = sorted(kv_caches, key=_layer_key)
    parts: list[torch.Tensor] = []
    per_layer: int | None = None
    block_bytes: int | None = None
    dtype = None
    for name in names:
        t = kv_caches[name]
        mine = _block_tensors(name, t, num_blocks)
        bb = mine[0].numel() // num_blocks * mine[0].element_size()
        if per_layer is None:
            per_layer, block_bytes, dtype = len(mine), bb, t.dtype
        elif (len(mine), bb, t.dtype) != (per_layer, block_bytes, dtype):
            raise ValueError(f"kv_caches[{name!r}] differs in layout from {names[0]!r}")
        parts.extend(mine)
    assert per_layer is not None and block_bytes is not None
    layout = KVLayout(
        len(names),
        per_layer,
        num_blocks,
        block_bytes,
        block_size,
        tuple(p.data_ptr() for p in parts),
        str(dtype),
    )
    return layout, names, parts
