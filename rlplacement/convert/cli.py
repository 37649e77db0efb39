"""``rlplacement convert``: HF folder -> Megatron torch_dist checkpoint, once; with ``--to-fp8``, a bf16 HF folder
-> a block-quantized FP8 folder for the engines (``rlplacement.convert.to_fp8``).

Bad input (missing folder, no config.json, no safetensors, an unsupported family, sizes that do not
divide the model) is refused from ``config.json`` alone before torch.distributed or megatron start.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rlplacement.args import add_flag
from rlplacement.backends import quiet
from rlplacement.errors import ConfigError

DESCRIPTION = """\
Convert a Hugging Face model folder (config.json + *.safetensors) into a Megatron-core torch_dist
checkpoint for `--train-backend megatron --load DIR`. The architecture is read from config.json
(Qwen3, Qwen2, Llama dense; Qwen3-MoE). The folder gets latest_checkpointed_iteration.txt last: a rerun on a
finished folder does nothing; a half-finished folder is cleared and redone. --save must be a new or empty
folder (or such a conversion), never the Hugging Face folder itself.

With --to-fp8 it writes instead a block-quantized FP8 Hugging Face folder (float8_e4m3fn linear weights with
fp32 weight_scale_inv per --fp8-block-size block; embeddings, norms, routers and the output layer unchanged) for
engines that serve FP8 while the trainer trains from the bf16 folder."""

EPILOG = """\
examples:
  rlplacement convert --hf-checkpoint /models/Qwen3-0.6B --save /ckpt/qwen3-tp1
  rlplacement convert --hf-checkpoint /models/Qwen3-8B --save /ckpt/qwen3-tp2 --tensor-model-parallel-size 2
  rlplacement convert --hf-checkpoint /models/Qwen3-30B-A3B --save /ckpt/qwen3-moe --expert-model-parallel-size 8
  rlplacement convert --to-fp8 --hf-checkpoint /models/Qwen3-8B --save /models/Qwen3-8B-FP8
  torchrun --nproc-per-node 2 -m rlplacement.cli convert --hf-checkpoint HF --save DIR --tensor-model-parallel-size 2
Without torchrun, TP x PP x EP local processes are started (gloo on CPU, NCCL on GPU). Experts are saved
by their global index, so the checkpoint loads at any expert-parallel size that divides the experts."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="HF folder -> Megatron torch_dist checkpoint (once)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True, metavar="DIR",
                   help="Hugging Face model folder: config.json and *.safetensors (single or sharded).")
    p.add_argument("--save", required=True, metavar="DIR", help="Output folder for the torch_dist checkpoint.")
    add_flag(p, "--tensor-model-parallel-size", metavar="N",
             help="TP size to shard for (must divide the attention and key/value heads); default 1. "
                  "A checkpoint loads at other TP sizes too.")
    add_flag(p, "--pipeline-model-parallel-size", metavar="M", help="PP size (must divide num_hidden_layers); default 1.")
    add_flag(p, "--expert-model-parallel-size", metavar="E",
             help="Mixture-of-experts models: expert-parallel size to convert with (must divide num_experts; each "
                  "rank reads only its experts); default 1. The checkpoint loads at other sizes too.")
    p.add_argument("--layer-spec", choices=("auto", "local", "te"), default="auto",
                   help="Megatron layer spec: te (TransformerEngine, fused layer-norm names), local, or auto "
                        "(te when TransformerEngine and CUDA are there). Default auto.")
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar over tensors.")
    p.add_argument("--to-fp8", action="store_true",
                   help="Write a block-quantized FP8 Hugging Face folder to --save instead of a torch_dist checkpoint.")
    p.add_argument("--fp8-block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                   help="With --to-fp8: the block of one scale (default 128 128, what vLLM's FP8 kernels take).")
    return p


MEGATRON_ONLY = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def _to_fp8(args: argparse.Namespace) -> int:
    from rlplacement.convert import to_fp8

    given = [f"--{flag.replace('_', '-')}" for flag in MEGATRON_ONLY if getattr(args, flag) != 1]
    if given or args.layer_spec != "auto":
        given += ["--layer-spec"] if args.layer_spec != "auto" else []
        raise ConfigError(f"{', '.join(given)}: a torch_dist conversion's flags; --to-fp8 writes a Hugging Face "
                          f"folder that any engine layout loads: drop them")
    block = (args.fp8_block_size[0], args.fp8_block_size[1])
    if to_fp8.finished(args.save, block):
        print(f"rlplacement convert --to-fp8: {args.save} is already converted: nothing to do")
        return 0
    count = to_fp8.convert(args.hf_checkpoint, args.save, block, progress=not args.no_progress)
    print(f"rlplacement convert --to-fp8: {count} weights quantized in blocks of {block[0]}x{block[1]} -> {args.save}")
    return 0


def _convert_rank(rank: int, world: int, hf: str, save: str, tp: int, pp: int, spec: str, progress: bool,
                  ep: int = 1) -> str:
    from rlplacement.backends.quiet import quiet_trainer_notices

    quiet_trainer_notices()  # each rank drops megatron's notices to its developers (RLPLACEMENT_QUIET_... set by main)
    from rlplacement.convert.hf_to_megatron import convert

    return convert(hf, save, tp, pp, spec, progress, ep=ep)


def validate(args: argparse.Namespace) -> None:
    """Refuse bad input from config.json alone (no torch.distributed, no megatron import)."""
    from rlplacement.config import BackendConfig
    from rlplacement.atomic_files import check_writable
    from rlplacement.backends.preflight import preflight

    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be 1 or more, got {getattr(args, flag)}")
    check_writable(args.save, "--save")
    _refuse_a_folder_that_is_not_a_conversion(args.hf_checkpoint, args.save)
    preflight(BackendConfig(name="megatron", hf_checkpoint=args.hf_checkpoint,
                            tensor_model_parallel_size=args.tensor_model_parallel_size,
                            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                            expert_model_parallel_size=args.expert_model_parallel_size), for_training=False)


def _refuse_a_folder_that_is_not_a_conversion(hf: str, save: str) -> None:
    """``--save`` must be new, empty, or a conversion cut short (only the entries a conversion writes): a
    rerun clears a half-finished conversion, and must never write beside, or clear, the user's own files."""
    from rlplacement.backends.megatron import checkpoint_layout as layout

    save_path, hf_path = Path(save), Path(hf)
    if save_path.exists() and hf_path.exists() and save_path.resolve() == hf_path.resolve():
        raise ConfigError(f"--save {save} is --hf-checkpoint's folder: the checkpoint would be written into the "
                          f"Hugging Face folder; pass a new folder to --save")
    if layout.state(save_path) != "partial":
        return
    ours = {layout.RELEASE, layout.HF_CONFIG_DIR, layout.META, layout.META + ".tmp", layout.MARKER + ".tmp"}
    others = sorted(entry.name for entry in save_path.iterdir() if entry.name not in ours)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(f"--save {save} is not empty and not a conversion (it holds {shown}): pass a new or empty "
                          f"folder to --save")


def main(args: argparse.Namespace) -> int:
    if args.to_fp8:
        return _to_fp8(args)
    if args.fp8_block_size != [128, 128]:
        raise ConfigError("--fp8-block-size goes with --to-fp8: add --to-fp8, or drop it")
    os.environ.setdefault(quiet.ENV, "1")  # inherited by the ranks it spawns
    from rlplacement.backends.megatron import checkpoint_layout as layout
    from rlplacement.convert.run import run_collective

    if layout.state(args.save) == "finished":  # fast path: no torch.distributed, no megatron import
        padded, tp = int(layout.read_meta(args.save)["padded_vocab_size"]), args.tensor_model_parallel_size
        if padded % tp:
            raise ConfigError(f"--save {args.save} holds a conversion whose padded vocabulary ({padded}) does not split "
                              f"over --tensor-model-parallel-size {tp}: convert into another folder, or remove "
                              f"{args.save} first")
        print(f"rlplacement convert: {args.save} is already converted ({layout.MARKER} present); a torch_dist "
              f"checkpoint loads at any TP that divides its padded vocabulary ({padded}), so it serves "
              f"--tensor-model-parallel-size {tp} as it is: nothing to do")
        return 0
    validate(args)
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    run_collective(_convert_rank, tp * pp * ep, args.hf_checkpoint, args.save, tp, pp, args.layer_spec,
                   not args.no_progress, ep)
    return 0
