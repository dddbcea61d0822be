"""LLM-DataDist's ``switch_role_sample.py``, ported to aiokvcache.

Only the prompt listens (26000). The decoder links, pulls blocks [0, 1] of
the prompt's cache into its blocks [0, 2] and unlinks; then the roles swap
— the prompt stops listening, the decoder listens on 26000 (the same port,
on one host) — the prompt links to the decoder, which pushes all its
blocks back; both force-unlink. The changes from the original: ``await``,
``async def`` and ``asyncio.run``; NumPy arrays in HOST memory in place of
NPU tensors; ``dist_barrier`` (blocking, like gloo) in place of
``torch.distributed``. Run both roles, e.g. on one host::

    python examples/llm_datadist/switch_role_sample.py --role p \\
        --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1 &
    python examples/llm_datadist/switch_role_sample.py --role d \\
        --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1

``AIOKVCACHE_TRANSPORT=shm|tcp`` picks the data plane (default: auto).
"""

import argparse
import asyncio
import datetime
import logging
import os

import dist_barrier as dist
import numpy as np

from aiokvcache import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1


def init_process_group(rank, world_size, master_ip, backend="gloo"):
    os.environ["MASTER_ADDR"] = master_ip
    os.environ["MASTER_PORT"] = "29500"
    logging.info(f"init group begin, rank={rank}, world_size={world_size}, master_ip={master_ip}")
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=30)
    )
    logging.info("init group success")


async def init_llm_datadist(role, cluster_id, device_id, local_host_ip, remote_host_ip):
    init_process_group(cluster_id, 2, min(local_host_ip, remote_host_ip))
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{local_host_ip}:26000"
    await datadist.init(llm_config.generate_options())
    logging.info(f"init {role} success, cluster_id={cluster_id}")
    return datadist


def host_cache_desc() -> CacheDesc:
    return CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.HOST,
    )


def cluster_by_id(cluster_id: int) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = cluster_id
    return cluster


async def run_prompt_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    tensor = np.ones((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    tensor2 = np.ones((BLOCKS_NUM, KV_SHAPE), dtype=np.float32)
    cache = cache_manager.register_blocks_cache(
        host_cache_desc(),
        [tensor.ctypes.data, tensor2.ctypes.data],
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
    )
    logging.info("register_blocks_cache success")
    dist.barrier()  # 1: both registered
    logging.info("wait decoder link and pull...")
    dist.barrier()  # 2: the decoder linked, pulled and unlinked (we are blocked meanwhile)

    await datadist.switch_role(LLMRole.DECODER)  # no listen address: stop listening
    logging.info("prompt switch role success")
    dist.barrier()  # 3: our listener is closed
    dist.barrier()  # 4: the decoder listens now

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, 26000)
    cluster.append_remote_ip_info(remote_host_ip, 26000)
    ret, _ = await datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    logging.info("link success, wait decoder push...")
    dist.barrier()  # 5: linked
    dist.barrier()  # 6: the decoder pushed
    logging.info(f"after decoder push, tensor={tensor.tolist()}")
    logging.info(f"after decoder push, tensor2={tensor2.tolist()}")

    ret, _ = await datadist.unlink_clusters([cluster_by_id(DECODER_CLUSTER_ID)], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()
    logging.info("[finalize] success")


async def run_decoder_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    tensor = np.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=np.float32)
    tensor2 = np.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=np.float32)
    cache = cache_manager.register_blocks_cache(
        host_cache_desc(),
        [tensor.ctypes.data, tensor2.ctypes.data],
        BlocksCacheKey(DECODER_CLUSTER_ID, 0),
    )
    logging.info("register_blocks_cache success")
    dist.barrier()  # 1

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, 26000)
    cluster.append_remote_ip_info(remote_host_ip, 26000)
    ret, _ = await datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    await cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    logging.info(f"after pull, tensor={tensor.tolist()}")
    logging.info(f"after pull, tensor2={tensor2.tolist()}")

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_remote_ip_info(remote_host_ip, 26000)
    ret, _ = await datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    dist.barrier()  # 2
    dist.barrier()  # 3: the prompt closed its listener

    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{local_host_ip}:26000"
    await datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    logging.info("decoder link, pull, unlink, switch role success, wait prompt link...")
    dist.barrier()  # 4: we listen
    dist.barrier()  # 5: the prompt linked

    await cache_manager.push_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[0, 1, 2],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
        tensor_num_per_layer=1,
    )
    logging.info("push_blocks success")
    dist.barrier()  # 6

    ret, _ = await datadist.unlink_clusters([cluster_by_id(PROMPT_CLUSTER_ID)], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()
    logging.info("[finalize] success")


async def main(args):
    role = LLMRole.PROMPT if args.role == "p" else LLMRole.DECODER
    cluster_id = PROMPT_CLUSTER_ID if args.role == "p" else DECODER_CLUSTER_ID
    datadist = await init_llm_datadist(
        role, cluster_id, args.device_id, args.local_host_ip, args.remote_host_ip
    )
    if role == LLMRole.PROMPT:
        await run_prompt_sample(datadist, args.local_host_ip, args.remote_host_ip)
    else:
        await run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, help="device id")
    parser.add_argument("--role", type=str, default=1, help="role type, support p/d")
    parser.add_argument("--local_host_ip", type=str, help="local host ip")
    parser.add_argument("--remote_host_ip", type=str, help="remote host ip")
    args = parser.parse_args()
    if args.role not in ["p", "d"]:
        raise RuntimeError("Not supported cluster id")
    if args.device_id not in range(8):
        raise RuntimeError("Not supported device id")
    if args.local_host_ip is None:
        raise RuntimeError("local_host_ip is not set")
    if args.remote_host_ip is None:
        raise RuntimeError("remote_host_ip is not set")
    logging.info(f"Sample start, device_id = {args.device_id}, role = {args.role}")
    asyncio.run(main(args))
    logging.info("Sample end")
