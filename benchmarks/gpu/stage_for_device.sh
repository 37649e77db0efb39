#!/usr/bin/env bash
# Stage a device run from a worktree: the device tool sends the checkout its session started in, not a
# helper's worktree, so what the calls need is copied into DEST, a folder of that checkout ignored by its own
# .gitignore (nothing there changes what git sees), named in each call's `carry`:
#   DEST/g1, DEST/g2         vLLM's small wheels, ray trimmed       (after benchmarks/gpu/prepare_carry.sh)
#   DEST/p00, p01, p02       the vLLM wheel's three parts
#   DEST/src                 this worktree's HEAD (git archive): run it there with `cd DEST/src`
# Each folder fits one call beside the checkout's tree (64 MiB a call); prints the wheel's sha256 to check
# after joining. Usage: bash benchmarks/gpu/stage_for_device.sh /path/to/session/checkout/.device_stage
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:?DEST: a folder inside the checkout the device tool sends}
mkdir -p "$dest"
echo '*' > "$dest/.gitignore"
for d in g1 g2; do
  rm -rf "${dest:?}/$d" && mkdir -p "$dest/$d" && cp .carry/$d/*.whl "$dest/$d/"
done
for p in .carry/vparts/vllm.part*; do
  n=${p##*part}
  rm -rf "${dest:?}/p$n" && mkdir -p "$dest/p$n" && cp "$p" "$dest/p$n/"
done
rm -rf "${dest:?}/src" && mkdir -p "$dest/src" && git archive HEAD | tar -x -C "$dest/src"
du -sh "$dest"/*
sha256sum .carry/trimmed/vllm-0.26.0-*.whl
