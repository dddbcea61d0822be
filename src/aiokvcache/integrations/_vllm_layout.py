"""How vLLM's per-layer KV tensors map onto one aiokvcache blocks cache."""

from __future__ import annotations

import dataclasses
import itertools
import re

import torch

from .agent.kvtypes import KVLayout

__all__ = ["by_heads", "kv_layout"]


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
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    groups: str = "",
    windows: tuple[int, ...] = (0,),
) -> tuple[KVLayout, list[list[str]], list[torch.Tensor]]:
    """How vLLM's per-layer KV tensors map onto one aiokvcache blocks cache.

    Per-layer layouts (all layers alike), block ``b`` contiguous in each tensor:

    - ``[num_blocks, ...]``: K and V of a block together (vLLM's CPU
      backend, ``[num_blocks, kv_heads, block_size, 2 * head_size]``;
      FlashInfer's ``[num_blocks, 2, ...]``; MLA): one tensor per layer;
    - ``[2, num_blocks, ...]``: K and V apart (FlashAttention's
      ``[2, num_blocks, block_size, kv_heads, head_size]``): two tensors
      per layer, K then V.

    Layers whose tensors are the same memory (vLLM's hybrid allocator lays
    one layer of each KV cache group over one allocation: a block id belongs
    to one group at a time) are one *unit* of the layout, moved once.
    ``groups`` describes the KV cache groups (in the digest: both sides must
    group alike), ``windows`` each one's sliding window in tokens (0: none).

    Returns the layout (a "layer" of it is a unit), each unit's layer names
    (units in layer order) and the tensors (kept alive while registered).
    Raises ``ValueError`` naming the layer for anything else, for tensors that
    overlap without being the same, and for device memory (host memory only).
    """
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    names = sorted(kv_caches, key=_layer_key)
    parts: list[torch.Tensor] = []
    units: list[list[str]] = []
    unit_of: dict[tuple[int, ...], int] = {}
    shape: tuple[int, int, torch.dtype] | None = None  # tensors a layer, block bytes, dtype
    for name in names:
        t = kv_caches[name]
        mine = _block_tensors(name, t, num_blocks)
        mine_shape = (len(mine), mine[0].numel() // num_blocks * mine[0].element_size(), t.dtype)
        if shape is None:
            shape = mine_shape
        elif mine_shape != shape:
            raise ValueError(f"kv_caches[{name!r}] differs in layout from {names[0]!r}")
        key = tuple(m.data_ptr() for m in mine)
        if key in unit_of:
            units[unit_of[key]].append(name)
            continue
        unit_of[key] = len(units)
        units.append([name])
        parts.extend(mine)
    assert shape is not None
    per_layer, block_bytes, dtype = shape
    _check_disjoint(parts, num_blocks * block_bytes, units, per_layer)
    addrs = tuple(p.data_ptr() for p in parts)
    layout = KVLayout(
        len(units), per_layer, num_blocks, block_bytes, block_size, addrs, str(dtype), groups,
        windows=tuple(windows),
    )  # fmt: skip
    return layout, units, parts


def by_heads(
    layout: KVLayout, kv_caches: dict[str, torch.Tensor], total_heads: int, tp: int
) -> KVLayout:
    """``layout`` in KV-head units when no head of the model's ``total_heads``
    is replicated across the ``tp`` ranks and every tensor is ``[num_blocks,
    heads, block_size, ...]``, ``heads`` a rank's (vLLM's CPU layout,
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``: a head's part of a
    block is contiguous); else as it is (instances must then be of one
    tensor-parallel size)."""
    heads = total_heads // tp
    if layout.tensors_per_layer != 1 or heads < 1 or total_heads % tp:
        return layout
    bs = layout.block_size
    if any(t.dim() != 4 or tuple(t.shape[1:3]) != (heads, bs) for t in kv_caches.values()):
        return layout
    if layout.block_bytes % heads:
        return layout
    return dataclasses.replace(layout, heads=heads, total_heads=total_heads)


def _check_disjoint(
    parts: list[torch.Tensor], size: int, units: list[list[str]], per_layer: int
) -> None:
    """Distinct units must not share bytes (a write to one would land in another)."""
    spans = sorted((p.data_ptr(), i // per_layer) for i, p in enumerate(parts))
    for (a, ua), (b, ub) in itertools.pairwise(spans):
        if b < a + size:
            raise ValueError(
                f"kv_caches[{units[ub][0]!r}] overlaps kv_caches[{units[ua][0]!r}] "
                "without being the same memory"
            )
