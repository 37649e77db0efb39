"""torchtitan backend on one GPU: log-probs and one training step vs the HF reference, weight stream bytes.

Run: ``python3 benchmarks/gpu/torchtitan_check.py --out DIR`` (from the repo root, one CUDA GPU).
Needs torch (CUDA), triton, transformers, safetensors, torchtitan 0.3.0 (+ tyro, einops, spmd_types)
and rlplacement only; no datasets/wandb/tensorboard/torchdata are imported. torch names that
torchtitan 0.3.0 imports but this torch lacks are stood in for (listed in the JSON as
``torch_names_stood_in_for``; see rlplacement/backends/torchtitan_compat.py).
``--device cpu`` is a smoke run of the same checks (gloo; needs triton importable for torchtitan).
Each case runs in its own try block so one run reports them all; DIR/torchtitan_check.json has the summary.

Cases: tiny Qwen3 (untied and tied embeddings) and tiny Llama (GQA, interleaved-RoPE permutation),
all made with ``rlplacement.models.tiny``. Per fp32 case:
(1) log-probs of the backend vs the HF model before training (tolerance 1e-4; torchtitan's SDPA
    module falls back to the math kernel in fp32, HF's SDPA picks its own fp32 kernel; the CPU
    smoke run measured 0 for Qwen3 and 5e-7 for Llama);
(2) one SGD step on the same batch: grad norm vs the HF reference (rel 1e-4), every streamed HF
    tensor vs the HF reference's parameter after its step (atol 1e-5, rtol 1e-4);
(3) the streamed tensors, mapped back to torchtitan layout, bit-equal to the full parameters the
    backend holds, and the streamed name set equal to the HF model's.
A bf16 case (Qwen3) checks the bf16 path runs: log-probs vs HF bf16 within 5e-2 and a finite step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

FP32_LOGP_TOL = 1e-4  # GPU: HF's SDPA kernel and torchtitan's (math in fp32) sum in different orders; CPU gave 5e-7
FP32_PARAM_ATOL, FP32_PARAM_RTOL = 1e-5, 1e-4
BF16_LOGP_TOL = 5e-2


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for mod in ("torchtitan", "triton", "transformers", "spmd_types", "tyro", "einops"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - reported, the cases then say why they fail
            out[mod] = f"missing ({type(exc).__name__}: {exc})"
    return out


def run_case(out: Path, family: str, tied: bool, dtype: torch.dtype, allow_cpu: bool) -> dict:
    from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
    from rlplacement.backends import make_backend
    from rlplacement.families import torchtitan_mapping
    from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(family=family, num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_size=128,
                    intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=tied)
    hf = make_tiny_model(out / f"hf_{family}_{'tied' if tied else 'untied'}", spec)
    sgd = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
    result: dict = {"family": family, "tied": tied, "dtype": str(dtype).replace("torch.", "")}

    t0 = time.perf_counter()
    # the parameters' own precision throughout (no mixed precision): the fp32 cases compare with HF at 1e-4
    backend = make_backend(BackendConfig(name="torchtitan", hf_checkpoint=str(hf)), sgd, TrainConfig(bf16=False),
                           dtype=dtype, allow_cpu=allow_cpu)
    result["build_s"] = round(time.perf_counter() - t0, 3)
    device = backend.device
    batch = random_batch(spec.vocab_size, batch=4, seq=24, prompt=6, seed=3)

    ref = load_hf(hf, dtype=dtype).to(device)
    logp = backend.log_probs(batch)
    ref_logp = hf_log_probs(ref, batch.input_ids.to(device))
    mask = batch.loss_mask.to(device).bool()
    result["logp_max_abs_diff"] = float((logp - ref_logp)[mask].abs().max())
    result["logp_all_positions_max_abs_diff"] = float((logp - ref_logp)[:, 1:].abs().max())

    t0 = time.perf_counter()
    metrics = backend.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    result["step_s"] = round(time.perf_counter() - t0, 3)
    result["metrics"] = metrics
    if dtype == torch.bfloat16:
        result["ok"] = (result["logp_max_abs_diff"] <= BF16_LOGP_TOL and all(
            v == v and abs(v) != float("inf") for v in metrics.values()))
        result["tolerance"] = {"logp": BF16_LOGP_TOL}
        streamed = dict(backend.iter_hf_tensors())
        result["streamed_dtypes"] = sorted({str(t.dtype) for t in streamed.values()})
        return result

    ref_metrics = hf_reference_step(ref, [batch.to(device)], sgd)
    result["ref_metrics"] = ref_metrics
    grad_rel = abs(metrics["grad_norm"] - ref_metrics["grad_norm"]) / max(ref_metrics["grad_norm"], 1e-12)
    result["grad_norm_rel_diff"] = grad_rel

    t0 = time.perf_counter()
    streamed = {name: t.clone() for name, t in backend.iter_hf_tensors()}
    result["stream_s"] = round(time.perf_counter() - t0, 3)
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    result["missing_or_extra"] = sorted(set(streamed) ^ set(expected))
    worst, worst_name, not_close = 0.0, None, []
    for name in sorted(set(streamed) & set(expected)):
        a, b = streamed[name].float(), expected[name].float()
        diff = float((a - b).abs().max())
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(a, b, atol=FP32_PARAM_ATOL, rtol=FP32_PARAM_RTOL):
            not_close.append(name)
    result["param_max_abs_diff"], result["param_worst"], result["params_not_close"] = worst, worst_name, not_close

    # bytes: streamed HF tensor -> torchtitan layout == the full parameter the backend holds
    not_equal = []
    for tt_name, param in backend.model.named_parameters():
        held = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        hf_name = torchtitan_mapping.torchtitan_to_hf_name(tt_name)
        back = torchtitan_mapping.hf_to_torchtitan_tensor(tt_name, streamed[hf_name], backend.hf_config)
        if back.dtype != held.dtype or not torch.equal(back.contiguous().view(torch.uint8),
                                                      held.detach().contiguous().view(torch.uint8)):
            not_equal.append(hf_name)
    result["not_bit_equal_to_held"] = not_equal
    result["tolerance"] = {"logp": FP32_LOGP_TOL, "param_atol": FP32_PARAM_ATOL, "param_rtol": FP32_PARAM_RTOL,
                           "grad_norm_rel": 1e-4}
    result["ok"] = (result["logp_max_abs_diff"] <= FP32_LOGP_TOL and grad_rel <= 1e-4 and not not_close
                    and not result["missing_or_extra"] and not not_equal)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder for the tiny models and torchtitan_check.json.")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: smoke run with gloo (needs triton importable).")
    parser.add_argument("--cases", default="qwen3,qwen3-tied,llama,qwen3-bf16",
                        help="Comma-separated subset of qwen3, qwen3-tied, llama, llama-tied, qwen3-bf16.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from rlplacement.backends import launch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("[torchtitan_check] no CUDA device; use --device cpu for a smoke run", flush=True)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons mean fp32 GEMMs
    torch.backends.cudnn.allow_tf32 = False
    launch.init_single_process("nccl" if args.device == "cuda" else "gloo")
    summary: dict = {"versions": _versions(), "cases": {}}
    t0 = time.perf_counter()
    try:
        from rlplacement.backends.torchtitan.backend import torchtitan_import_error

        summary["torchtitan_import_error"] = torchtitan_import_error()
        from rlplacement.backends.torchtitan.compat import PLACEHOLDERS

        summary["torch_names_stood_in_for"] = list(PLACEHOLDERS)
    except Exception:  # noqa: BLE001
        summary["torchtitan_import_error"] = traceback.format_exc()
    summary["import_s"] = round(time.perf_counter() - t0, 3)

    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        family = case.split("-")[0]
        tied = "tied" in case.split("-")
        dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
        try:
            result = run_case(out, family, tied, dtype, allow_cpu=args.device == "cpu")
        except Exception:  # noqa: BLE001 - every case reports
            result = {"ok": False, "error": traceback.format_exc()}
        summary["cases"][case] = result
        print(f"[torchtitan_check] {case}: " + json.dumps({k: v for k, v in result.items() if k != "error"}),
              flush=True)
        if "error" in result:
            print(result["error"], flush=True)
    summary["ok"] = bool(summary["cases"]) and all(r.get("ok") for r in summary["cases"].values())
    (out / "torchtitan_check.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"[torchtitan_check] ok={summary['ok']} -> {out / 'torchtitan_check.json'}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
