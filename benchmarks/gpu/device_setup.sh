#!/usr/bin/env bash
# Set up the lent H200 machine one carried chunk per call (the device tool carries <= 64 MiB a call
# and keeps /tmp only while the machine stays warm, so every chunk is copied to /tmp at once).
#
# Here, once: bash benchmarks/gpu/prepare_carry.sh   (downloads and splits into .carry/, git-ignored)
# There, one call each, back to back, naming the chunk in `carry`:
#   g1 (.carry/g1)  vLLM's small dependency wheels
#   g2 [DIR]        every wheel in DIR (default .carry/g2: ray trimmed, megatron-core, ...); a TE torch
#                   sdist there starts its build in the background
#   part FILE       any split part (.carry/vparts/vllm.partNN, .carry/teparts/te.partNN) -> /tmp/parts
#   vllm            join and install vLLM 0.26.0 (sha256 checked)
#   te              join TE core, wait for the extension build, install TE in one --target install
# Every program then runs under `source benchmarks/gpu/device_env.sh`.
set -euo pipefail
SITE=/tmp/site
mkdir -p "$SITE" /tmp/parts /tmp/te_wheels
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$@"; }

case "$1" in
  g1)
    pipi .carry/g1/*.whl ;;
  g2|wheels)
    dir=${2:-.carry/g2}
    wheels=()
    for w in "$dir"/*.whl; do
      case $(basename "$w") in
        transformer_engine-*) cp "$w" /tmp/te_wheels/ ;;  # joins TE core and extension in one install
        *) wheels+=("$w") ;;
      esac
    done
    pipi "${wheels[@]}"
    if ls "$dir"/transformer_engine_torch-*.tar.gz >/dev/null 2>&1; then
      rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild && tar -xzf "$dir"/transformer_engine_torch-*.tar.gz -C /tmp/tebuild
      nv=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])')
      ( cd /tmp/tebuild/transformer_engine_torch-* && \
        CUDA_HOME=/usr/local/cuda CPATH="$nv/cudnn/include:$nv/nccl/include" NVTE_FRAMEWORK=pytorch \
        NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 MAX_JOBS=16 \
        setsid nohup python3 -m pip wheel --no-build-isolation --no-deps --no-index -w /tmp/te_wheels . \
          > /tmp/te_build.log 2>&1 & )
    fi ;;
  part)
    cp "$2" /tmp/parts/ ;;
  vllm)
    cat /tmp/parts/vllm.part* > /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
    echo "$VLLM_SHA256  /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" | sha256sum -c -
    pipi /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl ;;
  te)
    cat /tmp/parts/te.part* > /tmp/te_wheels/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    echo "$TE_SHA256  /tmp/te_wheels/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl" | sha256sum -c -
    for _ in $(seq 120); do ls /tmp/te_wheels/transformer_engine_torch-*.whl >/dev/null 2>&1 && break; sleep 2; done
    ls /tmp/te_wheels/transformer_engine_torch-*.whl || { tail -30 /tmp/te_build.log; exit 1; }
    pipi /tmp/te_wheels/*.whl ;;
  *)
    echo "unknown step $1" >&2; exit 2 ;;
esac
echo "step $1 ok"
