# Environment for every program on the lent H200s: carried packages on the path, NVLink multicast
# off (it can take a shared host's GPUs down; Ray workers and vLLM's engine process inherit these).
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_AUTH_MODE=disabled
export PYTHONUNBUFFERED=1
