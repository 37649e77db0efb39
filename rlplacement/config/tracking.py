"""Experiment trackers every telemetry row goes to: Weights & Biases and TensorBoard."""

from __future__ import annotations

import dataclasses

from rlplacement.errors import ConfigError


WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Experiment trackers every telemetry row goes to (Miles' flags): a Weights & Biases run and a TensorBoard
    event file (``rlplacement.telemetry.trackers``; both need the ``trackers`` extra)."""

    use_wandb: bool = False
    """Log every step's scalars to a Weights & Biases run (``--use-wandb``)."""
    wandb_mode: str | None = None
    """``online`` (uploads as it runs), ``offline`` (writes the run folder only: nothing leaves the machine,
    ``wandb sync`` uploads it later) or ``disabled`` (writes nothing); None: ``WANDB_MODE`` decides, else online."""
    wandb_dir: str | None = None
    """Folder the run folder is written under (``<wandb_dir>/wandb/offline-run-...``); None: ``WANDB_DIR``,
    else the working directory."""
    wandb_project: str | None = None
    """The W&B project; None: ``WANDB_PROJECT``, else wandb's default (``uncategorized``)."""
    wandb_group: str | None = None
    """The W&B group the run belongs to (runs of one experiment side by side); None: no group."""
    use_tensorboard: bool = False
    """Write every step's scalars to a TensorBoard event file in ``tb_log_dir`` (``--use-tensorboard``)."""
    tb_project_name: str | None = None
    """``--tb-project-name``: with ``tb_experiment_name``, names the folder of the event file."""
    tb_experiment_name: str | None = None
    """``--tb-experiment-name``; left unset with a project name, the time validation ran (``%Y%m%d_%H%M%S``)."""
    tb_log_dir: str | None = None
    """The folder the event file goes to, as Miles picks it: ``TENSORBOARD_DIR`` when set, else
    ``tensorboard_log/<tb_project_name>/<tb_experiment_name>`` under the working directory."""

    def __post_init__(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode {self.wandb_mode!r} is unknown: use one of {', '.join(WANDB_MODES)}.")
        if self.use_tensorboard and not self.tb_log_dir:
            raise ConfigError("use_tensorboard needs tb_log_dir, the folder its event file goes to.")
