"""Input that would be ignored or misnamed is refused, naming what the caller gave: LoRA's sub-flags without
``--lora-rank``, and a wrong ``hf_dir`` passed to ``RLJob.start`` (an argument, not a flag)."""

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.errors import ConfigError

BASE = ["--rollout-num-gpus", "1", "--train-backend", "fsdp"]


@pytest.mark.parametrize("extra, named", [
    (["--lora-adapter-path", "/some/adapters"], "--lora-adapter-path"),
    (["--target-modules", "foo_proj"], "--target-modules"),
    (["--lora-merge-for-rollout"], "--lora-merge-for-rollout"),
    (["--lora-alpha", "8"], "--lora-alpha"),
    (["--lora-dropout", "0.1"], "--lora-dropout"),
    (["--exclude-modules", "q_proj"], "--exclude-modules"),
    (["--lora-rank", "0", "--lora-merge-for-rollout"], "--lora-merge-for-rollout"),
], ids=["adapter-path", "target-modules", "merge", "alpha", "dropout", "exclude", "rank-0"])
def test_lora_sub_flags_without_a_rank_are_refused_by_name(extra, named):
    with pytest.raises(ConfigError, match=rf"^{named} configures LoRA adapters, and --lora-rank is 0 \(full "
                                          rf"fine-tuning\): set --lora-rank to the adapters' rank, or drop {named}$"):
        config_from_args(build_parser().parse_args([*BASE, *extra]))


def test_lora_defaults_without_a_rank_still_mean_full_fine_tuning():
    config = config_from_args(build_parser().parse_args([*BASE, "--target-modules", "all-linear"]))
    assert not config.backend.lora.enabled


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_rljob_start_names_its_hf_dir_argument_not_a_flag(tmp_path, folder):
    """Without ``--hf-checkpoint`` the trainer starts from ``RLJob.start``'s ``hf_dir``: a wrong one is refused
    naming that argument, before any process starts."""
    import rlplacement

    hf_dir = tmp_path / folder
    if folder == "empty":
        hf_dir.mkdir()
    config = config_from_args(build_parser().parse_args(BASE))
    with pytest.raises(ConfigError) as refused:
        rlplacement.RLJob.start(config, str(hf_dir))
    message = str(refused.value)
    assert message.startswith(f"hf_dir (RLJob.start's argument) {hf_dir}: "), message
    assert ("no such folder" if folder == "missing" else "no config.json there") in message
    assert "--hf-checkpoint" not in message
