"""Our transfer modes as Miles external weight-transfer protocols, called the way Miles calls them,
into real vLLM CPU engines.

Call order and signatures: radixark/miles ``WeightUpdater.update_weights`` (``miles/backends/
training_utils/weight_update/updater.py``) and ``WeightTransferProtocol`` /
``resolve_external_protocol_target`` (``.../protocol.py``), as stored in the code-search index
(protocol.py version id 70481331494, the one with ``--custom-weight-transfer-protocol-path``; the
index records no commit for it). Its lifecycle test checks connect, begin_sync(1), send_bucket,
after_base_weights, finalize(1), after_engines_resumed. The newest snapshot ``fetch`` returns
(31f1ca961a94cb860cec3b2dea34ec332bfa8f76) predates that protocol and Miles is not on PyPI, so the
loader step is repeated here: the dotted path split at its last dot, the module imported, the
attribute called with ``args``.
"""

from __future__ import annotations

import argparse
import importlib

import pytest

from rlplacement.errors import ConfigError
from rlplacement.integrations import miles

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

BUCKET = 64 * 1024
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def miles_args(**overrides) -> argparse.Namespace:
    """The Miles args the protocol reads (names and defaults as Miles defines them)."""
    values = dict(update_weight_transfer_mode="external",
                  custom_weight_transfer_protocol_path="rlplacement.integrations.miles.broadcast_packed",
                  update_weight_buffer_size=BUCKET, colocate=False, check_weight_update_equal=True,
                  update_weight_disk_dir=None, actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=2,
                  rollout_num_gpus_per_engine=1, lora_rank=0)
    values.update(overrides)
    return argparse.Namespace(**values)


def load_protocol(args):
    """Miles' ``resolve_external_protocol_target`` + call: dotted path, module import, ``attr(args)``."""
    module, _, attr = args.custom_weight_transfer_protocol_path.rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    target.validate_args(args)
    return target(args)


def miles_buckets(weights: dict, bucket_bytes: int):
    """Miles' HF iterator: size-bounded buckets of freshly allocated HF-named tensors."""
    bucket, size = [], 0
    for name, tensor in weights.items():
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.clone()))
        size += tensor.nbytes
    if bucket:
        yield bucket


def miles_update(protocol, version: int, weights: dict, bucket_bytes: int) -> dict:
    """``WeightUpdater.update_weights`` on a sender rank, without the session frame (the protocol
    says ``use_weight_update_session = False``)."""
    assert protocol.begin_sync(version, None)
    for bucket in miles_buckets(weights, bucket_bytes):
        if protocol.is_sender:
            protocol.send_bucket(bucket)
    protocol.after_base_weights()
    protocol.finalize(version)
    protocol.after_engines_resumed()
    return protocol.pop_metrics()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.models.tiny import make_tiny_model
    from tests.transfer_helpers.cluster import join_shared_ray

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny")))
    join_shared_ray()
    handles = [create_engine_actor(i, model_dir) for i in range(2)]
    ray.get([e.info.remote() for e in handles], timeout=300)
    yield {"engines": handles, "model_dir": model_dir, "version": 0}
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["broadcast", "broadcast_packed", "p2p", "disk_delta"])
def test_miles_lifecycle_lands_bit_exact_in_vllm_engines(engines, tmp_path, factory):
    import torch
    from safetensors.torch import load_file

    from rlplacement.transfer.base import tensor_checksum

    args = miles_args(custom_weight_transfer_protocol_path=f"rlplacement.integrations.miles.{factory}",
                      update_weight_disk_dir=str(tmp_path / "versions") if factory == "disk_delta" else None,
                      p2p_protocol="tcp" if factory == "p2p" else None)
    protocol = load_protocol(args)
    handles = engines["engines"]
    protocol.connect(handles, [1, 1], [0, 1], None, protocol.required_placement, "all")
    assert protocol.is_sender and protocol.rollout_engines == handles

    weights = load_file(f"{engines['model_dir']}/model.safetensors")
    before = ray.get(handles[0].generate.remote(PROMPTS, max_tokens=4), timeout=120)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + len(factory))
        weights = {n: t + torch.randn(t.shape, generator=g) * 0.02 for n, t in weights.items()}
        engines["version"] += 1
        version = engines["version"]
        metrics = miles_update(protocol, version, weights, BUCKET)
        assert metrics["rlplacement/bytes"] == sum(t.nbytes for t in weights.values())
        assert metrics["rlplacement/num_buckets"] >= 2 and protocol.pop_metrics() == {}
        want = {n: tensor_checksum(t) for n, t in weights.items()}
        for i, engine in enumerate(handles):
            assert ray.get(engine.weight_version.remote(), timeout=60) == version
            assert ray.get(engine.received_checksums.remote(), timeout=60) == want, f"engine {i}"
    after = ray.get(handles[0].generate.remote(PROMPTS, max_tokens=4), timeout=120)
    assert [r["weight_version"] for r in after] == [engines["version"]] * len(PROMPTS)
    assert [r["logprobs"].tolist() for r in after] != [r["logprobs"].tolist() for r in before]


@pytest.mark.parametrize("overrides,message", [
    ({"colocate": True}, "--colocate: Miles moves colocated weights with its own CUDA IPC path"),
    ({"update_weight_transfer_mode": "broadcast"}, "only with --update-weight-transfer-mode external"),
    ({"lora_rank": 16}, "--lora-rank"),
    ({"custom_weight_transfer_protocol_path": "rlplacement.integrations.miles.disk_delta"},
     "needs --update-weight-disk-dir"),
    ({"update_weight_buffer_size": 0}, "--update-weight-buffer-size must be positive"),
])
def test_validate_args_refuses_what_our_modes_cannot_serve(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_protocol(miles_args(**overrides))


def test_sglang_servers_are_refused_at_connect_naming_the_engine():
    """Miles' own engines are SGLang HTTP clients; they do not run our receiver."""
    class StandInSGLangApiClient:  # stands in for Miles' SGLang client (its shape: a frozen dataclass with a server_url)
        server_url = "http://10.0.0.1:30000"

    protocol = miles.broadcast_packed(miles_args())
    with pytest.raises(Exception, match="rollout engine 0 .* does not run rlplacement's receiver"):
        protocol.connect([StandInSGLangApiClient()], [1], [0], None, None, "all")
