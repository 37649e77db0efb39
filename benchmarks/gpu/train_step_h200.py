"""A realistic GRPO train step on one H200: the 4B Qwen3 shape (its real 151,936-token vocabulary, tied,
random weights), the FSDP backend with mixed precision (fp32 master weights and AdamW state, bf16
compute), dynamic micro-batches under --max-tokens-per-gpu, recompute per decoder layer, chunked
log-probs. Per step: train seconds, peak memory, MFU and HFU against the bf16 matmul rate measured on
the same GPU in the same run, and a profile of where a step's GPU time goes.

    python3 benchmarks/gpu/train_step_h200.py --out DIR [--samples 512 --response 1024 --prompt 128]
        [--variants eager compiled torchtitan:compiled] [--steps 3]

A variant is ``[BACKEND:]eager|compiled`` (backend fsdp by default, or torchtitan: its own model under the
same FSDP2 step, needing torchtitan, tyro and spmd_types carried; or ``megatron:eager``: megatron-core's
GPTModel with the TE spec where TE imports, Float16Module, DDP, the distributed optimizer and full
uniform recompute of every layer, needing megatron-core and TE installed; or ``lora:eager|compiled``: the
fsdp step with peft's rank-``--lora-rank`` adapters on every decoder linear layer, the base frozen, needing
peft and accelerate carried).

MFU counts the model's FLOPs once: 6 x (parameters in matmuls) x tokens, plus causal attention
6 x layers x (heads x head_dim) x sum of squared sample lengths. HFU adds what recompute runs again
(one more forward: 2 x params x tokens and a third of the attention). Under LoRA the frozen base computes no
weight gradients: 4 x (parameters in matmuls) x tokens, plus 6 x the adapters' parameters x tokens, plus the
same attention (``mfu``); ``mfu_full_ft_flops`` counts the full fine-tuning FLOPs in the LoRA step's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPE = dict(common.SIZES["4B"], vocab_size=151936)  # the real Qwen3-4B: tied 151,936-token vocabulary


def matmul_tflops(n: int = 8192, repeats: int = 20) -> float:
    """The bf16 matmul rate on random data (the MFU ceiling), measured here, now."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = n if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0) / 1e12


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_gb() -> tuple[float, float]:
    import torch

    if not torch.cuda.is_available():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 2 ** 30, torch.cuda.max_memory_reserved() / 2 ** 30


def model_flops(cfg, lengths: list[int], adapters: int = 0) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs with one recomputed forward) of one step over ``lengths``; ``adapters``:
    LoRA's trained parameters (the base frozen: no weight gradients for it)."""
    h, layers, heads, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    kv, inter, vocab = cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size
    attention_params = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o
    from rlplacement.families import MoEFamily, num_experts

    experts = num_experts(cfg)
    sparse = MoEFamily.sparse_layers(cfg) if experts else [False] * layers
    # a sparse layer's matmuls per token: the router and the top-k experts it runs (the active parameters)
    mlp = [h * experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size if s else 3 * h * inter
           for s in sparse]
    matmul_params = layers * attention_params + sum(mlp) + vocab * h  # the output layer is a matmul
    tokens = sum(lengths)
    attention = 6 * layers * heads * hd * sum(n * n for n in lengths)
    mfu = (4 * matmul_params + 6 * adapters if adapters else 6 * matmul_params) * tokens + attention
    hfu = mfu + 2 * (matmul_params - vocab * h) * tokens + attention / 3  # the layers' forward again
    return float(mfu), float(hfu)


def batch(samples: int, prompt: int, response: int, vocab: int):
    import torch

    from rlplacement.train_io import Batch

    g = torch.Generator().manual_seed(0)
    width = prompt + response
    ids = torch.randint(0, vocab, (samples, width), generator=g)
    mask = torch.zeros(samples, width)
    mask[:, prompt:] = 1.0
    adv = torch.randn(samples, generator=g)
    return Batch(ids, mask, adv, None, torch.full((samples,), width))


def profile_step(backend, b) -> dict:
    """GPU time of one step by kind of kernel (matmul, attention, elementwise/norm, optimizer, copies)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        backend.train_step(b)
        sync()
    kinds: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if not us or evt.key.startswith("aten::") or evt.key.startswith("ProfilerStep"):
            continue
        name = evt.key.lower()
        kind = ("matmul" if any(k in name for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "wgmma")) else
                "attention" if any(k in name for k in ("flash", "fmha", "attention")) else
                "optimizer" if any(k in name for k in ("adam", "foreach", "multi_tensor")) else
                "copy" if any(k in name for k in ("memcpy", "memset", "copy")) else
                "softmax/log-probs" if any(k in name for k in ("softmax", "log_softmax", "gather")) else
                "triton (compiled)" if "triton" in name else "elementwise/norm/other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
    top = sorted(((getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0), e.key)
                  for e in prof.key_averages() if not e.key.startswith("aten::")), reverse=True)[:15]
    return {"gpu_seconds_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"kernel": k[:120], "seconds": round(us / 1e6, 4)} for us, k in top]}


def run_variant(model_dir: Path, variant: str, args, peak_tflops: float) -> dict:
    import torch

    from rlplacement.backends import make_backend
    from rlplacement.config import BackendConfig, OptimConfig, TrainConfig

    name, _, mode = variant.rpartition(":")
    # recompute per decoder layer: megatron's own flags for megatron (with its distributed optimizer, as a
    # large run uses it), gradient checkpointing for the FSDP backends
    recompute = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                      use_distributed_optimizer=True) if name == "megatron" else dict(gradient_checkpointing=True))
    train = TrainConfig(bf16=True, use_dynamic_batch_size=True, max_tokens_per_gpu=args.max_tokens,
                        log_probs_chunk_size=args.chunk, **recompute)
    from rlplacement.config import LORA_MODULES, LoRAConfig

    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules=LORA_MODULES,
                      merge_for_rollout=True) if name == "lora" else LoRAConfig()
    t0 = time.time()
    backend = make_backend(BackendConfig(name="fsdp" if name in ("", "lora") else name, hf_checkpoint=str(model_dir),
                                         lora=lora), OptimConfig(lr=1e-6), train, compile_layers=mode == "compiled")
    build_s = time.time() - t0
    b = batch(args.samples, args.prompt, args.response, SHAPE["vocab_size"])
    adapters = sum(p.numel() for p in backend.model.parameters() if p.requires_grad) if lora.enabled else 0
    mfu_flops, hfu_flops = model_flops(backend.hf_config, b.sample_lengths(), adapters)
    full_ft_flops = model_flops(backend.hf_config, b.sample_lengths())[0]
    steps = []
    for step in range(args.steps + 1):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sync()
        s0 = time.perf_counter()
        report = backend.train_step(b)
        sync()
        seconds = time.perf_counter() - s0
        allocated, reserved = peak_memory_gb()
        served = dict(backend.iter_hf_tensors())  # the update's stream: bf16 of the fp32 master weights
        held = {k: v for n, p in backend.model.named_parameters()  # under the checkpoint's names (experts apart)
                for k, v in backend.family.checkpoint_views(n, p.to_local().detach())}
        exact = set(served) == set(held) and all(torch.equal(t, held[k].to(t.dtype)) for k, t in served.items()) \
            if name in ("", "fsdp") else None  # LoRA streams the merged weights, not the parameters
        steps.append({"step": step, "train_s": round(seconds, 3), "tokens": sum(b.sample_lengths()),
                      "mfu": round(mfu_flops / seconds / 1e12 / peak_tflops, 4),
                      "mfu_full_ft_flops": round(full_ft_flops / seconds / 1e12 / peak_tflops, 4),
                      "hfu": round(hfu_flops / seconds / 1e12 / peak_tflops, 4),
                      "peak_allocated_gb": round(allocated, 2), "peak_reserved_gb": round(reserved, 2),
                      "loss": report["loss"], "grad_norm": report["grad_norm"], "stream_bit_exact": exact})
        print(f"[{variant}] step {step}: {seconds:.2f}s mfu {steps[-1]['mfu']:.3f} hfu {steps[-1]['hfu']:.3f} "
              f"peak {steps[-1]['peak_reserved_gb']} GB exact {exact}", flush=True)
    measured = steps[1:]  # step 0 warms up (and compiles)
    row = {"variant": variant, "build_s": round(build_s, 1), "steps": steps,
           "train_s": statistics.median(s["train_s"] for s in measured),
           "mfu": statistics.median(s["mfu"] for s in measured), "hfu": statistics.median(s["hfu"] for s in measured),
           "peak_reserved_gb": max(s["peak_reserved_gb"] for s in measured),
           "memory_flat": len({s["peak_reserved_gb"] for s in measured}) == 1,
           "micro_batches": len(backend._micro_batches(b.to(backend.device))), "adapter_parameters": adapters,
           "model_tflop_per_step": round(mfu_flops / 1e12, 1)}
    if args.profile:
        row["profile"] = profile_step(backend, b)
    del backend
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/gpu/results")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=32, help="the lora variants' adapter rank (alpha 2 x rank)")
    parser.add_argument("--name", default=None, help="the results file (default: train_step[_<size>]_h200.json)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script runs (CPU too)")
    parser.add_argument("--commit", default=None, help="the commit measured (the device's copy has no .git)")
    parser.add_argument("--size", default="4B-full-vocab", choices=["4B-full-vocab", *sorted(common.SIZES)],
                        help="another shape of common.SIZES (a mixture of experts: FLOPs of the active experts); "
                             "its results go to train_step_<size>_h200.json")
    args = parser.parse_args()
    global SHAPE
    if args.smoke:
        SHAPE = dict(common.SIZES["smoke"])
    elif args.size != "4B-full-vocab":
        SHAPE = dict(common.SIZES[args.size])
    peak = matmul_tflops()
    print(f"bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    root = Path("/tmp/train_step_models")
    size = "4B-full-vocab" if args.smoke else args.size
    common.SIZES[size] = SHAPE
    t0 = time.time()
    model_dir = root / size
    if args.smoke or not (model_dir / "model.safetensors").is_file():  # kept across calls while the machine is warm
        model_dir = common.make_model(root, size, "bfloat16", max_position_embeddings=4096)
    result = {"command": " ".join(sys.argv), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "commit": args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                      text=True).stdout.strip() or None, "shape": SHAPE, "make_model_s": round(time.time() - t0, 1),
              "bf16_matmul_tflops": round(peak, 1),
              "step": {"samples": args.samples, "prompt": args.prompt, "response": args.response,
                       "tokens": args.samples * (args.prompt + args.response), "max_tokens_per_gpu": args.max_tokens,
                       "gradient_checkpointing": True, "log_probs_chunk_size": args.chunk, "bf16": True},
              "variants": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        try:
            result["variants"].append(run_variant(model_dir, variant, args, peak))
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' numbers
            result["variants"].append({"variant": variant, "error": f"{type(exc).__name__}: {exc}"[:3000]})
            print(f"[{variant}] failed: {exc}", flush=True)
        name = args.name or ("train_step_h200.json" if args.size == "4B-full-vocab"
                             else f"train_step_{args.size}_h200.json")
        (out / name).write_text(json.dumps(result, indent=2))  # after each: a timeout keeps it
    print(json.dumps({v["variant"]: {k: v.get(k) for k in ("train_s", "mfu", "hfu", "peak_reserved_gb", "error")}
                      for v in result["variants"]}, indent=2))


if __name__ == "__main__":
    main()
