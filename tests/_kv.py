"""Helpers for the blocks and layer-wise tests: a linked prompt/decoder pair in one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from aiokvcache import (
    Cache,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

S = LLMStatusCode


def cluster_info(dd: LLMDataDist, cluster_id: int | None = None) -> LLMClusterInfo:
    """Where ``dd`` listens; ``cluster_id`` overrides the id we expect to find there."""
    info = LLMClusterInfo()
    info.remote_cluster_id = dd.cluster_id if cluster_id is None else cluster_id
    assert dd.listen_address is not None
    host, port = dd.listen_address.rsplit(":", 1)
    info.append_remote_ip_info(host, int(port))
    return info


def options(transport: str, listen: bool = False, **extra: Any) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg.generate_options()


@dataclass
class Pair:
    prompt: LLMDataDist  # cluster 1, links to the decoder
    decoder: LLMDataDist  # cluster 2, listens

    @property
    def p(self) -> Any:
        return self.prompt.cache_manager

    @property
    def d(self) -> Any:
        return self.decoder.cache_manager

    def submitted(self) -> int:
        return int(self.prompt._engine.stats()["jobs_submitted"]) + int(
            self.decoder._engine.stats()["jobs_submitted"]
        )

    async def close(self) -> None:
        await self.prompt.finalize()
        await self.decoder.finalize()


async def make_pair(transport: str, **extra: Any) -> Pair:
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    await decoder.init(options(transport, listen=True, **extra))
    prompt = LLMDataDist(LLMRole.PROMPT, 1)
    await prompt.init(options(transport, **extra))
    rc, per = await prompt.link_clusters([cluster_info(decoder)], timeout=5000)
    assert rc == S.LLM_SUCCESS and per == [S.LLM_SUCCESS]
    return Pair(prompt, decoder)


async def pair_fixture(transport: str, **extra: Any) -> AsyncIterator[Pair]:
    pr = await make_pair(transport, **extra)
    yield pr
    await pr.close()
    for dd in (pr.prompt, pr.decoder):
        assert dd._engine.stats()["live_jobs"] == 0


def blocks_desc(layers: int = 3, blocks: int = 16, tokens: int = 4, dim: int = 8) -> CacheDesc:
    """2 tensors (K, V) per layer, ``blocks`` blocks of ``tokens x dim`` fp16."""
    return CacheDesc(2 * layers, [blocks, tokens, dim], DataType.DT_FLOAT16, Placement.HOST)


def fill(cache: Cache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        if t.dtype == np.uint8:
            t[...] = rng.integers(0, 256, t.shape, dtype=np.uint8)
        else:
            t[...] = rng.standard_normal(t.shape).astype(t.dtype)


def snapshot(cache: Cache) -> list[np.ndarray]:
    return [t.copy() for t in cache.tensors]


def same(before: list[np.ndarray], cache: Cache) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(before, cache.tensors, strict=True))


async def assert_still(cache: Cache, wait: float = 0.2) -> None:
    before = snapshot(cache)
    await asyncio.sleep(wait)
    assert same(before, cache), "write after the call returned"


async def status_of(coro: Any) -> LLMStatusCode:
    with pytest.raises(LLMException) as ei:
        await coro
    return ei.value.status_code
