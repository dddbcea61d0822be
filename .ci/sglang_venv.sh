#!/usr/bin/env bash
# A CPU-only SGLang 0.5.23 venv, as ../shared/recipes/sglang-cpu/build_venv.sh
# builds it: torch 2.13's CPU build (pip takes it from this machine's wheel
# directory); sglang pins torch 2.14.1 and CUDA-only packages, so it goes in
# without its dependencies, then the pure-Python ones. PyPI's torchvision is a
# CUDA build whose compiled part cannot load beside the CPU torch: its
# _meta_registrations.py is emptied. Then Mooncake's non-CUDA transfer engine
# (the mooncake_tcp baseline) and the P/D router. About 3 minutes, 3 GB.
set -euo pipefail
V=${1:?usage: sglang_venv.sh VENV_DIR}
python3 -m venv "$V"
P="timeout 900 $V/bin/python -m pip install --quiet"
$P --upgrade pip
$P torch==2.13.0
$P --no-deps sglang==0.5.23
$P --no-deps torchvision==0.28.0
$P aiohttp fastapi "uvicorn>=0.51" uvloop orjson "pyzmq>=25.1.2" msgspec pydantic psutil \
  requests numpy "transformers==5.19.0" safetensors setproctitle pybase64 prometheus-client \
  python-multipart interegular partial_json_parser xxhash einops tqdm packaging pillow \
  "openai==2.8.0" scipy blobfile distro watchfiles "python-dateutil<3" regex zstandard tiktoken \
  triton ipython dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
  gguf jsonschema "xgrammar==0.2.7" "soundfile==0.13.1"
echo "# emptied: CUDA torchvision's _C cannot load beside CPU torch" \
  > "$V/lib/python3.11/site-packages/torchvision/_meta_registrations.py"
$P mooncake-transfer-engine-non-cuda sglang-router==0.3.2
