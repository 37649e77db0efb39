"""The host link's pinned rate on this machine, and what each way of holding host memory gets of it.

``host_link_gbps(nbytes)`` is the ceiling the hand-off is measured against (``offload_h200.py``): one
large copy each way between a GPU tensor and host memory pinned by CUDA's own allocator
(``cudaHostAlloc``, through torch's ``pin_memory``), and both directions at once on two streams.

Run alone, it also times the other ways of pinning host memory the trainer's offload could use, and
the copy patterns a trainer's state makes (many storages of tens of MB):

    python3 benchmarks/gpu/host_link.py --gib 8 --out $OUT      # -> host_link_h200.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GB = 1e9


def _timed(fn, repeats: int = 3) -> float:
    """Best of ``repeats`` seconds (the link's rate, not the host's noise)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def host_link_gbps(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """GB/s device-to-host, host-to-device, and both at once (two streams, two buffers each way). Its
    buffers are freed on return; the caller empties torch's caches (device and pinned host) after."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {"d2h": nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), repeats) / GB,
           "h2d": nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), repeats) / GB}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    out["both"] = 2 * nbytes / _timed(both, repeats) / GB
    return {k: round(v, 2) for k, v in out.items()}


def _registered(nbytes: int, hugepages: bool) -> tuple[torch.Tensor, float, object]:
    """Host memory from the process (malloc'd, or mmap'd with transparent huge pages asked for), then
    registered with CUDA; returns the tensor, the seconds registering took, and what keeps it alive."""
    keep = None
    if hugepages:
        keep = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        keep.madvise(mmap.MADV_HUGEPAGE)
        host = torch.frombuffer(keep, dtype=torch.uint8)
    else:
        host = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    assert int(getattr(rc, "value", rc)) == 0, rc
    return host, time.perf_counter() - t0, keep


def strategies(nbytes: int, piece_bytes: int) -> dict:
    """Each way of holding the host copy: its one-time cost, and both directions whole and in pieces."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pieces = [(o, min(piece_bytes, nbytes - o)) for o in range(0, nbytes, piece_bytes)]
    rows = {}
    for name in ("pin_memory", "pin_memory_1gib_chunks", "register", "register_hugepages"):
        t0 = time.perf_counter()
        keep = None
        if name == "pin_memory":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            setup = time.perf_counter() - t0
        elif name == "pin_memory_1gib_chunks":
            chunks = [torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True) for _ in range(-(-nbytes // (1 << 30)))]
            setup = time.perf_counter() - t0
            host = None
        else:
            host, setup, keep = _registered(nbytes, hugepages=name.endswith("hugepages"))
        if host is None:
            def d2h() -> None:
                for i, c in enumerate(chunks):
                    n = min(1 << 30, nbytes - (i << 30))
                    c[:n].copy_(dev[i << 30:(i << 30) + n], non_blocking=True)

            def h2d() -> None:
                for i, c in enumerate(chunks):
                    n = min(1 << 30, nbytes - (i << 30))
                    dev[i << 30:(i << 30) + n].copy_(c[:n], non_blocking=True)
            row = {"setup_s": round(setup, 3), "d2h_gbps": nbytes / _timed(d2h) / GB,
                   "h2d_gbps": nbytes / _timed(h2d) / GB}
        else:
            def d2h_pieces() -> None:
                for o, n in pieces:
                    host[o:o + n].copy_(dev[o:o + n], non_blocking=True)

            def h2d_pieces() -> None:
                for o, n in pieces:
                    dev[o:o + n].copy_(host[o:o + n], non_blocking=True)
            row = {"setup_s": round(setup, 3),
                   "d2h_gbps": nbytes / _timed(lambda: host.copy_(dev, non_blocking=True)) / GB,
                   "h2d_gbps": nbytes / _timed(lambda: dev.copy_(host, non_blocking=True)) / GB,
                   "d2h_pieces_gbps": nbytes / _timed(d2h_pieces) / GB,
                   "h2d_pieces_gbps": nbytes / _timed(h2d_pieces) / GB}
            if name.startswith("register"):
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        rows[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(name, rows[name], flush=True)
        host = chunks = None
        del keep
    return rows


def release_cost(nbytes: int, piece_bytes: int) -> dict:
    """Seconds to give ``nbytes`` of freed torch memory back to the driver (``empty_cache``, what the
    trainer's offload does so a colocated engine can allocate it) and to allocate it again, held as one
    block or as pieces; under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the blocks are cuMem
    mappings instead of cudaMalloc allocations."""
    out = {}
    for name, sizes in (("one_block", [nbytes]), ("pieces", [piece_bytes] * (nbytes // piece_bytes))):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        del held
        t2 = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        out[name] = {"alloc_s": round(t1 - t0, 4), "free_s": round(t2 - t1, 4), "empty_cache_s": round(t3 - t2, 4),
                     "empty_cache_gbps": round(nbytes / (t3 - t2) / GB, 1)}
    return out


def offload_roundtrip(nbytes: int, piece_bytes: int) -> dict:
    """rlplacement's own ``HostOffload`` over storages of ``piece_bytes`` (a trainer's parameters and
    moments), twice: the first pays for the host buffer, the second is the steady step."""
    from rlplacement.backends.offload import HostOffload

    tensors = [torch.empty(piece_bytes, dtype=torch.uint8, device="cuda") for _ in range(nbytes // piece_bytes)]
    holder = HostOffload()
    rows = []
    for _ in range(3):
        torch.cuda.synchronize()
        off = holder.offload(tensors)
        back = holder.reload()
        rows.append({"offload_s": round(off["seconds"], 3), "reload_s": round(back["seconds"], 3),
                     "offload_gbps": round(off["bytes"] / off["seconds"] / GB, 2),
                     "reload_gbps": round(back["bytes"] / back["seconds"] / GB, 2),
                     **{k: v for k, v in off.items() if k not in ("seconds", "bytes")}})
        print("HostOffload", rows[-1], flush=True)
    return {"bytes": nbytes, "piece_bytes": piece_bytes, "rounds": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--piece-mib", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="skip the pinning strategies")
    parser.add_argument("--release-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    nbytes = int(args.gib * (1 << 30))
    piece = args.piece_mib << 20
    results = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names()[:1],
               "versions": common.versions(), "bytes": nbytes}
    if args.release_only:
        print(json.dumps(release_cost(nbytes, piece)), flush=True)
        return 0
    results["host_link_gbps"] = host_link_gbps(nbytes)
    print("host_link_gbps", results["host_link_gbps"], flush=True)
    results["release"] = {"default": release_cost(nbytes, piece)}
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    line = subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--piece-mib", str(args.piece_mib),
                           "--release-only"], env=env, capture_output=True, text=True, check=True).stdout
    results["release"]["expandable_segments"] = json.loads(line.strip().splitlines()[-1])
    print("release", results["release"], flush=True)
    results["offload"] = offload_roundtrip(nbytes, piece)
    if not args.quick:
        results["strategies"] = strategies(nbytes, piece)
    common.write(args.out, "host_link_h200.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
