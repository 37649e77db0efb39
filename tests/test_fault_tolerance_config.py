"""--use-fault-tolerance's flags (Miles' names): what they configure, the bad input refused naming the flag
and the fix, and the bound on repairs (a fault that comes back at every restart ends in one error; a
long run's occasional faults do not add up to it)."""

import time

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.config import FaultToleranceConfig
from rlplacement.errors import ConfigError
from rlplacement.job.fault_tolerance import FaultTolerance, FaultToleranceExhausted

SPLIT = ("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "1")


def config(*argv: str):
    return config_from_args(build_parser().parse_args([*SPLIT, *argv]))


def test_the_flags_configure_the_repairs():
    ft = config("--use-fault-tolerance", "--ft-components", "rollout,train", "--save", "/tmp/s",
                "--save-interval", "5", "--rollout-health-check-interval", "5", "--rollout-health-check-timeout", "7",
                "--rollout-health-check-first-wait", "60").fault_tolerance
    assert (ft.enabled, ft.components) == (True, ("rollout", "train"))
    assert (ft.health_check_interval_s, ft.health_check_timeout_s, ft.health_check_first_wait_s) == (5, 7, 60)
    assert ft.repairs("train") and ft.repairs("rollout")
    off = config().fault_tolerance
    assert not off.enabled and not off.repairs("rollout")


@pytest.mark.parametrize("argv, message", [
    (("--ft-components", "rollout,train"),
     r"--ft-components configures fault tolerance, which is off: add --use-fault-tolerance, or drop --ft-components"),
    (("--use-fault-tolerance", "--ft-components", "rollout,train"),
     r"--ft-components train restarts a dead trainer from its last checkpoint: set --save"),
    (("--use-fault-tolerance", "--ft-components", "rollout,engines"),
     r"--ft-components 'rollout,engines': use a comma-separated subset of rollout,train"),
    (("--use-fault-tolerance", "--rollout-health-check-timeout", "0"),
     r"--rollout-health-check-timeout 0.0: must be a positive number of seconds"),
])
def test_bad_fault_tolerance_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        config(*argv)


def test_repairs_are_bounded_within_a_window_not_over_the_runs_life():
    ft = FaultTolerance(job=None, config=FaultToleranceConfig(enabled=True, max_restarts=2, restart_window_s=60))
    long_ago = time.monotonic() - 120
    ft.restarts_begun += [("engine", long_ago)] * 5
    assert ft._count("engine") == 0  # five restarts two minutes ago do not count against the next
    ft.restarts_begun += [("engine", time.monotonic())] * 2
    with pytest.raises(FaultToleranceExhausted, match=r"engine 0 needs a restart \(hung\), but 2 engine restarts "
                                                      r"were made within 60 s already"):
        ft._replace_engine(0, "hung")  # refused before it touches the job
    with pytest.raises(FaultToleranceExhausted, match=r"the trainer needs a restart \(died\), but 2 trainer"):
        ft.restarts_begun += [("trainer", time.monotonic())] * 2
        ft.restart_trainer("died")
    with pytest.raises(ConfigError, match="--rollout-health-check-interval"):
        FaultToleranceConfig(enabled=True, health_check_interval_s=-1)

