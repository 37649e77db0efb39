#!/usr/bin/env bash
# Download, trim and group on this machine what SGLang 0.5.17's offline Engine
# (sglang.srt.entrypoints.engine.Engine: generate with log-probs, update_weights_from_tensor /
# _from_distributed, release_/resume_memory_occupation) needs on the lent GPU machine, which has
# Python 3.12, torch 2.11.0+cu130, transformers 5.17 and the rest listed in ../shared/gpu/VLLM_ON_H200.md.
# python 3.12 manylinux wheels, fetched with `pip download` only. Output in .carry/ (git-ignored).
# Findings and the Engine arguments to use: ../shared/gpu/SGLANG_CARRY.md (read from the wheels, not yet run).
#
#   .carry/sglang/          every downloaded wheel, untouched
#   .carry/sglang/trimmed/  sglang and sglang-kernel with the unused binaries taken out
#   .carry/sglang/g1/       small wheels: sglang-only extras + the subset of vLLM's g1 that sglang imports
#   .carry/sglang/g2/       sglang, sglang-kernel (trimmed) and flashinfer-python
#   .carry/sglang_parts/    any wheel still over 60 MiB, split (none with the default trims)
# Each of g1 and g2 is one call's carry (< 64 MiB). Install both in ONE
#   pip install --no-index --no-deps --no-compile --target /tmp/site <g1/*.whl> <g2/*.whl>
#
# --no-shared   leave out the wheels vLLM's g1 already brings (same versions), for a machine
#               where benchmarks/gpu/device_setup.sh g1 has run
# KEEP_SM100=1  keep sgl_kernel/sm100/common_ops (only needed on Blackwell; H100/H200 load sm90/)
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared/gpu}
PLAT=$(cat "$SHARED/pip-platform-flags.txt")
PINS="$SHARED/vllm-0.26.0-lean-pins.txt"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$@"; }
D=.carry/sglang
mkdir -p "$D/trimmed" "$D/g1" "$D/g2" .carry/sglang_parts
echo '*' > .carry/.gitignore  # ignored from inside: works in a worktree too, whose .git is a file
rm -f "$D"/g1/*.whl "$D"/g2/*.whl .carry/sglang_parts/*.part*

# The three big ones (sglang pins the kernel and flashinfer versions; engine.py checks both at start).
dl "$D" sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
# sglang-only small wheels: what sglang (or flashinfer) imports at module level that neither the image
# nor vLLM's g1 has. torchvision (the +cu130 build of torch 2.11) and sentencepiece are insurance: both
# are imported unconditionally, and the image probably has them (drop them if `import` works there).
EXTRAS=(torch-memory-saver==0.0.10 nvidia-ml-py==13.615.71 ipython==9.18.1 pygments==2.21.0
        traitlets==5.16.1 gguf==0.19.0 orjson==3.13.0 ninja==1.13.2 torchvision==0.26.0 sentencepiece==0.2.3)
dl "$D" "${EXTRAS[@]}"
# The part of vLLM's g1 that sglang imports (same versions as vLLM's carry, so shared with it).
SHARED_NAMES=(pyzmq msgspec pybase64 pydantic pydantic-core annotated-types typing-inspection fastapi
              starlette uvicorn openai httpx2 httpcore2 truststore sniffio jiter xgrammar apache-tvm-ffi
              compressed-tensors loguru partial-json-parser dill setproctitle)
if [ "${1:-}" != "--no-shared" ]; then
  reqs=()
  for n in "${SHARED_NAMES[@]}"; do reqs+=("$(grep -i "^$n==" "$PINS")"); done
  dl "$D" "${reqs[@]}"
fi

# sglang-kernel: FlashAttention 3 (flash_ops, 1.1 GB unpacked: attention_backend="fa3", Hopper's default,
# so pass attention_backend="triton"), FlashMLA and InfLLM-v2 (MLA/sparse models only) are loaded
# lazily and leave; sm100/common_ops too unless KEEP_SM100=1 (load_utils.py picks sm90/ on cc 9.0).
kpat=('^sgl_kernel/flash_ops\.abi3\.so$' '^sgl_kernel/flashmla_ops\.abi3\.so$' '^sgl_kernel/infllm_ops\.')
[ "${KEEP_SM100:-0}" = 1 ] || kpat+=('^sgl_kernel/sm100/common_ops\.')
python3 benchmarks/gpu/trim_wheel.py "$D"/sglang_kernel-0.4.5-*.whl \
  "$D/trimmed/$(basename "$D"/sglang_kernel-0.4.5-*.whl)" "${kpat[@]}"
# sglang: the Rust HTTP server and gRPC cores (`sglang serve` / grpc only), the diffusion package.
python3 benchmarks/gpu/trim_wheel.py "$D"/sglang-0.5.17-*.whl "$D/trimmed/$(basename "$D"/sglang-0.5.17-*.whl)" \
  '^sglang/srt/server/_core\.' '^sglang/srt/grpc/_core\.' '^sglang/multimodal_gen/'

cp "$D"/trimmed/*.whl "$D"/flashinfer_python-0.6.15.post1-*.whl "$D/g2/"
for w in "$D"/*.whl; do
  case $(basename "$w") in sglang-0.5.17-*|sglang_kernel-*|flashinfer_python-*) ;; *) cp "$w" "$D/g1/" ;; esac
done
if [ "${1:-}" = "--no-shared" ]; then  # a rerun after a full one leaves the shared wheels in $D: drop them
  for n in "${SHARED_NAMES[@]}"; do rm -f "$D/g1/$(echo "$n" | tr - _)"-[0-9]*.whl; done
fi

# Anything over 60 MiB goes out of its group into parts (none with the trims above).
LIMIT=$((60 * 1024 * 1024))
for w in "$D"/g1/*.whl "$D"/g2/*.whl; do
  if [ "$(stat -c %s "$w")" -gt "$LIMIT" ]; then
    b=$(basename "$w"); stem=${b%%-*}
    split -b 60M -d "$w" ".carry/sglang_parts/$stem.part"
    echo "SPLIT $b -> .carry/sglang_parts/$stem.part*  sha256 of the joined wheel: $(sha256sum "$w" | cut -d' ' -f1)"
    rm "$w"
  fi
done
for g in g1 g2; do
  sz=$(du -cb "$D/$g"/*.whl | tail -1 | cut -f1)
  echo "$g: $(ls "$D/$g" | wc -l) wheels, $((sz / 1024 / 1024)) MiB"
  [ "$sz" -lt $((63 * 1024 * 1024)) ] || echo "WARNING: $g is over one call's 64 MiB" >&2
done
for w in "$D"/g2/*.whl; do echo "SHA256 $(sha256sum "$w" | cut -d' ' -f1)  $(basename "$w")"; done
nparts=$(ls .carry/sglang_parts | wc -l)
total=$(du -cb "$D"/g1/*.whl "$D"/g2/*.whl $( [ "$nparts" -gt 0 ] && echo .carry/sglang_parts/* ) | tail -1 | cut -f1)
echo "total to carry: $((total / 1024 / 1024)) MiB in $(ls "$D"/g1 "$D"/g2 | grep -c whl) wheels, $nparts parts"
