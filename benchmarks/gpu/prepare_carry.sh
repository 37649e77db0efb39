#!/usr/bin/env bash
# Download and split, on this machine, what benchmarks/gpu/device_setup.sh installs on the H200
# (python 3.12 manylinux wheels, fetched with `pip download` only). Output in .carry/ (git-ignored
# by its own .gitignore). `--te` adds TransformerEngine's wheels (megatron's TE layer spec).
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared/gpu}
PLAT=$(cat "$SHARED/pip-platform-flags.txt")
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$@"; }
mkdir -p .carry/{lean,te,ray,trimmed,g1,g2,vparts,teparts}
echo '*' > .carry/.gitignore  # ignored from inside: works in a worktree too, whose .git is a file
dl .carry/lean -r "$SHARED/vllm-0.26.0-lean-pins.txt"
dl .carry/ray ray==2.60.0 xxhash==3.6.0
# FlashAttention 2's kernels (sm_80 only: the H200 runs FlashAttention 3) and the Rust frontend binary of
# `vllm serve` (nothing here serves HTTP) leave: 151 MiB, three parts that fit a call beside the tree
python3 benchmarks/gpu/trim_wheel.py .carry/lean/vllm-0.26.0-*.whl .carry/trimmed/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl \
  '^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$' '^vllm/vllm-rs$'
python3 benchmarks/gpu/trim_wheel.py .carry/ray/ray-2.60.0-*.whl .carry/trimmed/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl \
  '^ray/jars/' '^ray/dashboard/client/build/'
find .carry/lean -name '*.whl' ! -name 'vllm-*' -exec cp {} .carry/g1/ \;
cp .carry/trimmed/ray-*.whl .carry/ray/xxhash-*.whl .carry/g2/
if [ "${1:-}" = "--te" ]; then
  # TE's torch extension is built there from its sdist; pip cannot download that sdist without running
  # its setup.py (which needs CUDA), so bring it yourself into .carry/te if you need the TE spec.
  dl .carry/te transformer-engine-cu13==2.20.2 transformer-engine==2.20.2 megatron-core==0.19.2 nvdlfw-inspect typing-extensions==4.16.0
  cp .carry/te/megatron_core-*.whl .carry/te/transformer_engine-2.20.2-*.whl .carry/te/nvdlfw_inspect-*.whl .carry/g2/
  ls .carry/te/transformer_engine_torch-2.20.2.tar.gz >/dev/null 2>&1 && cp .carry/te/transformer_engine_torch-2.20.2.tar.gz .carry/g2/
  ls .carry/g1 | grep -qi '^typing_extensions' || cp .carry/te/typing_extensions-*.whl .carry/g2/
  split -b 60M -d .carry/te/transformer_engine_cu13-*.whl .carry/teparts/te.part
  echo "TE_SHA256=$(sha256sum .carry/te/transformer_engine_cu13-*.whl | cut -d' ' -f1)"
fi
rm -f .carry/vparts/vllm.part*
split -n 3 -d .carry/trimmed/vllm-0.26.0-*.whl .carry/vparts/vllm.part  # equal parts, ~50 MiB each
echo "VLLM_SHA256=$(sha256sum .carry/trimmed/vllm-0.26.0-*.whl | cut -d' ' -f1)"
