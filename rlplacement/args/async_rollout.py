"""Fully asynchronous rollout flags (Miles' names: ``--fully-async``, ``--pause-generation-mode``,
``--partial-rollout``, ``--max-weight-staleness`` ...) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get, require_positive
from rlplacement.args.placement import require_both_resident
from rlplacement.config import PAUSE_GENERATION_MODES, AsyncRolloutConfig, PlacementConfig, default_of
from rlplacement.errors import ConfigError

TITLE = "rlplacement: fully asynchronous rollout"
FLAGS = (
    flag("--fully-async", action="store_true", default=default_of(AsyncRolloutConfig, "fully_async"),
         help="Split layouts: engines generate continuously while the trainer trains; weight updates land "
              "between engine steps without draining them (rlplacement.AsyncRollout)."),
    flag("--pause-generation-mode", choices=PAUSE_GENERATION_MODES, default=None,
         help="--fully-async: what an update does to requests in flight: abort (end them, partial samples), "
              "retract (recompute their KV under the new weights; the default) or in_place (keep their KV)."),
    flag("--partial-rollout", action="store_true", default=default_of(AsyncRolloutConfig, "partial_rollout"),
         help="--fully-async: continue samples an update cut short (abort) in a later request instead of "
              "generating them again."),
    flag("--mask-offpolicy-in-partial-rollout", action="store_true",
         default=default_of(AsyncRolloutConfig, "mask_offpolicy_in_partial_rollout"),
         help="--partial-rollout: train only on tokens sampled by the engines' current version."),
    flag("--max-weight-staleness", type=int, default=default_of(AsyncRolloutConfig, "max_weight_staleness"),
         help="--fully-async: recycle (never train on) a group whose oldest token is more than N versions "
              "behind the engines'."),
    flag("--update-weights-interval", type=int, default=default_of(AsyncRolloutConfig, "update_weights_interval"),
         help="Update the engines every K train calls (RLJob.update_weights sends on every K-th, else "
              "returns None)."),
    flag("--over-sampling-batch-size", type=int, default=default_of(AsyncRolloutConfig, "over_sampling_batch_size"),
         help="--fully-async: prompts submitted at a time when generation is topped up."),
    flag("--async-max-concurrent-samples", type=int,
         default=default_of(AsyncRolloutConfig, "async_max_concurrent_samples"),
         help="--fully-async: the most samples generating at once over all engines."),
)
ONLY_ASYNC = ("pause_generation_mode", "partial_rollout", "max_weight_staleness", "over_sampling_batch_size",
              "async_max_concurrent_samples")


def _name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def async_rollout_from_args(args: argparse.Namespace, placement: PlacementConfig) -> AsyncRolloutConfig:
    fully_async = bool(get(args, "fully_async"))
    staleness = get(args, "max_weight_staleness")
    if staleness is not None and staleness < 0:
        raise ConfigError(f"--max-weight-staleness {staleness} is negative: set it to 0 (only samples of the "
                          f"engines' current version) or more.")
    require_positive(args, ("update_weights_interval", "over_sampling_batch_size", "async_max_concurrent_samples"))
    if fully_async:  # colocated: the single-GPU form of the split layout, decided here for the whole run
        require_both_resident(placement, "--fully-async under --colocate keeps the engines generating while the "
                                         "trainer trains on the same GPUs, so neither side may be moved off them (the "
                                         "hand-off would put the engines to sleep or the trainer on the host)")
    if fully_async and placement.one_step_off:
        raise ConfigError("--fully-async and --one-step-off are two ways to overlap rollout with training: keep one "
                          "(--fully-async bounds staleness with --max-weight-staleness).")
    if not fully_async:
        given = [_name(d) for d in ONLY_ASYNC if get(args, d) not in (None, False)]
        if given:
            raise ConfigError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --fully-async: "
                              f"add --fully-async, or drop {' and '.join(given)}.")
    partial = bool(get(args, "partial_rollout"))
    mask = bool(get(args, "mask_offpolicy_in_partial_rollout"))
    if mask and not partial:
        raise ConfigError("--mask-offpolicy-in-partial-rollout masks the tokens a partial rollout carried over from "
                          "older versions: add --partial-rollout, or drop --mask-offpolicy-in-partial-rollout.")
    mode = get(args, "pause_generation_mode") or default_of(AsyncRolloutConfig, "pause_generation_mode")
    return AsyncRolloutConfig(fully_async=fully_async, pause_generation_mode=mode, partial_rollout=partial,
                              mask_offpolicy_in_partial_rollout=mask, max_weight_staleness=staleness,
                              update_weights_interval=int(get(args, "update_weights_interval")),
                              over_sampling_batch_size=get(args, "over_sampling_batch_size"),
                              async_max_concurrent_samples=get(args, "async_max_concurrent_samples"))
