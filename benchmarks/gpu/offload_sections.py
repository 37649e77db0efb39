"""Where a trainer-sized offload spends its time, section by section, in one process on one GPU:
copy to pinned host memory, free the storages, empty_cache, then the readings the hand-off takes
(mem_get_info, memory stats). ``python3 benchmarks/gpu/offload_sections.py --gb 46 --out DIR``."""
import argparse, json, sys, time
import torch

p = argparse.ArgumentParser(); p.add_argument("--gb", type=float, default=46); p.add_argument("--out"); p.add_argument("--rounds", type=int, default=3)
a = p.parse_args()
n_t = 400
each = int(a.gb * 1e9 / n_t) // 512 * 512
host = torch.empty(each * n_t, dtype=torch.uint8).pin_memory()
rows = []
for r in range(a.rounds):
    ts = [torch.empty(each, dtype=torch.uint8, device="cuda").fill_(r) for _ in range(n_t)]
    torch.cuda.synchronize()
    t = {}
    t0 = time.perf_counter()
    for i, x in enumerate(ts):
        host[i * each:(i + 1) * each].copy_(x, non_blocking=True)
    torch.cuda.synchronize(); t1 = time.perf_counter(); t["copy"] = t1 - t0
    for x in ts:
        x.untyped_storage().resize_(0)
    t2 = time.perf_counter(); t["free"] = t2 - t1
    torch.cuda.empty_cache(); t3 = time.perf_counter(); t["empty_cache"] = t3 - t2
    torch.cuda.mem_get_info(); t4 = time.perf_counter(); t["mem_get_info"] = t4 - t3
    torch.cuda.memory_reserved(); torch.cuda.max_memory_reserved(); t5 = time.perf_counter(); t["stats"] = t5 - t4
    torch.cuda.reset_peak_memory_stats(); t6 = time.perf_counter(); t["reset_peak"] = t6 - t5
    torch.cuda.mem_get_info(); t7 = time.perf_counter(); t["mem_get_info_again"] = t7 - t6
    del ts
    import gc; gc.collect(); t8 = time.perf_counter(); t["gc"] = t8 - t7
    t["gbps"] = each * n_t / t["copy"] / 1e9
    rows.append(t); print(r, {k: round(v, 4) for k, v in t.items()}, flush=True)
if a.out:
    json.dump({"command": " ".join(sys.argv), "rows": rows}, open(f"{a.out}/offload_sections_h200.json", "w"), indent=1)
