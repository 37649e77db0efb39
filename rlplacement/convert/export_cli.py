"""``rlplacement export-hf``: Megatron torch_dist checkpoint -> Hugging Face folder."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rlplacement.args import add_flag
from rlplacement.backends import quiet
from rlplacement.errors import ConfigError

DESCRIPTION = """\
Write a Megatron-core torch_dist checkpoint (from `rlplacement convert`, or a megatron run's --save folder)
back as a Hugging Face folder: q/k/v and gate/up un-fused, vocabulary padding dropped, config.json and
tokenizer copied. A round trip HF -> convert -> export-hf gives every tensor back bit for bit. An fsdp
run's --save folder becomes an HF folder too (pass the run's model folder as --hf-config). A LoRA run's --save folder (--lora-rank)
becomes a PEFT adapter folder, or with --merge-lora the --hf-config base with the adapters merged in."""

EPILOG = """\
examples:
  rlplacement export-hf --load /ckpt/qwen3-tp2 --save /models/qwen3-export
  rlplacement export-hf --load /ckpt/external --save OUT --hf-config /models/Qwen3-8B
  rlplacement export-hf --load /runs/fsdp-save --save /models/trained --hf-config /models/Qwen3-0.6B
  rlplacement export-hf --load /ckpt/lora-run --save /adapters/step100 --hf-config /models/Qwen3-4B"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export-hf", help="Megatron torch_dist checkpoint -> HF folder",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, metavar="DIR",
                   help="Converted torch_dist folder, or a training run's --save folder (each holds "
                        "latest_checkpointed_iteration.txt).")
    p.add_argument("--save", required=True, metavar="DIR", help="Output Hugging Face folder.")
    p.add_argument("--hf-config", default=None, metavar="DIR",
                   help="HF folder with config.json/tokenizer (default: the copy convert kept in --load).")
    add_flag(p, "--tensor-model-parallel-size", metavar="N",
             help="TP used to read the checkpoint (any size the model divides); default 1.")
    p.add_argument("--layer-spec", choices=("auto", "local", "te"), default="auto",
                   help="Megatron layer spec to read with (see `rlplacement convert --help`). Default auto.")
    p.add_argument("--max-shard-bytes", type=int, default=5 * 1024**3, metavar="BYTES",
                   help="Largest safetensors file to write; more files get an index (HF layout). Default 5 GiB.")
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar over tensors.")
    p.add_argument("--merge-lora", action="store_true",
                   help="A LoRA run's --save folder: write the --hf-config base with the adapters merged in (an HF "
                        "folder) instead of a PEFT adapter folder.")
    return p


def _export_rank(rank: int, world: int, load: str, save: str, hf_config: str | None, tp: int, spec: str,
                 max_shard_bytes: int, progress: bool = True):
    from rlplacement.backends.quiet import quiet_trainer_notices

    quiet_trainer_notices()  # each rank drops megatron's notices to its developers (RLPLACEMENT_QUIET_... set by main)
    from rlplacement.convert.megatron_to_hf import export

    return export(load, save, hf_config, tp=tp, spec=spec, max_shard_bytes=max_shard_bytes, progress=progress)


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault(quiet.ENV, "1")  # inherited by the ranks it spawns
    from rlplacement.backends.megatron import checkpoint_layout as layout
    from rlplacement.convert.run import run_collective

    from rlplacement.atomic_files import check_writable

    load = Path(args.load)
    _refuse_save_onto_an_input(args)
    check_writable(args.save, "--save")
    lora_export = _lora_export(load, args)
    if lora_export is not None:
        return lora_export
    if args.merge_lora:
        raise ConfigError(f"--merge-lora: --load {load} is not a LoRA run's --save folder (no adapters to merge)")
    if layout.state(load) != "finished":
        if (load / "config.json").is_file():
            raise ConfigError(f"--load {load} is a Hugging Face folder already: export-hf reads {READS}")
        raise ConfigError(f"--load {load}: no {layout.MARKER} there, so it holds no checkpoint: export-hf reads "
                          f"{READS}")
    full_export = _training_checkpoint_export(load, args)
    if full_export is not None:
        return full_export
    if args.hf_config is None and not (load / layout.HF_CONFIG_DIR / "config.json").is_file():
        raise ConfigError(f"--load {load} has no {layout.HF_CONFIG_DIR}/config.json: pass --hf-config HF_DIR")
    if args.hf_config is not None and not (Path(args.hf_config) / "config.json").is_file():
        raise ConfigError(f"--hf-config {args.hf_config}: no config.json there")
    if args.max_shard_bytes < 1:
        raise ConfigError("--max-shard-bytes must be positive")
    names = run_collective(_export_rank, args.tensor_model_parallel_size, str(load), args.save, args.hf_config,
                           args.tensor_model_parallel_size, args.layer_spec, args.max_shard_bytes,
                           not args.no_progress)
    print(f"rlplacement export-hf: wrote {len(names)} tensors to {args.save}")
    return 0


READS = ("a `rlplacement convert` output (`rlplacement convert --hf-checkpoint HF_DIR --save NEW_DIR` writes one), "
         "or the --save folder of a megatron or fsdp run, or of a LoRA run of either")


def _refuse_save_onto_an_input(args: argparse.Namespace) -> None:
    """The export replaces ``--save`` whole: it must not be the folder read from."""
    save = Path(args.save).resolve()
    for flag, value in (("--load", args.load), ("--hf-config", args.hf_config)):
        if value is not None and Path(value).resolve() == save:
            raise ConfigError(f"--save {args.save} is {flag}'s folder, which the export would replace: pass a new "
                              f"folder to --save")


def _training_checkpoint_export(load: Path, args: argparse.Namespace) -> int | None:
    """A full-weight ``--save`` folder of a backend other than megatron exported (:mod:`.fsdp_export`), or refused
    naming what exports; None for a megatron checkpoint (a conversion, or a megatron run's ``--save``, which keeps
    the conversion's description at its root)."""
    from rlplacement.backends.megatron import checkpoint_layout as layout
    from rlplacement.backends import train_checkpoint
    from rlplacement.convert import fsdp_export

    if not layout.is_training_checkpoint(load) or (load / layout.META).is_file():
        return None
    folder = train_checkpoint.latest(load)
    if args.hf_config is None:
        raise ConfigError(f"--load {load} is a training run's --save folder, which keeps no model description: pass "
                          f"--hf-config with the run's model folder (its --hf-checkpoint)")
    if not (Path(args.hf_config) / "config.json").is_file():
        raise ConfigError(f"--hf-config {args.hf_config}: no config.json there")
    if args.max_shard_bytes < 1:
        raise ConfigError("--max-shard-bytes must be positive")
    if fsdp_export.hf_names(folder, args.hf_config) is None:
        raise ConfigError(f"--load {load}: its checkpoint does not hold --hf-config {args.hf_config}'s tensors under "
                          f"their Hugging Face names (a torchtitan run's names its own way, or the run trained "
                          f"another model): export-hf reads {READS}")
    count = fsdp_export.export(folder, args.save, args.hf_config, args.max_shard_bytes)
    print(f"rlplacement export-hf: wrote {count} tensors to {args.save}")
    return 0


def _lora_export(load: Path, args: argparse.Namespace) -> int | None:
    """A LoRA run's ``--save`` folder exported (:mod:`.peft_export`); None when ``load`` is not one."""
    from rlplacement.backends import train_checkpoint
    from rlplacement.convert import peft_export

    try:
        folder = train_checkpoint.latest(load)
    except ConfigError:  # not a training checkpoint: a converted torch_dist folder, or nothing
        return None
    if peft_export.lora_spec(folder) is None:
        return None
    if args.hf_config is not None and not (Path(args.hf_config) / "config.json").is_file():
        raise ConfigError(f"--hf-config {args.hf_config}: no config.json there")
    count = peft_export.export(folder, args.save, args.hf_config, args.merge_lora)
    what = "merged weights" if args.merge_lora else "a PEFT adapter"
    print(f"rlplacement export-hf: wrote {what} ({count} tensors) to {args.save}")
    return 0
