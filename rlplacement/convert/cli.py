"""``rlplacement convert --hf-checkpoint DIR --save DIR [--tensor-model-parallel-size N]
[--pipeline-model-parallel-size M]``: HF folder -> Megatron torch_dist, once."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlplacement.args import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="HF folder -> Megatron torch_dist checkpoint",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint", required=True, help="Hugging Face model folder (config.json + safetensors).")
    p.add_argument("--save", required=True, help="Output folder for the torch_dist checkpoint.")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--layer-spec", choices=("auto", "local", "te"), default="auto",
                   help="Megatron layer spec: TransformerEngine when available (auto), or the local one.")
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    return p


def _convert_rank(rank: int, world: int, hf: str, save: str, tp: int, pp: int, spec: str, progress: bool) -> str:
    from rlplacement.convert.hf_to_megatron import convert

    return convert(hf, save, tp, pp, spec, progress)


def validate(args: argparse.Namespace) -> None:
    hf = Path(args.hf_checkpoint)
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {hf}: no config.json there; pass a Hugging Face model folder")
    if not any(hf.glob("*.safetensors")):
        raise ConfigError(f"--hf-checkpoint {hf}: no *.safetensors files; convert needs safetensors weights")
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be 1 or more")
    save = Path(args.save)
    if save.exists() and not save.is_dir():
        raise ConfigError(f"--save {save} is a file; pass a folder")
    from rlplacement.backends.megatron_model import load_hf_config
    from rlplacement.backends.families import family_for

    cfg = load_hf_config(hf)
    try:
        family_for(cfg, f"--hf-checkpoint {hf}/config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    groups = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if groups % args.tensor_model_parallel_size:
        raise ConfigError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide "
                          f"num_key_value_heads {groups} of {hf}/config.json: use a divisor of {groups}")
    if cfg.num_hidden_layers % args.pipeline_model_parallel_size:
        raise ConfigError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} does not divide "
                          f"num_hidden_layers {cfg.num_hidden_layers} of {hf}/config.json")


def main(args: argparse.Namespace) -> int:
    from rlplacement.convert import layout
    from rlplacement.convert.run import run_collective

    if layout.state(args.save) == "finished":  # fast path: no torch.distributed, no megatron import
        print(f"rlplacement convert: {args.save} is already converted ({layout.MARKER} present); nothing to do")
        return 0
    validate(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    run_collective(_convert_rank, tp * pp, args.hf_checkpoint, args.save, tp, pp, args.layer_spec,
                   not args.no_progress)
    return 0
