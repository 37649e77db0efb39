"""Bad files and folders are named before any process starts, with what to do, no traceback: damaged
safetensors, a hub id where a folder belongs, an index naming a missing shard, folders the run cannot
write (--save, --update-weight-disk-dir, `convert --save`), a conversion at a TP it cannot serve."""

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from rlplacement.args import build_parser, config_from_args
from rlplacement.backends.preflight import preflight
from rlplacement.config import BackendConfig
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "model")


def _copy(tiny, tmp_path):
    import shutil

    return shutil.copytree(tiny, tmp_path / "model")


def _fsdp(hf_dir) -> BackendConfig:
    return BackendConfig(name="fsdp", hf_checkpoint=str(hf_dir))


def test_a_truncated_safetensors_file_is_named(tiny, tmp_path):
    hf = _copy(tiny, tmp_path)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ConfigError, match=rf"{weights}: tensor '.*' ends at byte \d+ of \d+ the file holds: the file "
                                          r"is truncated; copy or save it again"):
        preflight(_fsdp(hf))


def test_garbage_and_a_broken_header_are_named(tiny, tmp_path):
    hf = _copy(tiny, tmp_path)
    weights = hf / "model.safetensors"
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=rf"{weights}: not a safetensors file \(its 64 bytes hold no valid header"):
        preflight(_fsdp(hf))
    weights.write_bytes(struct.pack("<Q", 5) + b"{oops" + b"\0" * 16)
    with pytest.raises(ConfigError, match=rf"{weights}: its safetensors header is not valid JSON"):
        preflight(_fsdp(hf))


def test_an_index_naming_a_missing_shard_is_refused(tiny, tmp_path):
    hf = _copy(tiny, tmp_path)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors",
                                                                               "y": "model.safetensors"}}))
    with pytest.raises(ConfigError, match=r"names shard\(s\) that are not in .*: model-00002-of-00002.safetensors"):
        preflight(_fsdp(hf))


def test_a_hub_id_is_told_models_are_read_from_disk():
    with pytest.raises(ConfigError, match=r"--hf-checkpoint Qwen/Qwen3-0.6B: no such folder; pass a local Hugging Face "
                                          r"model folder \(models are read from disk, never fetched from a hub"):
        preflight(_fsdp("Qwen/Qwen3-0.6B"))


def test_folders_the_run_cannot_write_are_refused_before_it_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    with pytest.raises(ConfigError, match=rf"--save {blocker}/ckpt: {blocker} is not writable by this user"):
        config_from_args(build_parser().parse_args([*base, "--save", str(blocker / "ckpt")]))
    with pytest.raises(ConfigError, match=rf"--save {blocker} is a file, not a folder"):
        config_from_args(build_parser().parse_args([*base, "--save", str(blocker)]))
    argv = [*base, "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(blocker / "deltas")]
    with pytest.raises(ConfigError, match=rf"--update-weight-disk-dir {blocker}/deltas: {blocker} is not writable"):
        config_from_args(build_parser().parse_args(argv))
    plan = subprocess.run([sys.executable, "-m", "rlplacement.cli", "plan", *argv], capture_output=True, text=True,
                          timeout=60)
    assert plan.returncode == 2 and f"--update-weight-disk-dir {blocker}/deltas: {blocker} is not writable" in plan.stderr
    assert "Traceback" not in plan.stderr
    ok = config_from_args(build_parser().parse_args([*base, "--save", str(tmp_path / "new" / "ckpt")]))
    assert ok.train.save == str(tmp_path / "new" / "ckpt")  # a folder that can be created is fine


def test_convert_names_an_unwritable_save_and_a_conversion_it_cannot_reuse(tiny, tmp_path):
    from rlplacement.backends.megatron import checkpoint_layout as layout

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = subprocess.run([sys.executable, "-m", "rlplacement.cli", "convert", "--hf-checkpoint", str(tiny), "--save",
                          str(blocker / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--save {blocker}/out: {blocker} is not writable" in out.stderr
    assert "Traceback" not in out.stderr
    done = tmp_path / "converted"
    done.mkdir()
    (done / layout.META).write_text(json.dumps({"padded_vocab_size": 384}))
    (done / layout.MARKER).write_text("release")
    for tp, code, said in ((2, 0, "serves --tensor-model-parallel-size 2 as it is: nothing to do"),
                           (5, 2, "padded vocabulary (384) does not split over --tensor-model-parallel-size 5: "
                                  "convert into another folder")):
        out = subprocess.run([sys.executable, "-m", "rlplacement.cli", "convert", "--hf-checkpoint", str(tiny), "--save",
                              str(done), "--tensor-model-parallel-size", str(tp)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == code and said in out.stdout + out.stderr


def test_the_example_names_a_missing_model_folder_before_reading_its_tokenizer(tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny_grpo.py"
    out = subprocess.run([sys.executable, str(example), "--hf-checkpoint", str(tmp_path / "no-model"), "--train-backend",
                          "fsdp", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--hf-checkpoint {tmp_path}/no-model: no such folder; pass a local Hugging Face model folder" in out.stderr


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "tp1"
    proc = subprocess.run([sys.executable, "-m", "rlplacement.cli", "convert", "--hf-checkpoint", str(tiny), "--save",
                           str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_a_truncated_or_missing_checkpoint_shard_is_named_before_loading(converted, tmp_path):
    import shutil

    from rlplacement.backends.checkpoint_files import check_whole, loaded_folder

    check_whole(loaded_folder(converted))  # a whole conversion passes
    damaged = shutil.copytree(converted, tmp_path / "damaged")
    shard = sorted(loaded_folder(damaged).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=rf"--load {damaged}/release: {shard} holds \d+ bytes but its metadata places data up "
                                          r"to byte \d+: the file is truncated"):
        check_whole(loaded_folder(damaged))
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"{shard} is missing \(its metadata names it\)"):
        check_whole(loaded_folder(damaged))
