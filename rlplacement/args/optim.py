"""Optimizer and learning-rate schedule flags (Megatron's names) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get, require_choice, require_positive, require_set
from rlplacement.config import LR_DECAY_STYLES, OptimConfig, default_of

TITLE = "rlplacement: optimizer"
FLAGS = (
    flag("--optimizer", type=str, default="adam", choices=("adam", "sgd"),
         help="adam: AdamW (decoupled weight decay, as Megatron's adam), or sgd."),
    flag("--lr", type=float, default=default_of(OptimConfig, "lr")),
    flag("--min-lr", type=float, default=default_of(OptimConfig, "min_lr")),
    flag("--lr-decay-style", type=str, default=default_of(OptimConfig, "lr_decay_style"),
          choices=LR_DECAY_STYLES),
    flag("--lr-decay-iters", type=int, default=default_of(OptimConfig, "lr_decay_iters"),
          help="Optimizer steps the decay lasts (needed unless --lr-decay-style constant)."),
    flag("--lr-warmup-iters", type=int, default=default_of(OptimConfig, "lr_warmup_iters")),
    flag("--clip-grad", type=float, default=default_of(OptimConfig, "max_grad_norm"),
          help="Clip the global gradient norm to this (0 disables)."),
    flag("--weight-decay", type=float, default=default_of(OptimConfig, "weight_decay")),
    flag("--adam-beta1", type=float, default=default_of(OptimConfig, "betas")[0]),
    flag("--adam-beta2", type=float, default=default_of(OptimConfig, "betas")[1]),
    flag("--adam-eps", type=float, default=default_of(OptimConfig, "eps")),
)


def optim_from_args(args: argparse.Namespace) -> OptimConfig:
    require_positive(args, ("lr", "adam_eps"))
    require_choice(args, ("lr_decay_style", "optimizer"))
    clip = get(args, "clip_grad")
    name = "sgd" if get(args, "optimizer") == "sgd" else "adamw"  # megatron's adam is AdamW (decoupled decay)
    return OptimConfig(name=name, lr=float(require_set(args, "lr")), min_lr=float(require_set(args, "min_lr")),
                       lr_decay_style=require_set(args, "lr_decay_style"), lr_decay_iters=get(args, "lr_decay_iters"),
                       lr_warmup_iters=int(get(args, "lr_warmup_iters") or 0),
                       weight_decay=float(require_set(args, "weight_decay")),
                       betas=(float(require_set(args, "adam_beta1")), float(require_set(args, "adam_beta2"))),
                       eps=float(require_set(args, "adam_eps")), max_grad_norm=None if clip is None else float(clip))
