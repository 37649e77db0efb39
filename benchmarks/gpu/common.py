"""Pieces the H200 benchmarks share: Qwen3-shaped random models made fast, the ceilings measured in
the same run (flat NCCL broadcast GPU 0 -> GPU 1; device-to-device copy), the peers (vLLM's own
NCCL weight-transfer backend; per-tensor CUDA IPC handles into ``load_weights``), and the rows of
the results contract (``whole_seconds``, ``wire_seconds``, ``load_seconds``, ``ratio``, ``bit_exact``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Qwen3 shapes, head_dim 128. 0.5B-4B keep an 8192-token vocabulary (the earlier runs' bytes); 8B is
# the real Qwen3-8B (151,936 vocabulary, untied: 399 tensors, ~16.4 GB in bf16).
SIZES = {
    "0.5B": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=8,
                 num_hidden_layers=28, vocab_size=8192, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                 num_hidden_layers=28, vocab_size=8192, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=36, vocab_size=8192, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
               num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer at reduced depth (4 of 48 layers: the trainer's fp32 state and AdamW beside a bf16
    # engine on one GPU): 128 experts of 768, top-8, the real 151,936-token vocabulary
    "30B-A3B-L4": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                       num_key_value_heads=4, num_hidden_layers=4, vocab_size=151936, tie_word_embeddings=False,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    # a mixture of experts small enough to start in seconds on a GPU, with head_dim 128 as the GPU attention
    # kernels take (the CPU smoke shapes' 32 is not one of them): a check of a script's plumbing before its real run
    "smoke-moe-gpu": dict(family="qwen3_moe", hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=8192, tie_word_embeddings=False,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
    "smoke-moe": dict(family="qwen3_moe", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, tie_word_embeddings=True,
                      head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                  num_hidden_layers=2, vocab_size=300, tie_word_embeddings=True, head_dim=32),
}
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def export_path() -> None:
    """Ray workers (started after this) import ``peers`` and ``rlplacement`` from here."""
    import os

    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def make_model(root: Path, size: str, dtype: str, max_position_embeddings: int = 1024) -> Path:
    """An HF folder with random weights, generated on the GPU when there is one (an 8B model made
    by transformers' CPU init takes minutes); the tokenizer keeps a small vocabulary (vLLM accepts
    a tokenizer smaller than the model's embedding)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from rlplacement.families import family_for
    from rlplacement.models.tiny import TinySpec, build_config, build_tokenizer

    shape = {"head_dim": 128, "family": "qwen3", **SIZES[size]}
    spec = TinySpec(max_position_embeddings=max_position_embeddings, dtype=dtype, **shape)
    out = root / size
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(spec)
    views = family_for(cfg).checkpoint_views  # a mixture of experts: per-expert tensors, as checkpoints hold them
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, p in meta.named_parameters():
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
        t = (1 + 0.05 * t) if p.dim() == 1 else t * 0.02
        for key, view in views(name, t.to(getattr(torch, dtype))):
            tensors[key] = view.contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = [type(meta).__name__]  # what vLLM picks the model class by
    cfg.save_pretrained(out)
    build_tokenizer(min(spec.vocab_size, 8192)).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))
    del tensors
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _raw_rank(rank: int, nbytes: int, repeats: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    if rank == 0:
        buf.random_(0, 255)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        sync()
        if i >= 2:  # two warm-ups: NCCL sets up its channels on first use
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def raw_broadcast_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds per broadcast of one flat ``nbytes`` buffer GPU 0 -> GPU 1 (gloo on CPU): the ceiling."""
    import torch.multiprocessing as mp

    from rlplacement.backends.launch import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_raw_rank, args=(r, nbytes, repeats, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    times = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return times


def device_copy_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds per device-to-device copy of ``nbytes`` on GPU 0 (CUDA events): the colocated ceiling."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return times


def mode_row(nbytes: int, ceiling_gbps: float, whole: list[float], wire: list[float | None],
             load: list[float | None], bit_exact: bool) -> dict:
    med = statistics.median
    wire = [w for w in wire if w is not None]
    load = [x for x in load if x is not None]
    return {"whole_seconds": med(whole), "wire_seconds": med(wire) if wire else None,
            "load_seconds": med(load) if load else None, "ratio": round(nbytes / med(whole) / 1e9 / ceiling_gbps, 4),
            "bit_exact": bool(bit_exact), "whole_all": whole}


def random_batch(vocab: int, batch: int = 4, length: int = 64):
    import torch

    from rlplacement import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.zeros(batch, length)
    mask[:, length // 2:] = 1
    return Batch(ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5][:batch]))


def greedy(engine, prompts: list[list[int]]) -> list[dict]:
    import ray

    out = ray.get(engine.generate.remote(prompts, max_tokens=32, temperature=0.0), timeout=600)
    return [{**r, "token_ids": r["token_ids"].tolist(), "logprobs": r["logprobs"].tolist()} for r in out]


def timed_updates(job, repeats: int) -> tuple[list, list, list, list]:
    whole, wire, load, timelines = [], [], [], []
    for i in range(repeats + 1):
        t0, m0 = time.perf_counter(), time.monotonic()
        report = job.update_weights()
        if i:  # the first is a warm-up
            whole.append(time.perf_counter() - t0)
            wire.append(report.trainer.seconds)
            load.append(report.engines[0].load)
            timelines.append(update_timeline(report, m0, time.monotonic()))
    return whole, wire, load, timelines


def update_timeline(report: dict, start: float, returned: float) -> dict[str, float]:
    """Every side's instants of one update (``transfer.base.Instants``: one monotonic clock per host) in
    ms from the driver's call: trainer, engine 0's actor, and its worker 0."""
    engine = report.engines[0]
    sides = {"trainer": report.trainer.instants, "engine": engine.instants,
             "worker": (engine.worker_instants or ({},))[0]}
    out = {f"{side}.{name}": (t - start) * 1e3 for side, marks in sides.items() for name, t in marks.items()}
    out["driver.returned"] = (returned - start) * 1e3
    return out


def median_timeline(timelines: list[dict[str, float]]) -> dict[str, float]:
    """Per instant, the median over updates (ms), in time order."""
    keys = set().union(*timelines) if timelines else set()
    med = {k: round(statistics.median(t[k] for t in timelines if k in t), 3) for k in keys}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


def run_ours(config, modes, size: str, model_dir: Path, root: Path, args, row: dict, compare_generation: bool,
             gpu_memory_utilization: float, enforce_eager: bool = False) -> None:
    """Our modes through ``RLJob`` (as a loop sees them): a train step so the weights move, then per
    mode one checked update and timed ones; optionally greedy generation vs a fresh engine.
    ``enforce_eager``: no CUDA graphs, as the peers' engines run (an update writes the same parameters
    either way; it saves the graphs' capture at start)."""
    import ray
    import torch

    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement import OptimConfig, RLJob

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    engine_kwargs = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512}
    if torch.cuda.is_available():
        engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if enforce_eager:
        engine_kwargs["enforce_eager"] = True
    t0 = time.time()
    job = RLJob.start(config, str(model_dir), optim=OptimConfig(lr=1e-4),
                      engine_kwargs=engine_kwargs, backend_options={"dtype": dtype})
    row["startup_s"] = round(time.time() - t0, 1)
    try:
        smoke = size.startswith("smoke")
        job.train(random_batch(300 if smoke else 8192, batch=1 if smoke else 4))
        for mode in modes:
            job.set_transfer(mode, check_equal=True)
            checked = job.update_weights()  # raises WeightUpdateError naming the tensor on any mismatch
            job.set_transfer(mode, check_equal=False)
            whole, wire, load, timelines = timed_updates(job, args.repeats)
            row["bytes"], row["num_tensors"] = checked.trainer.bytes, checked.trainer.num_tensors
            row[mode] = {"whole": whole, "wire": wire, "load": load, "bit_exact": True,
                         "timeline_ms": median_timeline(timelines), "compiled_update": job.updates.compiled,
                         "commit": ray.get(job.engines[0].call_workers.remote("rlplacement_load_path"), timeout=60)}
            if job.updates.compiled:  # the same updates through plain Ray calls, in the same run: what the graph saves
                job.updates.compiled = False
                plain, _, _, plain_timelines = timed_updates(job, args.repeats)
                job.updates.compiled = True
                row[mode]["plain_calls"] = {"whole_seconds": statistics.median(plain), "whole_all": plain,
                                            "timeline_ms": median_timeline(plain_timelines)}
                print(f"[{size}] {mode} through plain Ray calls: whole {statistics.median(plain) * 1e3:.1f} ms",
                      flush=True)
            print(f"[{size}] {mode}: whole {statistics.median(whole) * 1e3:.1f} ms, wire "
                  f"{statistics.median(wire) * 1e3:.1f} ms, load {statistics.median(load) * 1e3:.1f} ms "
                  f"{row[mode]['commit']}", flush=True)
            print(f"[{size}] {mode} timeline (ms from the driver's call): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row[mode]["timeline_ms"].items()), flush=True)
        if compare_generation:
            prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 250, 120], [7] * 16]  # inside the smoke vocabulary too
            job.prepare_rollout()  # under --colocate the engine slept for training: its KV cache comes back
            updated = greedy(job.engines[0], prompts)
            updated_sums = ray.get(job.engines[0].model_checksums.remote(), timeout=300)
            job.prepare_update()  # the hand-off moved the trainer's weights to the host for rollout
            saved = ray.get(job.trainers[0].save_hf_folder.remote(str(root / f"{size}_trained"), str(model_dir)),
                            timeout=600)
            job.prepare_rollout()  # the trainer's state back on the host: the fresh engine starts beside it
            ray.get(job.engines[0].shutdown.remote(), timeout=120)
            ray.kill(job.engines[0])
            job.engines[0] = fresh_engine = create_engine_actor(0, saved, options=job.placement.engine_options(0),
                                                                **engine_kwargs)
            fresh = greedy(fresh_engine, prompts)
            # which of the served parameters differ between the updated and the fresh engine (a
            # generation difference is then weights, or numerics if none differ)
            fresh_sums = ray.get(fresh_engine.model_checksums.remote(), timeout=300)
            row["served_params_differing"] = sorted(n for n, c in fresh_sums.items() if updated_sums.get(n) != c)
            row["generation_first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"]))
                                                        if x != y), None) for a, b in zip(updated, fresh)]
            row["generation_tokens_equal"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(updated, fresh))
            row["generation_logprob_max_abs_diff"] = max(abs(x - y) for a, b in zip(updated, fresh)
                                                         for x, y in zip(a["logprobs"], b["logprobs"]))
            # up to each prompt's first differing token: 0.0 there means the same numbers until a near-tie
            # flipped; anything else means the two engines computed differently from the start
            row["generation_logprob_max_abs_diff_before_divergence"] = max(
                (abs(x - y) for a, b, first in zip(updated, fresh, row["generation_first_divergence"])
                 for x, y in list(zip(a["logprobs"], b["logprobs"]))[:first]), default=0.0)
            row["generation_logprobs"] = {"updated": [a["logprobs"] for a in updated],
                                          "fresh": [b["logprobs"] for b in fresh]}
    finally:
        job.close()


def size_row(row: dict, ceiling_runs: list[float], ceiling: str, modes) -> dict:
    """The results contract's row for one size: ceiling from ``ceiling_runs`` (seconds, same run) and
    one ``mode_row`` per mode measured (extra per-mode fields, e.g. ``commit``, kept)."""
    ceiling_gbps = row["bytes"] / statistics.median(ceiling_runs) / 1e9
    out = {"size": row["size"], "bytes": row["bytes"], "num_tensors": row["num_tensors"],
           "ceiling_gbps": round(ceiling_gbps, 2), "ceiling_seconds": statistics.median(ceiling_runs), "ceiling": ceiling,
           **{k: v for k, v in row.items() if k not in ("size", "bytes", "num_tensors") and not isinstance(v, dict)}}
    for mode in modes:
        m = row.get(mode)
        if m:
            out[mode] = mode_row(row["bytes"], ceiling_gbps, m["whole"], m["wire"], m["load"], m["bit_exact"])
            out[mode].update({k: v for k, v in m.items() if k not in ("whole", "wire", "load", "bit_exact")})
    return out


def run_sizes(args, results: dict, file_name: str, run_size, modes) -> None:
    """Each size in turn (greedy generation compared with a fresh engine on the first), the JSON
    rewritten after every size, Ray shut down at the end, then a table of whole-update times."""
    import tempfile

    import ray

    root = Path(tempfile.mkdtemp(prefix=file_name.removesuffix(".json") + "_"))
    try:
        for i, size in enumerate(args.sizes):
            first = i == 0 and not getattr(args, "skip_generation", False)
            results["sizes"].append(run_size(size, root, args, compare_generation=first))
            write(args.out, file_name, results)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        write(args.out, file_name, results)
    print(f"{'size':>5} {'GB':>6} {'ceil GB/s':>9} " + " ".join(f"{m:>22}" for m in modes))
    for r in results["sizes"]:
        cells = [f"{r[m]['whole_seconds'] * 1e3:9.1f}ms ({r[m]['ratio']:.0%}"
                 + (f", x{r[m]['vs_ours']}" if "vs_ours" in r[m] else "") + ")" if m in r else "-" for m in modes]
        print(f"{r['size']:>5} {r['bytes'] / 1e9:6.2f} {r['ceiling_gbps']:9.1f} " + " ".join(f"{c:>22}" for c in cells))


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        pass
    return out


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def card_tag() -> str:
    """The lent card's kind as results files name it: ``h100`` on an H100 (lent where no H200 comes), else
    ``h200``."""
    names = gpu_names()
    return "h100" if names and "H100" in names[0] else "h200"


def write(out_dir: str | None, name: str, results: dict) -> None:
    """``results`` as ``out_dir/name``, with the run's date (UTC) and machine where the script gave none: a
    results file says what ran where, written whole by its script."""
    if out_dir:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        gpus = gpu_names()
        results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                   "machine": f"{os.cpu_count()} CPU cores, {memory_gb:.0f} GB, {platform.machine()}; "
                              + (f"GPUs: {', '.join(gpus)}" if gpus else "no GPU"), **results}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(json.dumps(results, indent=1))
