"""vLLM's KV cache groups (its hybrid memory allocator) as the connector moves
them: which groups, which of a group's blocks, and how a decode request's
blocks pair with the prefill's. No vLLM import: the specs are read by name.

A model with sliding-window layers beside full-attention ones (Gemma 2/3,
gpt-oss, Llamas with ``layer_types``) has one group per kind. vLLM lays one
layer of each group over the same memory (a block id belongs to one group at
a time), so a transfer is one list of (prefill block, decode block) pairs,
all groups' together, applied to every memory unit of the layout.

- Full attention: every block of the request; a decode block at position
  ``p`` reads the prefill's block at ``p`` (positions before the decode's
  prefix-cache hit are not read).
- Sliding window of ``w`` tokens: only the last ``ceil(w / block_size) + 1``
  blocks (vLLM's NixlConnector keeps as many): the ones that can still be in
  the window. vLLM has freed the earlier ones (null blocks, id 0) by the time
  the request finishes. The prefill's list ends at its last block position
  (its params' ``remote_num_tokens``); a decode block reads the prefill's
  block of its own position. A position the decode's window needs that the
  prefill no longer holds (the prefill ran past the decode's tokens) fails
  the load.
- Push moves, of a sliding window of ``w`` tokens, the positions the
  decode's next token attends to (from ``(end - w + 1) // block_size``):
  those vLLM keeps until the prefill request ends (it frees earlier ones as
  the prefill runs, so a push reading them could read a reused block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .agent.kvtypes import NULL_BLOCK

__all__ = ["NULL_BLOCK", "KVGroups", "block_groups", "flat_blocks"]


def block_groups(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids as one list per KV cache group: a tuple or list of
    lists (``BlockIds``, or a proxy's JSON of it), or a flat list (one group).
    ``TypeError``/``ValueError`` for anything else (a peer's params)."""
    if not isinstance(block_ids, (list, tuple)):
        raise TypeError(f"block ids: expected a list, got {type(block_ids).__name__}")
    if not block_ids or not isinstance(block_ids[0], (list, tuple)):
        return [_ints(block_ids)]
    return [_ints(g) for g in block_ids]


def _ints(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"block ids: expected a list, got {type(ids).__name__}")
    out = []
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 1 << 62:
            raise ValueError(f"block ids: {b!r} is not a block id")
        out.append(b)
    return out


def flat_blocks(block_ids: Any) -> list[int]:
    """All groups' block ids, group after group (what a prefill holds and
    its grant keys cover)."""
    return [b for g in block_groups(block_ids) for b in g]


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups a connector moves: ``windows[g]`` is how many of
    group ``g``'s last blocks move (0: all, full attention)."""

    windows: tuple[int, ...]
    described: str
    #: Each group's sliding window in tokens (0: full attention), and the block size.
    window_tokens: tuple[int, ...] = (0,)
    block_size: int = 1

    @classmethod
    def of(cls, kv_cache_config: Any, block_size: int) -> KVGroups:
        """From vLLM's ``KVCacheConfig`` (its transfer groups); ``ValueError``
        for a group this connector cannot move (Mamba state, chunked local
        attention, a block size other than ``block_size``)."""
        if kv_cache_config is None:
            return cls((0,), "", (0,), block_size)
        windows: list[int] = []
        tokens: list[int] = []
        kinds: list[str] = []
        for g in kv_cache_config.transfer_groups:
            spec = g.kv_cache_spec
            kind = type(spec).__name__
            bs = int(getattr(spec, "block_size", block_size))
            if bs != block_size:
                raise ValueError(
                    f"AioKVConnector: KV cache group {kind} has block size {bs}, the "
                    f"cache {block_size}: groups of different block sizes are not supported"
                )
            if kind == "SlidingWindowSpec":
                w = int(spec.sliding_window)
                windows.append(-(-w // bs) + 1)
                tokens.append(w)
                kinds.append(f"sw{w}")
            elif kind in ("FullAttentionSpec", "MLAAttentionSpec"):
                windows.append(0)
                tokens.append(0)
                kinds.append("full")
            else:
                raise ValueError(
                    f"AioKVConnector moves full-attention and sliding-window KV cache "
                    f"groups; this model has a {kind} group (docs/vllm.md)"
                )
        if not windows:
            raise ValueError("AioKVConnector: the model has no KV cache group to transfer")
        plain = windows == [0]
        described = "" if plain else ",".join(kinds)
        return cls(tuple(windows), described, tuple(tokens), block_size)

    @property
    def plain(self) -> bool:
        """One full-attention group: every block moves, by position (push works)."""
        return self.windows == (0,)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """A finished prefill request's transfer groups' blocks (vLLM's
        ``select_transfer_block_ids`` already applied): what moves of each."""
        if len(block_ids) != len(self.windows):
            raise ValueError(
                f"{len(block_ids)} block lists for {len(self.windows)} KV cache groups"
            )
        return [self._clip(g, list(ids)) for g, ids in enumerate(block_ids)]

    def _clip(self, g: int, ids: list[int]) -> list[int]:
        w = self.windows[g]
        if not w:
            return ids
        return [b for b in ids if b != NULL_BLOCK][-w:]

    def push_spans(
        self, local: Sequence[Sequence[int]], first: int, last: int, end: int
    ) -> tuple[list[int], list[list[int]]]:
        """D, push: the blocks a decode request registers (``local``, one full
        list per group, positions ``[first, last)`` to load, its tokens ending
        at ``end``), one group's after another, and ``[first, count]`` of each
        group's positions: a full-attention group's from ``first``, a sliding
        window's from the first block its next token attends to (what the
        prefill pushes of it). ``ValueError`` for a window block vLLM freed."""
        if len(local) != len(self.windows):
            raise ValueError(f"{len(local)} block lists for {len(self.windows)} KV cache groups")
        flat: list[int] = []
        spans: list[list[int]] = []
        for g, w in enumerate(self.window_tokens):
            f = min(last, max(first, (end - w + 1) // self.block_size)) if w else first
            mine = list(local[g][f:last])
            if len(mine) != last - f or (w and NULL_BLOCK in mine):
                raise ValueError(
                    f"group {g}: no block of its own at each of positions [{f}, {last})"
                )
            flat += mine
            spans.append([f, last - f])
        return flat, spans

    def pair(
        self,
        local: Sequence[Sequence[int]],
        first: int,
        last: int,
        remote: Sequence[Sequence[int]],
        remote_blocks: int | None = None,
        end_tokens: int | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """A decode request's load: its blocks ``local`` (one full list per
        group, positions ``[first, last)`` to load, its tokens ending at
        ``end_tokens``, default ``last`` whole blocks) against the prefill's
        ``remote`` (as its params give them; its lists end at position
        ``remote_blocks``, default a full-attention group's length, else
        ``last``). Returns the prefill's blocks flat (what its grant key
        covers), the indexes in it that are read, and the local blocks they
        are read into, each pair of one position. ``ValueError`` when the
        prefill's lists cannot hold what the decode needs."""
        if len(remote) != len(self.windows) or len(local) != len(self.windows):
            raise ValueError(
                f"the prefill's block ids are {len(remote)} KV cache groups, this "
                f"instance's {len(self.windows)}"
            )
        if remote_blocks is None:
            full = [len(r) for w, r in zip(self.windows, remote, strict=True) if not w]
            remote_blocks = full[0] if full else last
        end = last * self.block_size if end_tokens is None else end_tokens
        flat: list[int] = []
        picks: list[int] = []
        into: list[int] = []
        for g, w in enumerate(self.windows):
            off, rem, mine = len(flat), list(remote[g]), list(local[g])
            flat += rem
            if not w:
                if last > len(rem):
                    raise ValueError(
                        f"blocks [{first}, {last}) of a request of {len(rem)} remote blocks"
                    )
                picks += range(off + first, off + last)
                into += mine[first:last]
                continue
            start = remote_blocks - len(rem)  # the position of the prefill's rem[0]
            if start < 0:
                raise ValueError(f"{len(rem)} window blocks of a request of {remote_blocks}")
            # Tokens before this are out of the decode's first window: not needed.
            need = max(0, end - self.window_tokens[g]) // self.block_size
            kept = [p for p in range(first, last) if mine[p] != NULL_BLOCK][-w:]
            for p in kept:
                if start <= p < remote_blocks:
                    picks.append(off + p - start)
                    into.append(mine[p])
                elif p >= need:
                    raise ValueError(
                        f"window block {p}: the prefill holds positions "
                        f"[{start}, {remote_blocks}) of its window"
                    )
        return flat, picks, into
