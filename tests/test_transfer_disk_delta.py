"""disk-delta: real safetensors folders on the real filesystem, sender and receivers through the
protocol (endpoint dict round trip included); one case with a real vLLM CPU engine under Ray."""

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rlplacement.errors import ConfigError
from rlplacement.transfer import delta_codec as codec
from rlplacement.transfer import registry
from rlplacement.transfer.base import TransferEndpoint, TransferError, UpdateAborted, WeightMismatchError
from rlplacement.transfer.disk_delta import folder_format
from rlplacement.transfer.disk_delta.folder_format import INDEX_NAME, index_checksum, read_pointer, version_folder
from rlplacement.transfer.disk_delta.receiver import DiskDeltaReceiver
from rlplacement.transfer.disk_delta.sender import DeltaUpdateReport, DiskDeltaSender
from tests import shared_ray

SHARD = 4096  # several shards per version


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.step": torch.tensor(7, dtype=torch.int64),  # 0-d
        "model.positions": torch.arange(100, dtype=torch.int32),
        "model.frozen": torch.randn(16, 16, generator=g),  # never changes: must never be stored
    }


def _perturb(w, seed, fraction=0.02, names=None):
    """Change ~``fraction`` of the elements of each (or each named) trainable tensor."""
    g = torch.Generator().manual_seed(seed)
    for name, t in w.items():
        if name == "model.frozen" or (names is not None and name not in names):
            continue
        flat = t.view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        if t.is_floating_point():
            flat[idx] = (flat[idx].float() + torch.randn(k, generator=g) * 0.5 + 0.25).to(t.dtype)
        else:
            flat[idx] = flat[idx] + 1


def _raw(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_bit_exact(staged, want):
    got = dict(staged)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_raw(got[name]), _raw(t)), f"{name} differs"


@pytest.fixture
def base(tmp_path):
    w = _weights()
    d = tmp_path / "hf"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d, w


def _pair(tmp_path, base_dir, encoding, n_receivers=1, **kw):
    sender = DiskDeltaSender(SHARD, disk_dir=tmp_path / "deltas", delta_encoding=encoding, base_dir=base_dir, **kw)
    endpoint = TransferEndpoint.from_dict(sender.listen(1 + n_receivers).to_dict())  # as it crosses Ray/vLLM
    sender.connect()
    receivers = []
    for rank in range(1, 1 + n_receivers):
        r = registry.receiver_class("disk-delta")("cpu")
        r.connect(endpoint, rank)
        receivers.append(r)
    return sender, receivers


def _receive(receiver, version, applied=None):
    receiver.begin(version)
    report = receiver.receive()
    receiver.commit(lambda staged: applied.append(dict(staged)) if applied is not None else None)
    return report


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_round_trip_bit_exact_over_versions(tmp_path, base, encoding):
    base_dir, w = base
    sender, receivers = _pair(tmp_path, base_dir, encoding, n_receivers=2)
    assert registry.sender_class("disk-delta") is DiskDeltaSender
    for version in range(1, 5):
        _perturb(w, seed=version)
        # receivers wait for the pointer while the sender writes, as under driver.run_update
        results, errors = {}, []

        def run(r):
            try:
                results[r.rank] = (_receive(r, version, applied := []), applied)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in receivers]
        [t.start() for t in threads]
        report = sender.update(version, list(w.items()))
        [t.join(30) for t in threads]
        assert not errors, errors
        assert isinstance(report, DeltaUpdateReport) and report.encoding == encoding
        assert report.base_version == version - 1  # version 0 is the HF checkpoint
        for r in receivers:
            assert r.version == version
            _assert_bit_exact(results[r.rank][1][0].items(), w)
        index = json.loads((tmp_path / "deltas" / version_folder(version) / INDEX_NAME).read_text())
        assert index["version"] == version and index["base_version"] == version - 1
        assert index["delta_encoding"] == encoding and index["checksum"] == "xxh3-64"
        assert "model.frozen" not in index["weight_map"]
        assert index["tensors"]["model.frozen"]["encoding"] == "unchanged"
        assert set(index["weight_map"]) == set(w) - {"model.frozen"}
        assert read_pointer(tmp_path / "deltas")["version"] == version
        # sparse: a few % of the bytes changed, and the folder holds far fewer bytes than the model
        total = sum(t.numel() * t.element_size() for t in w.values())
        assert report.bytes == total and 0.003 < report.density < 0.08
        assert report.density == report.changed_bytes / total
        assert 0 < report.wire_bytes < 0.6 * total
    # only the newest version and its base stay on disk
    assert sorted(p.name for p in (tmp_path / "deltas").glob("weight_v*")) == [version_folder(3), version_folder(4)]


def test_keyframe_without_base_checkpoint_then_deltas(tmp_path):
    w = _weights(1)
    sender, (r,) = _pair(tmp_path, None, "xor")
    report = sender.update(1, list(w.items()))
    assert report.base_version is None and report.density == 1.0  # everything stored whole
    applied = []
    _receive(r, 1, applied)
    _assert_bit_exact(applied[0].items(), w)
    _perturb(w, seed=5, fraction=0.01)
    report = sender.update(2, list(w.items()))
    assert report.base_version == 1 and report.density < 0.05
    _receive(r, 2, applied)
    _assert_bit_exact(applied[1].items(), w)


def test_receiver_rebuilt_on_reconnect_keeps_applying_deltas(tmp_path, base):
    """The vLLM backend makes a new receiver per init_transfer_engine, passing only the version."""
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor")
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    _receive(r, 1)
    assert r.release_staging() == 0  # a sleeping engine asks every mode; disk-delta keeps no staging
    rebuilt = DiskDeltaReceiver("cpu", version=r.version)
    rebuilt.connect(TransferEndpoint.from_dict(sender.listen(2).to_dict()), 1)
    _perturb(w, seed=2)
    sender.update(2, list(w.items()))
    applied = []
    _receive(rebuilt, 2, applied)
    _assert_bit_exact(applied[0].items(), w)


def test_keyframe_after_a_version_gap_or_a_new_listen(tmp_path, base):
    """A sender that cannot know which version the engines hold writes a self-contained version."""
    base_dir, w = base
    sender, (r, behind) = _pair(tmp_path, base_dir, "xor", n_receivers=2)
    _perturb(w, seed=1)
    assert sender.update(1, list(w.items())).base_version == 0
    _receive(r, 1)
    _perturb(w, seed=2)
    assert sender.update(3, list(w.items())).base_version is None  # version 2 was burnt
    for receiver in (r, behind):  # on version 1 and on version 0: both load it
        applied = []
        _receive(receiver, 3, applied)
        _assert_bit_exact(applied[0].items(), w)
    sender.listen(3)
    _perturb(w, seed=3)
    assert sender.update(4, list(w.items())).base_version is None
    _receive(r, 4)
    _perturb(w, seed=4)
    assert sender.update(5, list(w.items())).base_version == 4
    # a fresh sender (transfer_setup again) knows only the checkpoint: keyframe for version 6; the
    # engines join it again (driver.connect), as the job does after transfer_setup
    fresh = DiskDeltaSender(SHARD, disk_dir=tmp_path / "deltas", delta_encoding="xor", base_dir=base_dir)
    r.connect(TransferEndpoint.from_dict(fresh.listen(2).to_dict()), 1)
    fresh.connect()
    assert fresh.update(6, list(w.items())).base_version is None
    applied = []
    _receive(r, 6, applied)
    _assert_bit_exact(applied[0].items(), w)


def test_check_equal_checksums_match_the_receivers(tmp_path, base):
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor", check_equal=True)
    _perturb(w, seed=3)
    report = sender.update(1, list(w.items()))
    applied = []
    _receive(r, 1, applied)
    from rlplacement.transfer.base import tensor_checksum

    # the sender's checksums are of what it was given, and the receiver's staged tensors hash the same
    assert report.checksums == {n: tensor_checksum(t) for n, t in w.items()}
    assert {n: tensor_checksum(t) for n, t in applied[0].items()} == report.checksums


def _payload_span(shard: Path, name: str) -> tuple[int, int]:
    with open(shard, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    b, e = header[name]["data_offsets"]
    return 8 + n + b, 8 + n + e


def _two_versions(tmp_path, base):
    """Receiver on version 1, version 2 published and not yet read."""
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor")
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    _receive(r, 1)
    _perturb(w, seed=2)
    sender.update(2, list(w.items()))
    return sender, r, tmp_path / "deltas" / version_folder(2)


def _refused_and_still_on_version_1(r, match):
    r.begin(2)
    with pytest.raises(TransferError, match=match):
        r.receive()
    assert r.version == 1 and r.staged is None


def test_corrupt_shard_is_refused_naming_the_tensor_and_engine_keeps_old_version(tmp_path, base):
    sender, r, folder = _two_versions(tmp_path, base)
    victim = "model.layers.0.mlp.up_proj.weight"
    shard = folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][victim]
    start, end = _payload_span(shard, victim)
    data = bytearray(shard.read_bytes())
    data[(start + end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    applied = []
    r.begin(2)
    with pytest.raises(TransferError, match=f"tensor '{victim}' is corrupt in .*payload checksum"):
        r.receive()
    assert r.version == 1 and r.staged is None
    with pytest.raises(TransferError, match="without a fully received update"):
        r.commit(applied.append)
    assert applied == []


def test_corrupt_shard_header_is_refused_naming_the_shard(tmp_path, base):
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "overwrite")
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    folder = tmp_path / "deltas" / version_folder(1)
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[9] = ord("#")  # inside the JSON header
    shard.write_bytes(bytes(data))
    r.begin(1)
    with pytest.raises(TransferError, match=f"{shard.name} \\(tensors .*\\) is corrupt"):
        r.receive()
    assert r.version == 0


def _forge(folder, edit, signer=None):
    """Edit ``folder``'s index and recompute its plain checksum, as anyone who can write the folder can;
    ``signer``: also sign it with that sender's key (what only the trainer can do)."""
    index = json.loads((folder / INDEX_NAME).read_text())
    edit(index)
    if signer is not None:
        signer.identity.sign(index)
    index["index_checksum"] = index_checksum(index)
    (folder / INDEX_NAME).write_text(json.dumps(index))


def test_bit_flip_that_keeps_the_payload_checksum_is_still_caught_by_the_result(tmp_path, base):
    """A wrong expected checksum in an index the trainer itself signed (a trainer-side fault): the decoded
    result's checksum still refuses it."""
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor")
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    name = "model.layers.0.self_attn.q_proj.weight"
    _forge(tmp_path / "deltas" / version_folder(1), lambda i: i["tensors"][name].update(checksum="0" * 16), sender)
    r.begin(1)
    with pytest.raises(WeightMismatchError, match=f"tensor '{name}'"):
        r.receive()
    assert r.version == 0


def test_half_written_version_is_invisible_and_cleaned_up(tmp_path, base):
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor", timeout_s=0.5)
    root = tmp_path / "deltas"
    # a crash mid-write: a tmp folder with a partial shard and no index, never renamed
    crashed = root / f".tmp-{version_folder(1)}-deadbeef"
    crashed.mkdir()
    (crashed / "delta-00001.safetensors").write_bytes(b"\x10\x00\x00\x00partial")
    r.begin(1)
    with pytest.raises(TransferError, match=r"version 1 was not published in .* within 0s by the trainer of run \w+ "
                                            r"epoch 0 \(latest: none\)"):
        r.receive()
    assert r.version == 0 and read_pointer(root) is None
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    assert not crashed.exists() and not list(root.glob(".tmp-*"))
    applied = []
    _receive(r, 1, applied)
    _assert_bit_exact(applied[0].items(), w)


def test_failing_weight_source_publishes_nothing_and_stops_receivers(tmp_path, base):
    base_dir, w = base
    sender, (r,) = _pair(tmp_path, base_dir, "xor", timeout_s=20)

    def failing():
        yield from list(w.items())[:3]
        raise RuntimeError("gather failed at tensor 3")

    errors = []

    def run():
        try:
            r.begin(1)
            r.receive()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    with pytest.raises(UpdateAborted, match="gather failed at tensor 3"):
        sender.update(1, failing())
    t.join(5)
    assert not t.is_alive(), "the receiver did not stop within 5 s of the abort"
    assert len(errors) == 1 and isinstance(errors[0], UpdateAborted)
    assert "gather failed at tensor 3" in str(errors[0])
    root = tmp_path / "deltas"
    assert read_pointer(root) is None and not list(root.glob("weight_v*")) and not list(root.glob(".tmp-*"))
    # the sender's base is untouched by the failed attempt: retrying the version is still a delta on 0
    _perturb(w, seed=1)
    assert sender.update(1, list(w.items())).base_version == 0
    applied = []
    _receive(r, 1, applied)
    _assert_bit_exact(applied[0].items(), w)


def test_xor_applies_exactly_once(tmp_path, base):
    base_dir, w = base
    sender, (r, behind) = _pair(tmp_path, base_dir, "xor", n_receivers=2)
    _perturb(w, seed=1)
    sender.update(1, list(w.items()))
    _receive(r, 1)
    with pytest.raises(TransferError, match="version 1 is not newer than the served version 1"):
        r.begin(1)
    _perturb(w, seed=2)
    sender.update(2, list(w.items()))
    behind.begin(2)  # still on version 0: version 2 is an xor delta on 1
    with pytest.raises(TransferError, match="xor delta on version 1, but this engine serves version 0"):
        behind.receive()
    assert behind.version == 0
    # the codec itself: applied on the new bytes instead of its base, xor does not give them back
    old, new = np.arange(64, dtype=np.uint8), np.arange(64, dtype=np.uint8)
    new[5] ^= 0xFF
    enc = codec.encode(new, old, "xor")
    once = codec.decode("xor", enc.payload, old, 64, enc.extra)
    twice = codec.decode("xor", enc.payload, once, 64, enc.extra)
    assert np.array_equal(once, new) and not np.array_equal(twice, new)


def test_overwrite_is_idempotent_and_verified(tmp_path, base):
    old = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    new = old.copy()
    new[[3, 100, 4000]] += 1
    enc = codec.encode(new, old, "overwrite")
    assert enc.encoding == "overwrite" and enc.changed_bytes == 3
    once = codec.decode("overwrite", enc.payload, old, 4096, enc.extra)
    assert np.array_equal(once, new) and np.array_equal(codec.decode("overwrite", enc.payload, once, 4096, enc.extra), new)
    assert codec.encode(new, new, "overwrite").encoding == "unchanged"

    base_dir, w = base
    q, emb = "model.positions", "model.embed_tokens.weight"
    sender, (fresh, other) = _pair(tmp_path, base_dir, "overwrite", n_receivers=2)
    # v1 and v2 change the same bytes of q (every byte of the elements): v2's overwrite lands on v0 too
    idx = torch.arange(0, w[q].numel(), 7)
    w[q][idx] = 0x01010101
    sender.update(1, list(w.items()))
    w[q][idx] = 0x02020202
    sender.update(2, list(w.items()))
    applied = []
    _receive(fresh, 2, applied)  # serves 0, skips 1
    _assert_bit_exact(applied[0].items(), w)
    # v3 changes embed only; v1 changed q, so v3's overwrite on v0 bytes is refused naming q
    w[emb].view(-1)[:10] += 1
    sender.update(3, list(w.items()))
    other.begin(3)
    with pytest.raises(WeightMismatchError, match=f"unchanged tensor; the engine serves version 0\\): tensor '{q}'"):
        other.receive()
    assert other.version == 0


def test_bad_configuration_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--update-weight-delta-encoding 'zip'"):
        DiskDeltaSender(SHARD, disk_dir=tmp_path, delta_encoding="zip")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TransferError, match="--update-weight-disk-dir .* is not a writable folder"):
        DiskDeltaSender(SHARD, disk_dir=blocker / "sub").listen(2)
    r = DiskDeltaReceiver()
    endpoint = TransferEndpoint("disk-delta", "h", 0, 2, "file", str(tmp_path / "missing"))
    with pytest.raises(TransferError, match="--update-weight-disk-dir .*missing is not a folder"):
        r.connect(endpoint, 1)
    endpoint = TransferEndpoint("disk-delta", "h", 0, 2, "file", str(tmp_path))  # no mode_info: no key
    with pytest.raises(TransferError, match="rank 1: the endpoint's mode_info carries no disk-delta sender identity"):
        r.connect(endpoint, 1)
    with pytest.raises(ConfigError, match="disk-delta epoch -1 must be an int >= 0"):
        DiskDeltaSender(SHARD, disk_dir=tmp_path, epoch=-1)


# ---- a real vLLM CPU engine under Ray ---------------------------------------------------------

@pytest.mark.slow
def test_vllm_engine_loads_disk_delta_versions_bit_exact(tmp_path):
    """Set up as the job does (transfer_setup_from_config with its run and epoch), and again after a
    trainer restart with the engine kept: the new epoch's keyframe, then its deltas, land bit-exact."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from rlplacement.config import TransferConfig
    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.models.tiny import TinySpec, make_tiny_model
    from rlplacement.runtime import transfer_driver as driver
    from rlplacement.transfer.disk_delta import DiskDeltaOptions
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir = str(make_tiny_model(tmp_path / "tiny", TinySpec()))
    shared_ray.join({"env_vars": {"PYTHONPATH": repo, "RAY_AUTH_MODE": "disabled"}})
    try:
        trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
        engine = create_engine_actor(0, model_dir)
        config = TransferConfig(mode="disk-delta", requested_mode="disk-delta", bucket_bytes=64 * 1024,
                                check_equal=True, options=DiskDeltaOptions(disk_dir=str(tmp_path / "deltas")))

        def setup(epoch):  # as the job's set_transfer, at its start (epoch 0) and after a trainer restart
            ray.get(trainer.transfer_setup_from_config.remote(config, timeout_s=60, base_dir=model_dir, run_id="job",
                                                              epoch=epoch))
            driver.connect(trainer, [engine], timeout_s=120)

        setup(0)
        prompts = [[5, 6, 7, 8], [40, 41, 42]]
        before = ray.get(engine.generate.remote(prompts, max_tokens=6))
        # epoch 0: deltas on the checkpoint; epoch 1 (the engine kept, its receiver rebuilt at the new
        # connect): a keyframe, then deltas again
        for version, base_version in ((1, 0), (2, 1), ("restart", None), (3, None), (4, 3)):
            if version == "restart":
                setup(1)
                continue
            ray.get(trainer.perturb.remote(version))
            report = driver.run_update(trainer, [engine], version, timeout_s=60, check_equal=True)
            assert report.trainer.base_version == base_version and report.trainer.density > 0
            assert ray.get(engine.weight_version.remote()) == version
            assert ray.get(engine.received_checksums.remote()) == ray.get(trainer.checksums.remote())
        assert {k: v for k, v in read_pointer(tmp_path / "deltas").items() if k != "sender"} == {
            "version": 4, "folder": version_folder(4), "run_id": "job", "epoch": 1}
        after = ray.get(engine.generate.remote(prompts, max_tokens=6))
        assert [r["weight_version"] for r in after] == [4, 4]
        assert [r["logprobs"].tolist() for r in after] != [r["logprobs"].tolist() for r in before]
    finally:
        ray.shutdown()


def test_an_edited_index_is_refused_whole(tmp_path, base):
    sender, r, folder = _two_versions(tmp_path, base)
    index = json.loads((folder / INDEX_NAME).read_text())
    name = next(iter(index["tensors"]))
    index["tensors"][name]["checksum"] = "0" * 16  # still valid JSON, still plausible
    (folder / INDEX_NAME).write_text(json.dumps(index))
    _refused_and_still_on_version_1(r, r"model.safetensors.index.json is corrupt: its content does not match "
                                       r"its index_checksum")


def test_a_truncated_delta_file_is_refused_naming_it(tmp_path, base):
    sender, r, folder = _two_versions(tmp_path, base)
    shard = sorted(folder.glob("delta-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _refused_and_still_on_version_1(r, shard.name)


def test_an_xor_delta_on_another_base_is_refused(tmp_path, base):
    base_dir, w = base
    sender, (r1, r2) = _pair(tmp_path, base_dir, "xor", n_receivers=2)
    _perturb(w, seed=1)
    threads = [threading.Thread(target=_receive, args=(r1, 1))]
    [t.start() for t in threads]
    sender.update(1, list(w.items()))
    [t.join(30) for t in threads]
    _perturb(w, seed=2)
    sender.update(2, list(w.items()))  # r2 never took version 1: version 2 is an xor on version 1
    r2.begin(2)
    with pytest.raises(TransferError, match=r"version 2 is an xor delta on version 1, but this engine serves version 0"):
        r2.receive()
    assert r2.version == 0


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_full_disk_while_publishing_publishes_nothing(tmp_path, base):
    """A 64 KiB tmpfs fills half-way through a version: the update fails naming the error, no version
    folder or pointer appears, and the receivers stay on what they serve."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("this machine does not let the test mount a tmpfs (say so: the case cannot run here)")
    try:
        base_dir, w = base
        sender = DiskDeltaSender(SHARD, disk_dir=mount / "deltas", delta_encoding="xor", base_dir=base_dir)
        sender.listen(2)
        sender.connect()
        w["model.big"] = torch.randn(64 * 1024)  # 256 KiB of incompressible bytes: more than the disk holds
        with pytest.raises(UpdateAborted, match="No space left on device"):
            sender.update(1, list(w.items()))
        assert not list((mount / "deltas").glob("weight_v*")) and not (mount / "deltas" / "latest").exists()
        sender.close()
    finally:
        subprocess.run(["umount", str(mount)])


def test_a_pointer_that_fails_to_publish_leaves_no_version_and_the_receivers_stop_at_once(tmp_path, base, monkeypatch):
    """The disk fills after the version folder went in, as the pointer is written (a small delta late in a
    run fits where the pointer does not): the version folder is removed again, so the abort marker fits
    and a waiting receiver stops at once on it rather than waiting out its timeout."""
    import errno
    import time

    base_dir, w = base
    sender, (receiver,) = _pair(tmp_path, base_dir, "xor")
    real_publish = folder_format.publish_file

    def pointer_on_a_full_disk(root, name, data):
        if name == folder_format.POINTER_NAME:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_publish(root, name, data)

    monkeypatch.setattr(folder_format, "publish_file", pointer_on_a_full_disk)
    _perturb(w, seed=1)
    with pytest.raises(UpdateAborted, match="No space left on device"):
        sender.update(1, list(w.items()))
    assert not list((tmp_path / "deltas").glob("weight_v*")) and read_pointer(tmp_path / "deltas") is None
    receiver.begin(1)
    start = time.monotonic()
    with pytest.raises(UpdateAborted, match="trainer aborted update to version 1: .*No space left on device"):
        receiver.receive()
    assert time.monotonic() - start < 5 and receiver.version == 0


# ---- across runs: segments, shard paths, signatures -------------------------------------------

def _join(sender, receivers, n=None):
    """(Re)join ``receivers`` (rank 1..) to ``sender``'s endpoint, as driver.connect does after transfer_setup."""
    endpoint = TransferEndpoint.from_dict(sender.listen(1 + (n or len(receivers))).to_dict())
    for rank, r in enumerate(receivers, start=1):
        r.connect(endpoint, rank)
    sender.connect()


def _update_all(sender, receivers, version, w, pointers):
    """One update as ``driver.run_update`` runs it (receivers waiting while the sender writes); every
    receiver must commit it bit-exact. Records the pointer after it in ``pointers``."""
    results, errors = {}, []

    def run(r):
        try:
            results[r.rank] = (_receive(r, version, applied := []), applied)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in receivers]
    [t.start() for t in threads]
    report = sender.update(version, list(w.items()))
    [t.join(30) for t in threads]
    assert not errors, errors
    for r in receivers:
        assert r.version == version
        _assert_bit_exact(results[r.rank][1][0].items(), w)
    pointers.append(read_pointer(sender.root))
    return report


def _never_backwards_within_a_segment(pointers):
    last: dict = {}
    for p in pointers:
        seg = (p["run_id"], p["epoch"])
        assert p["version"] > last.get(seg, -1), f"latest moved backwards within {seg}: {pointers}"
        last[seg] = p["version"]


def test_a_fresh_run_on_a_folder_left_at_latest_5_starts_a_new_segment_with_a_keyframe(tmp_path, base):
    base_dir, w = base
    root = tmp_path / "deltas"
    first = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="first")
    old = DiskDeltaReceiver("cpu")
    _join(first, [old])
    pointers: list = []
    for version in range(1, 6):
        _perturb(w, seed=version)
        _update_all(first, [old], version, w, pointers)
    folder_format.publish_abort(root, 1, "a failure of the first run", first.identity)  # must not stop the next
    (root / ".tmp-weight_v000006-deadbeef").mkdir()
    (root / "notes.txt").write_text("the user's")
    assert read_pointer(root)["version"] == 5

    second = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir)  # a fresh run id
    fresh = [DiskDeltaReceiver("cpu"), DiskDeltaReceiver("cpu")]  # the new run's engines serve the checkpoint
    _join(second, fresh)
    assert second.identity.run_id not in ("", "first")
    _perturb(w, seed=10)
    report = _update_all(second, fresh, 1, w, pointers)
    assert report.base_version is None and report.density == 1.0  # a keyframe: nothing of the old run is a base
    assert pointers[-1] == {"version": 1, "folder": version_folder(1), "run_id": second.identity.run_id,
                            "epoch": 0, "sender": second.identity.sender}
    # the first run's versions, marker and tmp entry are gone; other files stay
    assert sorted(p.name for p in root.iterdir()) == ["latest", "notes.txt", version_folder(1)]
    _perturb(w, seed=11)
    assert _update_all(second, fresh, 2, w, pointers).base_version == 1  # deltas again within the segment
    _never_backwards_within_a_segment(pointers)
    # the same run and epoch again (transfer_setup rebuilt the sender): latest may not move back, refused by name
    again = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir,
                            run_id=second.identity.run_id)
    _join(again, fresh)
    with pytest.raises(TransferError, match=rf"update version 2 is not newer than version 2 that run "
                                            rf"{second.identity.run_id} epoch 0 already published in .*latest"):
        again.update(2, list(w.items()))
    assert read_pointer(root)["version"] == 2
    _perturb(w, seed=12)
    assert _update_all(again, fresh, 3, w, pointers).base_version is None  # it knows only the checkpoint
    _never_backwards_within_a_segment(pointers)


def test_a_resume_continues_from_a_lower_version_and_a_kept_engine_takes_the_new_epoch(tmp_path, base):
    base_dir, w = base
    root = tmp_path / "deltas"
    pointers: list = []
    run0 = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="run", epoch=0)
    lost = DiskDeltaReceiver("cpu")
    _join(run0, [lost])
    for version in range(1, 6):
        _perturb(w, seed=version)
        _update_all(run0, [lost], version, w, pointers)
    # --load resume: a new job (fresh engines) from a checkpoint saved at version 2: it sends version 3
    resumed = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="run", epoch=1)
    kept = DiskDeltaReceiver("cpu")
    _join(resumed, [kept])
    _perturb(w, seed=20)
    assert _update_all(resumed, [kept], 3, w, pointers).base_version is None
    assert sorted(p.name for p in root.glob("weight_v*")) == [version_folder(3)]  # epoch 0's versions cleaned
    _perturb(w, seed=21)
    assert _update_all(resumed, [kept], 4, w, pointers).base_version == 3
    # the trainer restarts (epoch 2); the engine is kept, rebuilt on reconnect as the vLLM backend does,
    # and serves version 4 of epoch 1: the next number is 5, a keyframe it takes, then deltas again
    restarted = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="run", epoch=2)
    rebuilt = DiskDeltaReceiver("cpu", version=kept.version)
    _join(restarted, [rebuilt])
    _perturb(w, seed=22)
    assert _update_all(restarted, [rebuilt], 5, w, pointers).base_version is None
    _perturb(w, seed=23)
    assert _update_all(restarted, [rebuilt], 6, w, pointers).base_version == 5
    assert [(p["epoch"], p["version"]) for p in pointers] == [(0, v) for v in range(1, 6)] + [(1, 3), (1, 4), (2, 5),
                                                                                           (2, 6)]
    _never_backwards_within_a_segment(pointers)


def test_an_xor_delta_on_a_version_of_another_segment_is_refused(tmp_path, base):
    """Same number, other run: an engine serving version 2 of one run never applies another run's xor on
    its version 2 (the numbers match, the bytes need not)."""
    base_dir, w = base
    root = tmp_path / "deltas"
    one = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="one")
    r = DiskDeltaReceiver("cpu")
    _join(one, [r])
    for version in (1, 2):
        _perturb(w, seed=version)
        _update_all(one, [r], version, w, [])
    other = DiskDeltaSender(SHARD, disk_dir=root, delta_encoding="xor", base_dir=base_dir, run_id="other")
    _join(other, [r])
    theirs = _weights(7)
    assert other.update(2, list(theirs.items())).base_version is None  # its own version 2, which r never took
    _perturb(theirs, seed=3)
    assert other.update(3, list(theirs.items())).base_version == 2
    r.begin(3)
    with pytest.raises(TransferError, match=r"version 3 is an xor delta on version 2 of run other epoch 0, but this "
                                            r"engine's version 2 is of run one epoch 0"):
        r.receive()
    assert r.version == 2


@pytest.mark.parametrize("where", ["../escape.safetensors", "absolute", "symlink"])
def test_a_shard_path_outside_the_version_folder_is_refused(tmp_path, base, where):
    """Even in an index the trainer's key signed: a shard is a file name inside the version's folder."""
    sender, r, folder = _two_versions(tmp_path, base)
    victim = "model.layers.0.mlp.up_proj.weight"
    shard = folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][victim]
    outside = tmp_path / "escape.safetensors"
    outside.write_bytes(shard.read_bytes())  # a readable copy: without the check it would load
    if where == "symlink":
        shard.unlink()
        shard.symlink_to(outside)
        _refused_and_still_on_version_1(r, rf"{INDEX_NAME}: shard path '{shard.name}' resolves to {outside}, outside ")
        return
    path = str(outside) if where == "absolute" else "../../escape.safetensors"
    _forge(folder, lambda i: i["weight_map"].update({victim: path}), sender)
    _refused_and_still_on_version_1(r, rf"{INDEX_NAME}: shard path '{path}' of tensor '{victim}' is not a file "
                                       rf"name inside")


def test_an_edited_index_with_its_checksum_recomputed_is_refused_as_unsigned(tmp_path, base):
    sender, r, folder = _two_versions(tmp_path, base)
    victim = "model.layers.0.mlp.up_proj.weight"
    _forge(folder, lambda i: i["weight_map"].update({victim: "../../escape.safetensors"}))
    _refused_and_still_on_version_1(r, rf"{INDEX_NAME} is not signed by this job's trainer \(run "
                                       rf"{sender.identity.run_id} epoch 0\)")
    _forge(folder, lambda i: i["tensors"][victim].update(checksum="0" * 16))
    _refused_and_still_on_version_1(r, "is not signed by this job's trainer")
    # another sender's key (another run, or the same run's earlier trainer) does not sign for this one
    other = DiskDeltaSender(SHARD, disk_dir=tmp_path / "elsewhere", run_id=sender.identity.run_id)
    _forge(folder, lambda i: None, other)
    _refused_and_still_on_version_1(r, "is not signed by this job's trainer")
    assert "key" not in (folder / INDEX_NAME).read_text() and sender.identity.key.hex() not in "".join(
        p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())


def test_the_job_passes_run_and_epoch_to_the_sender(tmp_path):
    from rlplacement.config import TransferConfig
    from rlplacement.runtime.trainer_transfer import TrainerTransferMixin
    from rlplacement.transfer.disk_delta import DiskDeltaOptions

    config = TransferConfig(mode="disk-delta", requested_mode="disk-delta", bucket_bytes=SHARD,
                            options=DiskDeltaOptions(disk_dir=str(tmp_path)))
    assert registry.sender_options(config, "disk-delta", run_id="r", epoch=2)["epoch"] == 2
    assert "run_id" not in registry.sender_options(config, "broadcast", run_id="r", epoch=2)
    trainer = TrainerTransferMixin()
    trainer.transfer_setup_from_config(config, base_dir=None, run_id="r", epoch=2)
    info = TransferEndpoint.from_dict(trainer.transfer_listen(2)).mode_info
    assert (info["run_id"], info["epoch"]) == ("r", 2) and len(bytes.fromhex(info["key"])) == 32
    trainer.transfer_close()


def test_a_sender_whose_folder_another_run_took_over_is_refused(tmp_path, base):
    base_dir, w = base
    root = tmp_path / "deltas"
    first = DiskDeltaSender(SHARD, disk_dir=root, base_dir=base_dir, run_id="first")
    r = DiskDeltaReceiver("cpu")
    _join(first, [r])
    _update_all(first, [r], 1, w, [])
    second = DiskDeltaSender(SHARD, disk_dir=root, base_dir=base_dir, run_id="second")
    _join(second, [DiskDeltaReceiver("cpu")])
    second.update(1, list(w.items()))
    _perturb(w, seed=2)
    with pytest.raises(TransferError, match=r"latest now holds version 1 of run second epoch 0, published after this "
                                            r"sender's \(run first epoch 0\) last version: one sender per "
                                            r"--update-weight-disk-dir"):
        first.update(2, list(w.items()))
    r.begin(2)
    with pytest.raises(UpdateAborted, match="one sender per --update-weight-disk-dir"):  # at once, not at its timeout
        r.receive()
