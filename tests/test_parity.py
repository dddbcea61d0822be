"""LLM-DataDist parity: the behaviours its own samples rely on (issue: the
samples run with nothing changed but ``await``).

Each test names the LLM-DataDist behaviour it checks; ``docs/api.md`` lists
the deliberate differences that remain.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np
import pytest

from aiokvcache import (
    BlocksCacheKey,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)
from aiokvcache.testing import Pair, blocks_desc, cluster_info, fill, options
from support.guards import engine_of

S = LLMStatusCode


def info_for(cluster_id: int) -> LLMClusterInfo:
    """A cluster by id alone: what a forced unlink needs in LLM-DataDist."""
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    return info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_switch_role_moves_the_listener_and_refuses_while_linked(pair: Pair) -> None:
    dec = pair.decoder
    with pytest.raises(LLMException) as ei:
        await dec.switch_role(LLMRole.PROMPT)
    assert ei.value.status_code == S.LLM_EXIST_LINK
    assert "unlink" in ei.value.message
    assert dec.listen_address is not None  # refused: nothing changed
    rc, _ = await pair.prompt.unlink_clusters([cluster_info(dec)])
    assert rc == S.LLM_SUCCESS
    for _ in range(200):  # the decoder drops its side when told
        if not dec._links:
            break
        await asyncio.sleep(0.01)
    port = int(dec.listen_address.rsplit(":", 1)[1])
    # A server becoming a client stops listening: its port is free again.
    await dec.switch_role(LLMRole.PROMPT)
    assert dec.listen_address is None and dec.role == LLMRole.PROMPT
    assert can_bind(port)
    # A client becoming a server listens where llm.listenIpInfo says.
    new_port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{new_port}"
    await dec.switch_role(LLMRole.DECODER, cfg.generate_options())
    assert dec.listen_address == f"127.0.0.1:{new_port}"
    await dec.switch_role(LLMRole.DECODER, cfg.generate_options())  # same address: kept
    assert dec.listen_address == f"127.0.0.1:{new_port}"
    # And peers link to it there.
    rc, per = await pair.prompt.link_clusters([cluster_info(f"127.0.0.1:{new_port}", 2)])
    assert per == [S.LLM_SUCCESS], per
    with pytest.raises(TypeError, match="switch_options"):
        await pair.prompt.switch_role(LLMRole.PROMPT, [("llm.listenIpInfo", "x")])  # type: ignore[arg-type]


async def test_switch_role_bind_failure_says_it_once(pair: Pair) -> None:
    await pair.prompt.unlink_clusters([cluster_info(pair.decoder)])
    taken = pair.decoder.listen_address
    assert taken is not None
    cfg = LLMConfig()
    cfg.listen_ip_info = taken
    for _ in range(200):
        if not pair.prompt._links:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(LLMException) as ei:
        await pair.prompt.switch_role(LLMRole.DECODER, cfg.generate_options())
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    assert ei.value.message.count("cannot listen") == 1, ei.value.message


@pytest.mark.parametrize("order", ["prompt-first", "decoder-first", "together"])
async def test_both_sides_force_unlink_in_any_order(pair: Pair, order: str) -> None:
    # LLM-DataDist: force=True tears down the local side only; each side calls it.
    p_info = cluster_info(pair.decoder)
    d_info = info_for(1)
    pair.d.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(2, 0))
    src = pair.p.allocate_blocks_cache(blocks_desc())
    if order == "together":
        (rc1, _), (rc2, _) = await asyncio.gather(
            pair.prompt.unlink_clusters([p_info], force=True),
            pair.decoder.unlink_clusters([d_info], force=True),
        )
    else:
        first, second = (pair.prompt, pair.decoder)
        infos = (p_info, d_info)
        if order == "decoder-first":
            first, second, infos = second, first, (d_info, p_info)
        rc1, _ = await first.unlink_clusters([infos[0]], force=True)
        rc2, _ = await second.unlink_clusters([infos[1]], force=True)
    assert (rc1, rc2) == (S.LLM_SUCCESS, S.LLM_SUCCESS)
    assert not pair.prompt._links and not pair.decoder._links
    with pytest.raises(LLMException) as ei:
        await pair.p.push_blocks(BlocksCacheKey(2, 0), src, src_blocks=[0], dst_blocks=[0])
    assert ei.value.status_code == S.LLM_NOT_YET_LINK
    rc, _ = await pair.prompt.link_clusters([p_info])  # and they link again
    assert rc == S.LLM_SUCCESS


async def test_force_unlink_breaks_the_peer_side_until_it_unlinks(pair: Pair) -> None:
    pair.d.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(2, 0))
    src = pair.p.allocate_blocks_cache(blocks_desc())
    await pair.p.push_blocks(BlocksCacheKey(2, 0), src, src_blocks=[1], dst_blocks=[1])
    rc, _ = await pair.decoder.unlink_clusters([info_for(1)], force=True)
    assert rc == S.LLM_SUCCESS
    for _ in range(200):
        link = pair.prompt._links.get(2)
        if link is None or link.broken:
            break
        await asyncio.sleep(0.01)
    link = pair.prompt._links.get(2)
    assert link is not None and link.broken  # kept, broken: LLM-DataDist keeps its entity
    with pytest.raises(LLMException) as ei:
        await pair.p.push_blocks(BlocksCacheKey(2, 0), src, src_blocks=[1], dst_blocks=[1])
    assert ei.value.status_code == S.LLM_LINK_FAILED
    rc, per = await pair.prompt.unlink_clusters([cluster_info(pair.decoder)], force=True)
    assert per == [S.LLM_SUCCESS]


async def test_link_and_unlink_of_no_clusters_is_param_invalid(pair: Pair) -> None:
    assert await pair.prompt.link_clusters([]) == (S.LLM_PARAM_INVALID, [])
    assert await pair.prompt.unlink_clusters([]) == (S.LLM_PARAM_INVALID, [])


class Yes(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def test_transfer_cache_async_blocks_without_indices_moves_block_zero(pair: Pair) -> None:
    # LLM-DataDist sends no block lists and its engine copies the first block.
    desc = blocks_desc(layers=2, blocks=3)
    dst = pair.d.register_blocks_cache(
        desc, [np.zeros(desc.shape, np.float16) for _ in range(4)], BlocksCacheKey(2, 0)
    )
    src = pair.p.allocate_blocks_cache(desc)
    fill(src, 5)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))
    task = await pair.p.transfer_cache_async(src, Yes(), [cfg])
    assert await task.get_results() == [S.LLM_SUCCESS]
    for i in (0, 1):  # layer 0: K and V
        got, want = np.asarray(dst.tensors[i]), np.asarray(src.tensors[i])
        assert np.array_equal(got[0], want[0])
        assert not got[1:].any()
    for i in (2, 3):  # layer 1 was not asked for
        assert not np.asarray(dst.tensors[i]).any()


def test_llm_config_has_every_llm_datadist_property() -> None:
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.global_resource_config = "{}"
    cfg.deploy_res_path = "/x"
    cfg.buf_pool_cfg = "{}"
    cfg.cluster_info = '{"cluster_id": 0}'
    cfg.output_max_size = 10
    cfg.mem_utilization = 0.9
    cfg.enable_switch_role = True
    assert cfg.generate_options() == {
        "llm.LocalCommRes": "",
        "llm.TransferBackend": "hixl",
        "llm.RdmaTrafficClass": "132",
        "llm.RdmaServiceLevel": "4",
        "llm.GlobalResourceConfig": "{}",
        "llm.deployResPath": "/x",
        "llm.BufPoolCfg": "{}",
        "llm.ClusterInfo": '{"cluster_id": 0}',
        "llm.OutputMaxSize": "10",
        "llm.MemoryUtilization": "0.9",
        "llm.EnableSwitchRole": "1",
    }
    assert cfg.options == cfg.generate_options()
    assert (cfg.local_comm_res, cfg.transfer_backend, cfg.mem_utilization) == ("", "hixl", 0.9)
    assert LLMConfig().mem_utilization == 0.95 and LLMConfig().enable_switch_role is False
    with pytest.raises(ValueError, match="rdma_traffic_class"):
        cfg.rdma_traffic_class = 256
    with pytest.raises(ValueError, match="rdma_service_level"):
        cfg.rdma_service_level = 8
    with pytest.raises(ValueError, match="mem_utilization"):
        cfg.mem_utilization = 1.5
    with pytest.raises(ValueError, match="cluster_info"):
        cfg.cluster_info = "{not json"
    with pytest.raises(TypeError, match="local_comm_res"):
        cfg.local_comm_res = 1  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        cfg.enable_swich_role = True  # type: ignore[attr-defined]  # a typo is not dropped


async def test_init_names_options_without_effect_once(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.rdma_service_level = 4
    opts = {**options(transport), **cfg.generate_options(), "llm.NoSuchKey": "1"}
    with caplog.at_level(logging.INFO, logger="aiokvcache"):
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(opts)
    lines = [r.getMessage() for r in caplog.records]
    no_effect = [m for m in lines if "no effect" in m]
    assert len(no_effect) == 1, lines
    assert "ge.exec.deviceId" in no_effect[0] and "llm.LocalCommRes" in no_effect[0]
    assert "ge.session_device_id" not in no_effect[0]  # the library's own companion key
    assert not any("ignoring" in m for m in lines), lines
    unknown = [m for m in lines if "unknown option" in m]
    assert len(unknown) == 1 and "llm.NoSuchKey" in unknown[0]


async def test_rdma_qos_options_reach_ucx_where_it_has_ib(transport: str) -> None:
    cfg = LLMConfig()
    cfg.rdma_traffic_class = 104
    cfg.rdma_service_level = 3
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({**options(transport), **cfg.generate_options()})
        ucx = engine_of(dd).ucx_config()
        if "IB_SL" in ucx:  # a UCX build with its IB transport
            assert "IB_SL=3" in ucx.replace(" ", "") and "IB_TRAFFIC_CLASS=104" in ucx
        else:
            pytest.skip("this UCX has no IB transport: the options are accepted, no effect")


async def test_copy_cache_takes_req_id(pair: Pair) -> None:
    desc = blocks_desc()
    a, b = pair.p.allocate_cache(desc), pair.p.allocate_cache(desc)
    fill(a, 1)
    await pair.p.copy_cache(b, a, 0, 0, 0, -1, 7)
    assert np.array_equal(np.asarray(b.tensors[0])[0], np.asarray(a.tensors[0])[0])
    with pytest.raises(ValueError, match="req_id"):
        await pair.p.copy_cache(b, a, req_id=-1)


async def test_transport_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ported code sets no aiokvcache keys: the environment picks the transport.
    monkeypatch.setenv("AIOKVCACHE_TRANSPORT", "tcp")
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({})
        assert "tcp" in engine_of(dd).ucx_config().split("TLS=")[1].split()[0]
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:  # the option wins
        await dd.init(options("shm"))
        assert "tcp" not in engine_of(dd).ucx_config().split("TLS=")[1].split()[0]
    monkeypatch.setenv("AIOKVCACHE_TRANSPORT", "carrier-pigeon")
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException, match="AIOKVCACHE_TRANSPORT") as ei:
        await dd.init({})
    assert ei.value.status_code == S.LLM_PARAM_INVALID
    await dd.finalize()
