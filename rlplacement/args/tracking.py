"""Experiment-tracker flags (Miles' names and defaults: W&B and TensorBoard) and their validation."""

from __future__ import annotations

import argparse
import datetime
import os

from rlplacement.args.common import flag, get, require_choice
from rlplacement.config import WANDB_MODES, TrackingConfig, default_of
from rlplacement.errors import ConfigError
from rlplacement.telemetry.trackers import INSTALL_HINT, tensorboard_writer_available, wandb_installed

TITLE = "rlplacement: experiment trackers"
FLAGS = (
    flag("--use-wandb", action="store_true", default=default_of(TrackingConfig, "use_wandb"),
         help="Log every step's telemetry scalars to a Weights & Biases run (the trackers extra)."),
    flag("--wandb-mode", type=str, default=default_of(TrackingConfig, "wandb_mode"), choices=WANDB_MODES,
         help="online, offline (the run folder only; `wandb sync` uploads it later) or disabled; "
              "default: WANDB_MODE, else online."),
    flag("--wandb-dir", type=str, default=default_of(TrackingConfig, "wandb_dir"),
         help="Folder the W&B run folder goes under; default: WANDB_DIR, else the working directory."),
    flag("--wandb-project", type=str, default=default_of(TrackingConfig, "wandb_project")),
    flag("--wandb-group", type=str, default=default_of(TrackingConfig, "wandb_group")),
    flag("--use-tensorboard", action="store_true", default=default_of(TrackingConfig, "use_tensorboard"),
         help="Write every step's telemetry scalars to a TensorBoard event file (the trackers extra)."),
    flag("--tb-project-name", type=str, default=default_of(TrackingConfig, "tb_project_name"),
         help="Events go to tensorboard_log/<project>/<experiment>, or to TENSORBOARD_DIR when it is set."),
    flag("--tb-experiment-name", type=str, default=default_of(TrackingConfig, "tb_experiment_name"),
         help="Default: the start time, YYYYmmdd_HHMMSS."),
)
WANDB_ONLY = ("wandb_mode", "wandb_dir", "wandb_project", "wandb_group")
TENSORBOARD_ONLY = ("tb_project_name", "tb_experiment_name")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def tracking_from_args(args: argparse.Namespace, *, this_host: bool = True) -> TrackingConfig:
    """``this_host=False`` (a plan made from anywhere) skips whether wandb or a TensorBoard writer is installed."""
    require_choice(args, ("wandb_mode",))
    use_wandb, use_tensorboard = bool(get(args, "use_wandb")), bool(get(args, "use_tensorboard"))
    for use, name, dests in ((use_wandb, "--use-wandb", WANDB_ONLY), (use_tensorboard, "--use-tensorboard",
                                                                      TENSORBOARD_ONLY)):
        given = [f"{_flag(d)} {get(args, d)}" for d in dests if get(args, d) is not None]
        if given and not use:
            raise ConfigError(f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} a tracker that is off: "
                              f"add {name}, or drop {' and '.join(g.split()[0] for g in given)}.")
    if this_host and use_wandb and not wandb_installed():
        raise ConfigError(f"--use-wandb needs the wandb package, which is not installed: {INSTALL_HINT}, or drop "
                          f"--use-wandb.")
    if this_host and use_tensorboard and tensorboard_writer_available() is None:
        raise ConfigError(f"--use-tensorboard needs a TensorBoard writer and neither tensorboardX nor tensorboard "
                          f"(for torch.utils.tensorboard) is installed: {INSTALL_HINT} (tensorboardX), or drop "
                          f"--use-tensorboard.")
    project, experiment, log_dir = get(args, "tb_project_name"), get(args, "tb_experiment_name"), None
    if use_tensorboard:
        env_dir = os.environ.get("TENSORBOARD_DIR")
        if project is None and not env_dir:
            raise ConfigError("--use-tensorboard needs --tb-project-name (events go to "
                              "tensorboard_log/<project>/<experiment>) or TENSORBOARD_DIR, the folder to write to: "
                              "set one of them.")
        if experiment is None and project is not None:
            experiment = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")  # Miles' default, recorded once
        log_dir = env_dir or os.path.join("tensorboard_log", project, experiment)
    if this_host:  # the trackers write there from the first step
        from rlplacement.atomic_files import check_writable

        if use_wandb and get(args, "wandb_dir"):
            check_writable(get(args, "wandb_dir"), "--wandb-dir")
        if log_dir is not None:
            where = "TENSORBOARD_DIR" if os.environ.get("TENSORBOARD_DIR") else "--use-tensorboard's folder"
            check_writable(log_dir, where)
    return TrackingConfig(use_wandb=use_wandb, wandb_mode=get(args, "wandb_mode"), wandb_dir=get(args, "wandb_dir"),
                          wandb_project=get(args, "wandb_project"), wandb_group=get(args, "wandb_group"),
                          use_tensorboard=use_tensorboard, tb_project_name=project, tb_experiment_name=experiment,
                          tb_log_dir=log_dir)
