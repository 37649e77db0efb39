"""--ft-components train restarts a dead trainer from its last checkpoint; checkpoints are written every
--save-interval train steps, and none without it. So the pair is refused naming what is missing: with --save
alone the restarted trainer would fall back to the model folder and lose every step trained so far."""

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.errors import ConfigError

SPLIT = ("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "1")
FT_TRAIN = ("--use-fault-tolerance", "--ft-components", "rollout,train")


def config(*argv: str):
    return config_from_args(build_parser().parse_args([*SPLIT, *argv]))


def test_trainer_repair_without_a_save_interval_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"--ft-components train restarts a dead trainer from its last checkpoint: "
                                          r"set --save-interval \(a checkpoint is written to --save every "
                                          r"--save-interval train steps"):
        config(*FT_TRAIN, "--save", str(tmp_path / "ckpt"))


def test_trainer_repair_without_either_names_both(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint: set --save and --save-interval \("):
        config(*FT_TRAIN)


def test_trainer_repair_with_both_is_accepted(tmp_path):
    ft = config(*FT_TRAIN, "--save", str(tmp_path / "ckpt"), "--save-interval", "5")
    assert ft.fault_tolerance.repairs("train") and ft.train.save_interval == 5
    engines_only = config("--use-fault-tolerance", "--ft-components", "rollout")  # no checkpoint needed
    assert engines_only.fault_tolerance.repairs("rollout") and not engines_only.fault_tolerance.repairs("train")
