#!/usr/bin/env bash
# One command per experiment on the lent H200 machine, after benchmarks/gpu/device_setup.sh:
#   bash benchmarks/gpu/run_h200.sh split [--sizes ...]     -> $OUT/split_h200.json     (2 GPUs)
#   bash benchmarks/gpu/run_h200.sh colocate [--sizes ...]  -> $OUT/colocate_h200.json  (1 GPU)
#   bash benchmarks/gpu/run_h200.sh peers [--sizes ...]     -> $OUT/colocate_peers_h200.json (1 GPU: ours beside
#       vLLM's own IPC engine, unpacked and packed, and the per-tensor-handle baseline, one engine after the other)
#   bash benchmarks/gpu/run_h200.sh offload [--size 8B]     -> $OUT/offload_h200.json   (1 GPU, hand-off)
#   bash benchmarks/gpu/run_h200.sh offload --size 4B --lora-ranks 0 32 -> $OUT/offload_h200_4B_lora.json
#       (1 GPU: full fine-tuning beside rank-32 adapters with adapter-only updates; needs peft: first
#        `bash benchmarks/gpu/device_setup.sh g2 .carry/lora`, carrying .carry/lora)
#   bash benchmarks/gpu/run_h200.sh replay [--sizes ...]    -> $OUT/replay_copies_h200.json (1 GPU, commit copies)
#   bash benchmarks/gpu/run_h200.sh loop [--steps N]        -> $OUT/loop_h200.json      (1 GPU, tiny loop colocated)
#   bash benchmarks/gpu/run_h200.sh rollout [--size 0.5B]   -> $OUT/rollout_h200.json   (1 GPU, RLJob.generate vs vLLM)
#   bash benchmarks/gpu/run_h200.sh megatron [--backends ...] -> $OUT/megatron_h200.json (1 GPU, Megatron vs FSDP colocated)
#   bash benchmarks/gpu/run_h200.sh sleep_failure [--levels 2 1] -> $OUT/sleep_failure_h200.json (1 GPU, failed update vs sleep level)
#   bash benchmarks/gpu/run_h200.sh staging [--size 8B]      -> $OUT/staging_h200.json   (1 GPU, --update-weight-staging full vs bucket)
#   bash benchmarks/gpu/run_h200.sh moe [--sizes 30B-A3B-L4] -> $OUT/moe_h200.json     (1 GPU, Qwen3-MoE colocated)
#   bash benchmarks/gpu/run_h200.sh routing_replay [--steps 3] -> $OUT/routing_replay_h200.json (1 GPU, MoE routing replay)
#   bash benchmarks/gpu/run_h200.sh train_during_rollout [--size 0.5B] -> $OUT/train_during_rollout_h200_0.5B.json (_h100_ on an H100)
#       (1 GPU, colocated both resident: sync beside --train-during-rollout on the same long-tailed samples)
#   bash benchmarks/gpu/run_h200.sh extras                  -> $OUT/gpu_extras_h200.json (installed versions vs [gpu])
#   bash benchmarks/gpu/run_h200.sh tests                   -> the GPU-marked tests (pytest -m gpu)
# Give RLPLACEMENT_COMMIT=<this machine's git rev-parse --short HEAD> in the command: the device's copy of the tree
# carries the last landed commit's git metadata, so a results file would name that commit, dirty.
# Installs this checkout into /tmp/site first, so vLLM's processes find the `vllm.general_plugins`
# entry point that registers rlplacement's weight-transfer backend.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . 2>&1 | grep -v WARNING || true
source benchmarks/gpu/device_env.sh
what=$1; shift
out=${OUT:-benchmarks/gpu/results}
case "$what" in
  split) python3 benchmarks/gpu/split_h200.py --out "$out" "$@" ;;
  colocate) python3 benchmarks/gpu/colocate_h200.py --out "$out" "$@" ;;
  peers) python3 benchmarks/gpu/colocate_h200.py --peers --out "$out" "$@" ;;
  offload) python3 benchmarks/gpu/offload_h200.py --out "$out" "$@" ;;
  replay) python3 benchmarks/gpu/replay_copies.py --out "$out" "$@" ;;
  loop) python3 benchmarks/gpu/loop_h200.py --out "$out" "$@" ;;
  rollout) python3 benchmarks/gpu/rollout_h200.py --out "$out" "$@" ;;
  megatron) python3 benchmarks/gpu/megatron_h200.py --out "$out" "$@" ;;
  sleep_failure) python3 benchmarks/gpu/sleep_failure_h200.py --out "$out" "$@" ;;
  staging) python3 benchmarks/gpu/staging_h200.py --out "$out" "$@" ;;
  moe) python3 benchmarks/gpu/moe_h200.py --out "$out" "$@" ;;
  routing_replay) python3 benchmarks/gpu/routing_replay_h200.py --out "$out" "$@" ;;
  train_during_rollout) python3 benchmarks/gpu/train_during_rollout_h200.py --out "$out" "$@" ;;
  extras) python3 benchmarks/gpu/check_gpu_extras.py "$out/gpu_extras_h200.json" "$@" ;;
  tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests "$@" ;;
  *) echo "unknown experiment $what (split | colocate | peers | offload | replay | loop | rollout | megatron | sleep_failure | staging | moe | routing_replay | train_during_rollout | extras | tests)" >&2; exit 2 ;;
esac
