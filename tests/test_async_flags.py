"""The fully asynchronous rollout flags and --use-tis: bad input refused before any work, naming the flag."""

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.errors import ConfigError

SPLIT = ["--rollout-num-gpus", "1"]


def _config(argv):
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv, message", [
    (["--colocate", "--fully-async"], "--fully-async under --colocate keeps the engines generating while the "
                                      "trainer trains on the same GPUs, so neither side may be moved off them (the "
                                      "hand-off would put the engines to sleep or the trainer on the host): add "
                                      "--no-offload-train --no-offload-rollout"),
    (["--colocate", "--fully-async", "--no-offload-train"], "add --no-offload-rollout .both resident"),
    (["--colocate", "--train-during-rollout", "--no-offload-train"],
     "--train-during-rollout under --colocate trains beside engines that are still decoding, so neither side may be "
     "moved off the GPUs mid-rollout .* add --no-offload-rollout .both resident for the whole run"),
    (SPLIT + ["--max-weight-staleness", "2"], "--max-weight-staleness only applies with --fully-async"),
    (SPLIT + ["--fully-async", "--max-weight-staleness", "-1"], "--max-weight-staleness -1 is negative"),
    (SPLIT + ["--pause-generation-mode", "abort"], "--pause-generation-mode only applies with --fully-async"),
    (SPLIT + ["--partial-rollout", "--max-weight-staleness", "1"],
     "--partial-rollout, --max-weight-staleness only apply with --fully-async"),
    (SPLIT + ["--fully-async", "--mask-offpolicy-in-partial-rollout"], "add --partial-rollout"),
    (SPLIT + ["--fully-async", "--one-step-off"], "keep one"),
    (SPLIT + ["--update-weights-interval", "0"], "--update-weights-interval must be positive"),
    (SPLIT + ["--tis-clip", "3"], "--tis-clip bounds the truncated importance weight, which is off: add --use-tis"),
    (SPLIT + ["--use-tis", "--tis-clip", "0"], "--tis-clip 0.0 must be above 0"),
    (SPLIT + ["--use-tis", "--tis-clip-low", "2"], "--tis-clip-low 2.0 must be at least 0 and below --tis-clip 2.0"),
])
def test_bad_async_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        _config(argv)


def test_fully_async_under_colocate_takes_both_sides_resident():
    c = _config(["--colocate", "--no-offload-train", "--no-offload-rollout", "--fully-async"])
    assert c.async_rollout.fully_async and c.placement.colocate
    assert (c.placement.offload_train, c.placement.offload_rollout) == (False, False)


def test_fully_async_flags_resolve_with_the_defaults_of_miles():
    c = _config(SPLIT + ["--fully-async", "--partial-rollout", "--max-weight-staleness", "2", "--use-tis"])
    a = c.async_rollout
    assert (a.fully_async, a.pause_generation_mode, a.partial_rollout, a.max_weight_staleness) == (True, "retract",
                                                                                                     True, 2)
    assert (c.train.use_tis, c.train.tis_clip, c.train.tis_clip_low) == (True, 2.0, 0.0)
    assert _config(SPLIT).async_rollout.fully_async is False
