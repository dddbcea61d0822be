"""LLM-DataDist's ``push_cache_sample.py``, ported to aiokvcache.

The decoder pushes batch slot 0 of its two-tensor cache into the prompt's
cache (id 1, slot 0), then unlinks; both roles listen. The changes from the
original: ``await``, ``async def`` and ``asyncio.run``; NumPy arrays in HOST
memory in place of NPU tensors; ``dist_barrier`` (blocking, like gloo) in
place of ``torch.distributed``. Run both roles, e.g. on one host::

    python examples/llm_datadist/push_cache_sample.py --role p \\
        --local_host_ip 127.0.0.1 --remote_host_ip 127.0.0.1 &
    python examples/llm_datadist/push_cache_sample.py --role d \\
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
    CacheDesc,
    CacheKeyByIdAndIndex,
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


async def init_llm_datadist(role, cluster_id, args) -> LLMDataDist:
    init_process_group(cluster_id, 2, min(args.local_host_ip, args.remote_host_ip))
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = args.device_id
    llm_config.local_comm_res = ""
    if args.transfer_backend == "hixl":
        llm_config.transfer_backend = "hixl"
    elif args.transfer_backend:
        raise RuntimeError(f"unsupported transfer_backend: {args.transfer_backend}")
    port = 26000 if role == LLMRole.PROMPT else 26001
    llm_config.listen_ip_info = f"{args.local_host_ip}:{port}"
    if args.local_comm_res:
        llm_config.local_comm_res = args.local_comm_res
        logging.info(f"local_comm_res={llm_config.local_comm_res}")
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


async def run_prompt_sample(datadist):
    cache_manager = datadist.cache_manager
    tensor = np.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=np.float32)
    tensor2 = np.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=np.float32)
    cache = cache_manager.register_cache(
        host_cache_desc(), [tensor.ctypes.data, tensor2.ctypes.data]
    )
    logging.info("register_cache success")
    dist.barrier()  # 1: both registered
    dist.barrier()  # 2: the decoder pushed (we are blocked here meanwhile)
    logging.info(f"after decoder push, tensor={tensor.tolist()}")
    logging.info(f"after decoder push, tensor2={tensor2.tolist()}")
    dist.barrier()  # 3: the decoder unlinked
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def run_decoder_sample(datadist, local_host_ip, remote_host_ip):
    cache_manager = datadist.cache_manager
    tensor = np.full((BLOCKS_NUM, KV_SHAPE), 1, dtype=np.float32)
    tensor2 = np.full((BLOCKS_NUM, KV_SHAPE), 1, dtype=np.float32)
    cache = cache_manager.register_cache(
        host_cache_desc(), [tensor.ctypes.data, tensor2.ctypes.data]
    )
    logging.info("register_cache success")
    dist.barrier()  # 1

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, 26001)
    cluster.append_remote_ip_info(remote_host_ip, 26000)
    ret, _ = await datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    # The prompt's first registered cache has id 1.
    cache_key = CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0)
    await cache_manager.push_cache(cache_key, cache, src_batch_index=0)
    logging.info("push_cache success")
    dist.barrier()  # 2

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_remote_ip_info(remote_host_ip, 26000)
    ret, _ = await datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    dist.barrier()  # 3

    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def main(args):
    role = LLMRole.PROMPT if args.role == "p" else LLMRole.DECODER
    cluster_id = PROMPT_CLUSTER_ID if args.role == "p" else DECODER_CLUSTER_ID
    datadist = await init_llm_datadist(role, cluster_id, args)
    if role == LLMRole.PROMPT:
        await run_prompt_sample(datadist)
    else:
        await run_decoder_sample(datadist, args.local_host_ip, args.remote_host_ip)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, help="device id")
    parser.add_argument("--role", type=str, default=1, help="role type, support p/d")
    parser.add_argument("--local_host_ip", type=str, help="local host ip")
    parser.add_argument("--remote_host_ip", type=str, help="remote host ip")
    parser.add_argument("--local_comm_res", type=str, help="set local comm res if you need")
    parser.add_argument(
        "--transfer_backend",
        type=str,
        default="",
        help="transfer backend, set hixl to use hixl, default is adxl",
    )
    args = parser.parse_args()
    if args.role not in ["p", "d"]:
        raise RuntimeError("Not supported cluster id")
    if args.device_id not in range(8):
        raise RuntimeError("Not supported device id")
    if args.role == "d":
        if args.local_host_ip is None:
            raise RuntimeError("local_host_ip is not set")
        if args.remote_host_ip is None:
            raise RuntimeError("remote_host_ip is not set")
    logging.info(f"Sample start, device_id = {args.device_id}, role = {args.role}")
    asyncio.run(main(args))
    logging.info("Sample end")
