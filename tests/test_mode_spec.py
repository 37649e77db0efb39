"""A transfer mode is one package that registers one ``ModeSpec``: a dummy mode defined only in a test
package (tests/dummy_mode) works with the flags, ``plan --emit verl|miles``, the advisor and ``bench``
with no edit anywhere else; and the registry refuses what a spec cannot be."""

import json

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.cli import main
from rlplacement.errors import ConfigError
from rlplacement.transfer import registry
from rlplacement.transfer.spec import ModeSpec
from tests import dummy_mode

SPLIT = ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]


@pytest.fixture
def dummy():
    dummy_mode.register()
    yield dummy_mode.SPEC
    dummy_mode.unregister()


def test_the_flags_offer_the_mode_and_its_own_option(dummy):
    parser = build_parser()
    assert "--dummy-pigeons" in parser.format_help() and "dummy" in parser.format_help()
    config = config_from_args(parser.parse_args([*SPLIT, "--update-weight-transfer-mode", "dummy", "--dummy-pigeons", "3"]))
    assert config.transfer.mode == "dummy" and config.transfer.options == dummy_mode.DummyOptions(pigeons=3)
    assert registry.sender_options(config.transfer, "dummy") == {"pigeons": 3}
    with pytest.raises(ConfigError, match=r"--dummy-pigeons 0: use 1 or more"):
        config_from_args(parser.parse_args([*SPLIT, "--update-weight-transfer-mode", "dummy", "--dummy-pigeons", "0"]))
    with pytest.raises(ConfigError, match=r"--update-weight-transfer-mode dummy cannot be used with --colocate"):
        config_from_args(parser.parse_args(["--colocate", "--update-weight-transfer-mode", "dummy"]))


def test_plan_emits_the_mode_for_verl_and_miles(dummy, capsys):
    argv = ["plan", *SPLIT, "--update-weight-transfer-mode", "dummy", "--dummy-pigeons", "3"]
    assert main([*argv, "--emit", "verl"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    ce = "actor_rollout_ref.rollout.checkpoint_engine"
    assert f"{ce}.backend=rlplacement_dummy" in line.split()
    assert f"+{ce}.engine_kwargs.rlplacement_dummy.dummy_pigeons=3" in line.split()
    assert main([*argv, "--emit", "miles"]) == 0
    out = capsys.readouterr().out
    assert "--custom-weight-transfer-protocol-path rlplacement.integrations.miles.dummy" in out
    assert "--dummy-pigeons 3" in out
    from rlplacement.integrations import miles

    assert miles.dummy.__name__ == "dummy"  # the factory the emitted flag names exists


def test_the_advisor_models_the_mode_from_its_spec(dummy):
    from rlplacement.advisor.measure import Measurement, Placement
    from rlplacement.advisor.model import transfer_path
    from rlplacement.advisor.thresholds import ModelAssumptions
    from rlplacement.advisor.transfer_mode import advise_transfer_mode

    a = ModelAssumptions()
    assert transfer_path(Placement(False, 4, 4), "dummy", 8, a) == ("nvlink/dummy", a.nvlink_gbps * 0.9)
    m = Measurement(placement=Placement(False, 4, 4), gpus_per_engine=1, num_gpus_per_node=8, transfer_mode="broadcast",
                    steps=3, step_time=10.0, rollout_time=6.0, sync_time=0.25, train_time=2.0, train_wait=0.0,
                    rollout_wait=0.0, rollout_tail=0.0, rollout_scalable=6.0, rollout_fit="quantile", finish_p50=1.0,
                    finish_p99=2.0, tail_share=0.0, samples_per_step=8, max_response_len=64, group_size=4,
                    sync_bytes=16e9, sync_density=None, overlapped=False, response_lengths=(8,) * 8)
    advice = advise_transfer_mode(m, a)
    assert "dummy" in advice.predicted_sync_s
    assert advice.recommended == "dummy"  # the fastest share of the same link


def test_bench_measures_the_mode_against_its_ceiling(dummy, capsys):
    assert main(["bench", "--mode", "dummy", "--size-mb", "2", "--num-tensors", "25", "--bucket-mb", "1",
                 "--repeats", "1", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["mode"] == "dummy" and row["ceiling"] == "flat broadcast" and row["transport"] == "gloo"
    assert row["bytes"] > 1e6 and row["ratio"] > 0


def test_the_registry_refuses_a_taken_name_and_a_spec_without_layouts():
    with pytest.raises(ValueError, match=r"transfer mode 'broadcast' is already registered"):
        registry.register_mode(ModeSpec(name="broadcast", sender="m:S", receiver="m:R", summary="again"))
    with pytest.raises(ValueError, match=r"layouts must be a non-empty subset"):
        registry.register_mode(ModeSpec(name="nowhere", sender="m:S", receiver="m:R", summary="x", layouts=frozenset()))
    assert "nowhere" not in registry.specs()
