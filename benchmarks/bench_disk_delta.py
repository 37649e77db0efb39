"""disk-delta: write and read sparse weight updates of a Qwen3-shaped model, against the ceiling of
writing the same full bytes raw (one file, write + fsync) on the same filesystem in the same run.

    python benchmarks/bench_disk_delta.py [--size-mb 200] [--num-tensors 311] [--changed 0.02]
                                          [--steps 3] [--dir DIR] [--shard-mb 64] [--json FILE]

Per encoding (xor, overwrite) and step it prints the model's bytes, the density (changed bytes /
total: ``perf/update_weights_density``), seconds to publish (sender: diff + zstd + write + fsync +
rename) and to load (receiver: read + verify + decode + stage), GB/s of effective weight bytes
(model bytes / seconds), the wire bytes (what landed on disk), and the ratio of the publish time
to the raw write of the full model (> 1: the delta beats writing everything).
``--changed`` is the fraction of elements each step changes (verl measured ~1-3% of bf16 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlplacement.bench import qwen3_shaped_tensors  # noqa: E402
from rlplacement.transfer.base import TransferEndpoint  # noqa: E402
from rlplacement.transfer.disk_delta.receiver import DiskDeltaReceiver  # noqa: E402
from rlplacement.transfer.disk_delta.sender import DiskDeltaSender  # noqa: E402


def perturb(named, fraction: float, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for _, t in named:
        flat = t.view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        flat[idx] += (torch.randn(k, generator=g) * 0.01).to(t.dtype)


def raw_write_seconds(named, path: Path) -> float:
    """The ceiling: every tensor's bytes written into one file, then fsync (no diff, no compression)."""
    from rlplacement.transfer.bucket import as_bytes

    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _, t in named:
            fh.write(memoryview(as_bytes(t).numpy()))
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def save_base(named, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in named}, str(folder / "model.safetensors"))


def run_encoding(encoding: str, work: Path, args) -> list[dict]:
    named = qwen3_shaped_tensors(args.size_mb, args.num_tensors)  # the same base for each encoding
    base_dir = work / "hf"
    sender = DiskDeltaSender(int(args.shard_mb * 1e6), disk_dir=work / f"deltas-{encoding}",
                             delta_encoding=encoding, base_dir=base_dir)
    endpoint = TransferEndpoint.from_dict(sender.listen(2).to_dict())
    receiver = DiskDeltaReceiver("cpu")
    receiver.connect(endpoint, 1)
    rows = []
    for step in range(1, args.steps + 1):
        perturb(named, args.changed, seed=step)
        ceiling_s = raw_write_seconds(named, work / "raw.bin")  # same bytes, same filesystem, same moment
        report = sender.update(step, named)
        start = time.perf_counter()
        receiver.begin(step)
        receiver.receive()
        receiver.commit(lambda staged: None)
        load_s = time.perf_counter() - start
        rows.append({"encoding": encoding, "step": step, "bytes": report.bytes, "num_tensors": report.num_tensors,
                     "density": report.density, "wire_bytes": report.wire_bytes, "publish_s": report.seconds,
                     "load_s": load_s, "publish_gbps": report.bytes / report.seconds / 1e9,
                     "load_gbps": report.bytes / load_s / 1e9, "ceiling_s": ceiling_s,
                     "ceiling_gbps": report.bytes / ceiling_s / 1e9, "ratio": ceiling_s / report.seconds})
    sender.close()
    del named
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=200.0)
    p.add_argument("--num-tensors", type=int, default=311)
    p.add_argument("--changed", type=float, default=0.02, help="fraction of elements changed per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard-mb", type=float, default=64.0, help="payload bytes per shard (--update-weight-buffer-size)")
    p.add_argument("--dir", type=str, default=None, help="folder to write in (default: a temp folder, removed)")
    p.add_argument("--json", type=str, default=None, help="also write the rows to this file")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    named = qwen3_shaped_tensors(args.size_mb, args.num_tensors)
    work = Path(tempfile.mkdtemp(prefix="bench-disk-delta-", dir=args.dir))
    try:
        save_base(named, work / "hf")
        del named
        rows = run_encoding("xor", work, args) + run_encoding("overwrite", work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = rows[0]["bytes"]
    print(f"== disk-delta: {total / 1e6:.0f} MB in {rows[0]['num_tensors']} tensors (bf16), "
          f"{args.changed:.1%} of elements changed per step, folder on {work.parent}")
    print(f"   {'encoding':>9} {'step':>4} {'density':>8} {'wire MB':>8} {'publish s':>9} {'GB/s':>6} "
          f"{'load s':>7} {'GB/s':>6} {'raw write+fsync s':>17} {'GB/s':>6} {'ratio':>6}")
    for r in rows:
        print(f"   {r['encoding']:>9} {r['step']:>4} {r['density']:>8.4f} {r['wire_bytes'] / 1e6:>8.2f} "
              f"{r['publish_s']:>9.3f} {r['publish_gbps']:>6.2f} {r['load_s']:>7.3f} {r['load_gbps']:>6.2f} "
              f"{r['ceiling_s']:>17.3f} {r['ceiling_gbps']:>6.2f} {r['ratio']:>6.2f}")
    print("   ratio = raw write+fsync of the full model / delta publish (> 1: the delta is faster)")
    load = os.getloadavg()[0]
    print(f"(load average during the run: {load:.1f} on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "load_average": load}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
