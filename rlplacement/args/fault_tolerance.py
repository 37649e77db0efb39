"""Fault-tolerance flags (Miles' names and defaults, plus ``--ft-components``) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get
from rlplacement.config import FT_COMPONENTS, FaultToleranceConfig, TrainConfig, default_of
from rlplacement.errors import ConfigError

TITLE = "rlplacement: fault tolerance"
FLAGS = (
    flag("--use-fault-tolerance", action="store_true", default=default_of(FaultToleranceConfig, "enabled"),
         help="Repair the run as it goes: restart dead or hung engines (and, with --ft-components train, a dead "
              "trainer from the last checkpoint, written every --save-interval steps to --save), bringing each "
              "to the trainer's weights before it serves."),
    flag("--ft-components", type=str, default=",".join(default_of(FaultToleranceConfig, "components")),
         help=f"What --use-fault-tolerance repairs: a comma-separated subset of {','.join(FT_COMPONENTS)}."),
    flag("--rollout-health-check-interval", type=float,
         default=default_of(FaultToleranceConfig, "health_check_interval_s"),
         help="Seconds between engine health checks (run between steps)."),
    flag("--rollout-health-check-timeout", type=float,
         default=default_of(FaultToleranceConfig, "health_check_timeout_s"),
         help="Seconds an engine has to answer a health check before it is killed and restarted."),
    flag("--rollout-health-check-first-wait", type=float,
         default=default_of(FaultToleranceConfig, "health_check_first_wait_s"),
         help="Seconds after start before the first health check (first-use compilation)."),
)
DEPENDENT = ("ft_components", "rollout_health_check_interval", "rollout_health_check_timeout",
             "rollout_health_check_first_wait")


def fault_tolerance_from_args(args: argparse.Namespace, train: TrainConfig) -> FaultToleranceConfig:
    enabled = bool(get(args, "use_fault_tolerance"))
    components = tuple(c.strip() for c in str(get(args, "ft_components")).split(",") if c.strip())
    if not enabled:
        given = [f"--{d.replace('_', '-')}" for d in DEPENDENT
                 if get(args, d) is not None and get(args, d) != _default(d)]
        if given:
            raise ConfigError(f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} fault tolerance, which "
                              f"is off: add --use-fault-tolerance, or drop {' and '.join(given)}.")
    config = FaultToleranceConfig(enabled=enabled, components=components,
                                  health_check_interval_s=float(get(args, "rollout_health_check_interval")),
                                  health_check_timeout_s=float(get(args, "rollout_health_check_timeout")),
                                  health_check_first_wait_s=float(get(args, "rollout_health_check_first_wait")))
    if config.repairs("train") and (not train.save or train.save_interval is None):
        # without an interval no checkpoint is written, and a restarted trainer would fall back to the model
        # folder: every step trained so far lost, silently
        missing = " and ".join(f for f, unset in (("--save", not train.save),
                                                  ("--save-interval", train.save_interval is None)) if unset)
        raise ConfigError(f"--ft-components train restarts a dead trainer from its last checkpoint: set {missing} "
                          f"(a checkpoint is written to --save every --save-interval train steps; e.g. --save DIR "
                          f"--save-interval 10), or drop train from --ft-components.")
    return config


def _default(dest: str):
    return next(f.kwargs.get("default") for f in FLAGS if f.dest == dest)
