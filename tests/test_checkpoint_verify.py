"""A ``--save`` checkpoint is checked before it is loaded: its files against the checksums its manifest
recorded (a flipped byte or a missing file refused naming the file, on the driver's preflight and in
the trainer before anything is unpickled), its model against ``--hf-checkpoint`` (a mismatch refused
naming the field and both values), and the driver's job state comes back with it. One FSDP trainer
rank in this process (gloo), tiny models; one save shared by the tests."""

import json
import shutil
import time
from pathlib import Path

import pytest

from rlplacement.backends import checkpoint_files, checkpoint_manifest, train_checkpoint
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(family="qwen3")
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
TRAIN = TrainConfig(global_batch_size=4, micro_batch_size=2, bf16=False)
JOB_STATE = {"generate_calls": 3, "epoch": 0, "run_id": "abc", "extra_state": {"prompt_position": 6}}


def _backend(hf, load=None):
    from rlplacement.backends import make_backend

    return make_backend(BackendConfig(name="fsdp", hf_checkpoint=str(hf), load=load and str(load)), SGD, TRAIN)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {"hf": make_tiny_model(base / "hf", SPEC),
            "wider": make_tiny_model(base / "wider", TinySpec(family="qwen3", hidden_size=96)),
            "vocab": make_tiny_model(base / "vocab", TinySpec(family="qwen3", vocab_size=320))}


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """A --save folder of one train step, with a job state; and the weights it holds."""
    from rlplacement.backends.hf_reference import random_batch

    root = tmp_path_factory.mktemp("save") / "ckpt"
    backend = _backend(models["hf"])
    backend.train_step(random_batch(SPEC.vocab_size, batch=4, seq=10, prompt=3, seed=1))
    backend.save_checkpoint(str(root), weight_version=2, job_state=JOB_STATE)
    weights = {n: t.clone() for n, t in backend.iter_hf_tensors()}
    return root, weights


def _copy(saved, tmp_path) -> tuple[Path, Path]:
    root = Path(shutil.copytree(saved[0], tmp_path / "ckpt"))
    return root, train_checkpoint.latest(root)


def test_the_manifest_records_every_file_and_the_model_and_a_whole_checkpoint_loads(saved, models):
    import torch

    root, weights = saved
    folder = train_checkpoint.latest(root)
    manifest = checkpoint_manifest.read_manifest(folder)
    assert sorted(manifest["files"]) == checkpoint_manifest.files_of(folder)
    assert {".metadata", "trainer_state.json", "rng_rank0.pt"} <= set(manifest["files"])
    model = manifest["model"]
    assert (model["model_type"], model["hidden_size"], model["vocab_size"], model["dtype"]) == ("qwen3", 64, 300,
                                                                                              "float32")
    assert model["parameters"]["model.embed_tokens.weight"] == [300, 64]
    checkpoint_files.check_load(root, models["hf"])  # the driver's preflight passes
    backend = _backend(models["hf"], load=root)
    assert backend.resumed["job_state"] == JOB_STATE and backend.resumed["weight_version"] == 2
    assert all(torch.equal(t, weights[n]) for n, t in backend.iter_hf_tensors())


def test_a_flipped_byte_in_a_shard_is_refused_naming_the_file_before_loading(saved, models, tmp_path):
    root, folder = _copy(saved, tmp_path)
    shard = sorted(folder.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    message = rf"{shard} does not match the checksum recorded when it was saved .* point --load at an earlier"
    with pytest.raises(ConfigError, match=message):
        checkpoint_files.check_load(root, models["hf"])  # the driver, before any process starts
    with pytest.raises(ConfigError, match=message):
        _backend(models["hf"], load=root)  # the trainer rank, before DCP reads a byte of it


def test_a_flipped_byte_in_the_pickled_metadata_is_refused_before_it_is_unpickled(saved, tmp_path):
    root, folder = _copy(saved, tmp_path)
    metadata = folder / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-3] ^= 0x40
    metadata.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"{metadata} does not match the checksum"):
        checkpoint_files.check_whole(folder)


def test_a_missing_file_or_manifest_is_refused_by_name(saved, models, tmp_path):
    root, folder = _copy(saved, tmp_path)
    (folder / "rng_rank0.pt").unlink()
    with pytest.raises(ConfigError, match=rf"{folder / 'rng_rank0.pt'} is missing \(the checkpoint's manifest lists"):
        _backend(models["hf"], load=root)
    (folder / checkpoint_manifest.MANIFEST).unlink()
    with pytest.raises(ConfigError, match=rf"{folder / checkpoint_manifest.MANIFEST} is missing, though .* says it "
                                          r"was written"):
        checkpoint_files.check_whole(folder)


def test_an_edited_manifest_is_refused(saved, tmp_path):
    root, folder = _copy(saved, tmp_path)
    path = folder / checkpoint_manifest.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][".metadata"]["bytes"] += 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=rf"{path} is damaged \(it does not match its own digest\)"):
        checkpoint_files.check_whole(folder)


def test_a_checkpoint_of_another_model_is_refused_naming_the_field(saved, models):
    root, _ = saved
    with pytest.raises(ConfigError, match=rf"hidden_size is 64 in the checkpoint, 96 in --hf-checkpoint "
                                          rf"{models['wider']}"):
        checkpoint_files.check_load(root, models["wider"])
    with pytest.raises(ConfigError, match=r"vocab_size is 300 in the checkpoint, 320 in --hf-checkpoint"):
        _backend(models["vocab"], load=root)  # in the trainer too (a restarted one skips the preflight)


def test_a_weight_of_another_shape_is_named(saved, models):
    recorded = checkpoint_manifest.read_manifest(train_checkpoint.latest(saved[0]))["model"]
    edited = {**recorded, "parameters": {**recorded["parameters"], "lm_head.weight": [301, 64]}}
    with pytest.raises(ConfigError, match=r"weight lm_head.weight has shape \[301, 64\] in the checkpoint, "
                                          r"\[300, 64\] in --hf-checkpoint"):
        checkpoint_files.check_identity(edited, models["hf"])


def test_an_older_checkpoint_without_manifest_or_job_state_still_loads(saved, models, tmp_path):
    root, folder = _copy(saved, tmp_path)
    (folder / checkpoint_manifest.MANIFEST).unlink()
    state = json.loads((folder / train_checkpoint.STATE).read_text())
    del state["manifest"], state["job_state"]
    (folder / train_checkpoint.STATE).write_text(json.dumps(state))
    checkpoint_files.check_whole(folder)
    assert _backend(models["hf"], load=root).resumed["job_state"] == {}


def test_a_job_state_json_cannot_hold_is_refused_before_writing(models, tmp_path):
    backend = _backend(models["hf"])
    with pytest.raises(ConfigError, match=r"save_checkpoint\(job_state=...\): .*set.* keep it to JSON values"):
        backend.save_checkpoint(str(tmp_path / "ckpt"), 1, job_state={"seen": {1, 2}})
    assert not (tmp_path / "ckpt").exists()


def test_hashing_is_streamed_at_disk_speed(tmp_path):
    """The rate the docs state: a 32 MiB file hashed in 8 MiB pieces (memory stays flat)."""
    import os

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(32 << 20))
    start = time.perf_counter()
    checkpoint_manifest.file_digest(big)
    rate = 32 / 1024 / (time.perf_counter() - start)
    print(f"xxh3-64 streamed: {rate:.2f} GB/s")
    assert rate > 0.05  # a loose floor: the suite shares 2 cores


def test_rljob_start_refuses_an_edited_file_before_any_process_starts(saved, models, tmp_path):
    """The saved train-call count edited (same size): RLJob.start names the file before Ray starts."""
    import ray

    import rlplacement
    from rlplacement.args import build_parser, config_from_args

    root, folder = _copy(saved, tmp_path)
    state_file = folder / train_checkpoint.STATE
    state_file.write_text(state_file.read_text().replace('"train_calls": 1', '"train_calls": 7'))
    config = config_from_args(build_parser().parse_args(
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp",
         "--hf-checkpoint", str(models["hf"]), "--load", str(root)]))
    with pytest.raises(ConfigError, match=rf"{state_file} does not match the checksum recorded when it was saved"):
        rlplacement.RLJob.start(config, str(models["hf"]))
    assert not ray.is_initialized()
