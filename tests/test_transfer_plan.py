"""The transfer plan: engine slices equal vLLM's own loaders', every served byte is routed exactly once
from a rank that holds it, senders share the bytes, and the simulator's accounting."""

import dataclasses
import json
import types

import pytest

from rlplacement.cli import main as cli_main
from rlplacement.transfer.plan import ModelTensors, PlanCoverageError, Route, build_plan
from rlplacement.transfer.plan.boxes import volume, whole
from rlplacement.transfer.plan.build import BROADCAST, WRITE, TransferPlan, check_coverage
from rlplacement.transfer.plan.engine_shards import vllm_worker_needs
from rlplacement.transfer.plan.simulate import LinkRates, simulate
from rlplacement.transfer.plan.trainer_shards import fsdp_holdings, megatron_holdings, rank0_holdings

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rope_theta": 1000000, "hidden_act": "silu"}
SMALL_QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
               "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}


def _needs(model, tp, engines):
    per_worker = vllm_worker_needs(model, tp)
    return {(e, w): per_worker[w] for e in range(engines) for w in range(tp)}


# ---- the engine side is vLLM's own slicing ---------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
def test_worker_slices_equal_what_vllms_loaders_keep_with_a_stand_in_tp_group(tp, monkeypatch):
    """Each worker's boxes are what vLLM 0.32's parallel layers keep of each HF tensor: the layers are
    built at every TP rank through a stand-in TP group (rank and size only; one process, no collective),
    loaded with tensors whose values are their own flat indices, and read back. TP=4 replicates the 2 KV
    heads; the vocabulary's last shard is partly padding."""
    torch = pytest.importorskip("torch")
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    vocab = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    model = ModelTensors.from_hf_config(SMALL_QWEN2)
    shapes = {t.name: t.shape for t in model.tensors}
    p = "model.layers.0."
    step = 1 << 20  # values of tensor k are k*step + flat index + 1; 0 and -1 are padding and untouched

    def indexed(name, k):
        return torch.arange(volume(whole(shapes[name])), dtype=torch.float32).view(shapes[name]) \
            + (k * step + 1)

    def kept(param, k):
        v = param.detach().flatten()
        v = v[(v >= k * step + 1) & (v < (k + 1) * step)]
        return sorted((v - (k * step + 1)).long().tolist())

    def box_indices(name, box):
        full = torch.arange(volume(whole(shapes[name]))).view(shapes[name])
        return sorted(full[tuple(slice(s, e) for s, e in box)].flatten().tolist())

    needs = vllm_worker_needs(model, tp)
    for w in range(tp):
        monkeypatch.setattr(ps, "_TP", types.SimpleNamespace(rank_in_group=w, world_size=tp))
        with set_current_vllm_config(VllmConfig()), torch.no_grad():
            qkv = linear.QKVParallelLinear(64, 32, 8, 2, bias=True, params_dtype=torch.float32)
            gate_up = linear.MergedColumnParallelLinear(64, [96, 96], bias=False, params_dtype=torch.float32)
            o = linear.RowParallelLinear(256, 64, bias=False, params_dtype=torch.float32)
            down = linear.RowParallelLinear(96, 64, bias=False, params_dtype=torch.float32)
            embed = vocab.VocabParallelEmbedding(1000, 64, params_dtype=torch.float32)
            head = vocab.ParallelLMHead(1000, 64, params_dtype=torch.float32)
            loads = [(qkv.weight, p + "self_attn.q_proj.weight", "q"), (qkv.weight, p + "self_attn.k_proj.weight", "k"),
                     (qkv.weight, p + "self_attn.v_proj.weight", "v"), (qkv.bias, p + "self_attn.q_proj.bias", "q"),
                     (qkv.bias, p + "self_attn.k_proj.bias", "k"), (qkv.bias, p + "self_attn.v_proj.bias", "v"),
                     (gate_up.weight, p + "mlp.gate_proj.weight", 0), (gate_up.weight, p + "mlp.up_proj.weight", 1),
                     (o.weight, p + "self_attn.o_proj.weight", None), (down.weight, p + "mlp.down_proj.weight", None),
                     (embed.weight, "model.embed_tokens.weight", None), (head.weight, "lm_head.weight", None)]
            for param in {id(x[0]): x[0] for x in loads}.values():
                param.fill_(-1)
            for k, (param, name, shard) in enumerate(loads):
                loader = param.weight_loader
                loader(param, indexed(name, k), *(() if shard is None else (shard,)))
            for k, (param, name, _) in enumerate(loads):
                assert kept(param, k) == box_indices(name, needs[w][name]), f"worker {w} of {tp}: {name}"


# ---- coverage ---------------------------------------------------------------------------------------------

def _small_plan(fanout=BROADCAST):
    model = ModelTensors.from_hf_config({**SMALL_QWEN2, "num_hidden_layers": 2})
    holdings = megatron_holdings(model, 2, 1, 2)
    needs = _needs(model, 2, 2)
    return model, holdings, needs, build_plan(model, holdings, needs, fanout)


def test_a_plan_missing_a_range_is_refused_naming_the_tensor_and_worker():
    _, holdings, needs, plan = _small_plan()
    dropped = next(r for r in plan.routes if r.tensor == "model.layers.1.mlp.down_proj.weight")
    broken = dataclasses.replace(plan, routes=tuple(r for r in plan.routes if r is not dropped))
    with pytest.raises(PlanCoverageError, match=r"model\.layers\.1\.mlp\.down_proj\.weight\[0:64, \d+:\d+\] of "
                                                r"engine \d worker \d: \d+ of \d+ elements are sent by no trainer rank"):
        check_coverage(broken, holdings, needs)


def test_a_plan_doubling_a_range_is_refused_naming_both_ranks():
    _, holdings, needs, plan = _small_plan()
    route = next(r for r in plan.routes if r.tensor == "model.norm.weight")
    other = next(rank for rank, held in enumerate(holdings) if "model.norm.weight" in held and rank != route.sender)
    broken = dataclasses.replace(plan, routes=plan.routes + (dataclasses.replace(route, sender=other),))
    with pytest.raises(PlanCoverageError, match=r"model\.norm\.weight\[0:64\] is written twice into engine \d worker "
                                                rf"\d: by rank {route.sender} and by rank {other}"):
        check_coverage(broken, holdings, needs)


def test_a_route_from_a_rank_that_does_not_hold_the_bytes_is_refused():
    _, holdings, needs, plan = _small_plan()
    route = next(r for r in plan.routes if r.tensor == "model.layers.0.self_attn.q_proj.weight")
    wrong = next(rank for rank, held in enumerate(holdings)
                 if held.get(route.tensor) != holdings[route.sender][route.tensor])
    broken = dataclasses.replace(plan, routes=tuple(dataclasses.replace(r, sender=wrong) if r is route else r
                                                    for r in plan.routes))
    with pytest.raises(PlanCoverageError, match=rf"trainer rank {wrong} is to send "
                                                r"model\.layers\.0\.self_attn\.q_proj\.weight\[\d+:\d+, 0:64\], "
                                                r"which it does not hold"):
        check_coverage(broken, holdings, needs)


def test_a_route_to_a_worker_that_keeps_none_of_the_tensor_is_refused():
    model, holdings, needs, plan = _small_plan()
    needs = {r: {n: b for n, b in boxes.items() if n != "lm_head.weight" or r != (1, 1)} for r, boxes in needs.items()}
    with pytest.raises(PlanCoverageError, match=r"lm_head\.weight is routed to engine 1 worker 1, which keeps none"):
        check_coverage(plan, holdings, needs)


# ---- who sends ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fanout", [BROADCAST, WRITE])
@pytest.mark.parametrize("trainer, engine_tp", [("megatron tp2 pp2 dp2", 2), ("megatron tp2 pp2 dp2", 4),
                                                ("fsdp 2", 2), ("fsdp 8", 1)])
def test_every_rank_sends_a_fair_share_of_what_it_holds(trainer, engine_tp, fanout):
    """At the 8B shape: every trainer rank sends, the largest sender moves at most 1% over the mean, no
    route leaves a rank that does not hold it (the build's coverage check), and the bytes received are
    exactly the workers' slices."""
    model = ModelTensors.from_hf_config(QWEN3_8B)
    holdings = megatron_holdings(model, 2, 2, 2) if trainer.startswith("megatron") else \
        fsdp_holdings(model, int(trainer.split()[1]))
    needs = _needs(model, engine_tp, 2)
    plan = build_plan(model, holdings, needs, fanout)
    sent = plan.bytes_per_sender()
    assert min(sent.values()) > 0
    assert max(sent.values()) <= 1.01 * sum(sent.values()) / len(sent)
    for receiver, got in plan.bytes_per_receiver().items():
        assert got == sum(volume(b) for b in needs[receiver].values()) * model.itemsize
    fan = {BROADCAST: lambda r: 1, WRITE: lambda r: len(r.receivers)}[fanout]
    assert sum(sent.values()) == sum(r.nbytes * fan(r) for r in plan.routes)


def test_a_tp_engine_worker_receives_its_shard_not_the_model():
    model = ModelTensors.from_hf_config(QWEN3_8B)
    plan = build_plan(model, megatron_holdings(model, 1, 1, 8), _needs(model, 4, 1))
    per_worker = plan.bytes_per_receiver()
    # a quarter of every sharded tensor, the norms whole, and 4 workers replicate no KV head at 8 KV heads
    assert all(abs(b - model.total_bytes / 4) / model.total_bytes < 0.001 for b in per_worker.values())


def test_the_rank0_plan_funnels_every_byte_through_rank_0():
    model = ModelTensors.from_hf_config(QWEN3_8B)
    every_tensor = {(e, w): {t.name: whole(t.shape) for t in model.tensors} for e in range(2) for w in range(2)}
    plan = build_plan(model, rank0_holdings(model, 4), every_tensor, WRITE)
    assert plan.bytes_per_sender() == {0: 4 * model.total_bytes, 1: 0, 2: 0, 3: 0}


def test_colocated_workers_read_only_the_trainer_rank_on_their_own_gpu():
    """Two logical GPUs colocated, FSDP over both, one engine of 2: every route's sender sits on its
    receiver's GPU; what a rank lacks of its worker's slice is gathered between trainer ranks first."""
    from rlplacement.advisor.thresholds import ModelAssumptions
    from rlplacement.placement.layout import Layout
    from rlplacement.transfer.plan.for_layout import plans_for

    model = ModelTensors.from_hf_config(QWEN3_8B)
    layout = Layout(True, ((0, 0), (0, 1)), (((0, 0), (0, 1)),), 8)
    pair = plans_for(model, layout, backend="fsdp", tp=1, pp=1, mode="cuda_ipc", assumptions=ModelAssumptions())
    for route in pair.sharded.routes:
        for e, w in route.receivers:
            assert layout.trainer_gpus[route.sender] == layout.engines[e][w]
    assert not [n for n in pair.sharded_sim.link_bytes if "nvlink" in n and "gather" not in n]
    # the rank-0 plan: worker 1 reads rank 0's GPU over NVLink
    assert pair.rank0_sim.link_bytes["node 0 gpu 0 out nvlink"] == model.total_bytes
    # what runs: each rank hands the whole model to the worker on its GPU, nothing read across GPUs
    assert pair.who == "own gpu" and pair.runs == "spread"
    for route in pair.spread.routes:
        for e, w in route.receivers:
            assert layout.trainer_gpus[route.sender] == layout.engines[e][w]
    assert pair.spread.bytes_per_sender() == {0: model.total_bytes, 1: model.total_bytes}
    assert not [n for n in pair.spread_sim.link_bytes if "nvlink" in n and "gather" not in n]
    assert pair.spread_sim.total_s < pair.rank0_sim.total_s


# ---- the simulator ---------------------------------------------------------------------------------------

def test_the_simulator_prices_the_busiest_link():
    """One trainer GPU, two single-GPU engines on another node: a broadcast leaves the sender once, a
    write once per receiver; the time is the busiest link's bytes over its rate, the busiest worker's commit
    and the calls' fixed cost."""
    model = ModelTensors.from_hf_config(QWEN3_8B)
    every_tensor = {(e, 0): {t.name: whole(t.shape) for t in model.tensors} for e in range(2)}
    rates = LinkRates(ipc_gbps=1000.0, nvlink_gbps=100.0, network_gbps=10.0, disk_gbps=1.0)
    trainer, engines = ((0, 0),), (((1, 0),), ((1, 1),))
    for fanout, out in ((BROADCAST, 1), (WRITE, 2)):
        plan = build_plan(model, rank0_holdings(model, 1), every_tensor, fanout)
        sim = simulate(plan, trainer, engines, rates, rpc_s=0.5, commit_gbps=20.0)
        assert sim.link_bytes["node 0 gpu 0 out network"] == out * model.total_bytes
        assert sim.link_bytes["node 1 gpu 1 in network"] == model.total_bytes
        assert sim.busiest == ("node 0 gpu 0 out network" if out == 2 else sim.busiest)
        assert sim.total_s == pytest.approx(0.5 + out * model.total_bytes * 8 / 10e9 + model.total_bytes * 8 / 20e9)


# ---- bad input ------------------------------------------------------------------------------------------

def test_a_width_vllm_cannot_shard_is_refused_naming_the_flag():
    model = ModelTensors.from_hf_config(QWEN3_8B)
    with pytest.raises(ValueError, match=r"--rollout-num-gpus-per-engine 3 does not divide num_attention_heads=32, "
                                         r"num_key_value_heads=8, the vocabulary padded to 151936"):
        vllm_worker_needs(model, 3)
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size 5 does not divide num_hidden_layers=36"):
        megatron_holdings(model, 1, 5, 1)


def test_plan_simulate_transfer_prints_the_plans_and_marks_the_one_that_runs(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_8B))
    argv = ["plan", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2",
            "--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--update-weight-transfer-mode", "p2p", "--simulate-transfer", "--hf-config", str(config)]
    assert cli_main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["transfer"]["model_bytes"] == 16381470720
    assert out["transfer"]["rank0"]["max_sender_bytes"] == 8 * 16381470720
    assert out["transfer"]["sharded"]["max_sender_bytes"] < 1.01 * 16381470720
    assert out["transfer"]["sharded"]["predicted_seconds"] < out["transfer"]["rank0"]["predicted_seconds"]
    # what runs: all 8 ranks write the parts of the HF tensors they hold (pieces), each of the 8 workers only its
    # slices of them: every engine receives the model once (its two workers a half each, norms on both)
    spread = out["transfer"]["spread"]
    assert out["transfer"]["runs"] == "spread"
    assert len([b for b in spread["bytes_per_sender"].values() if b]) == 8
    assert 4 * 16381470720 < sum(spread["bytes_per_sender"].values()) < 4.01 * 16381470720
    assert spread["max_sender_bytes"] < 1.1 * 16381470720 / 2
    assert 0.5 * 16381470720 < spread["max_receiver_bytes"] < 0.501 * 16381470720
    assert out["transfer"]["sharded"]["predicted_seconds"] <= spread["predicted_seconds"] < \
        out["transfer"]["rank0"]["predicted_seconds"]
    assert spread["max_sender_bytes"] == pytest.approx(out["transfer"]["sharded"]["max_sender_bytes"], rel=1e-3)
    staging = out["transfer"]["engine_staging"]
    # a worker stages its slices as they arrive, and assembles the tensors from the ranks' pieces: twice at most
    assert staging["pieces"] and staging["bytes"]["full"] == 2 * spread["max_receiver_bytes"]
    # the embedding's and the head's halves (0.62 GB each) are larger than half a bucket: three of them, the
    # pieces of one in the channels' two buffers each beside the half assembling
    assert staging["bytes"]["bucket"] == 3 * 151936 * 4096 * 2 // 2
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "sharded (planned)" in text and "every rank sends *" in text and "rank 0 sends" in text
    assert ("engine worker memory for an update (--update-weight-staging auto): full 16.38 GB, bucket 1.87 GB"
            in text), text
    assert cli_main(argv + ["--update-weight-slices", "off", "--json"]) == 0  # every worker takes whole tensors
    whole = json.loads(capsys.readouterr().out)["transfer"]
    assert whole["spread"]["max_receiver_bytes"] == whole["engine_staging"]["bytes"]["full"] // 2 == 16381470720
    # torchtitan's ranks send their rows as FSDP's do (FSDP2 shards both): the same plan, nothing gathered
    assert cli_main([*argv[:argv.index("--train-backend")], "--train-backend", "torchtitan",
                     *argv[argv.index("--update-weight-transfer-mode"):], "--json"]) == 0
    titan = json.loads(capsys.readouterr().out)["transfer"]
    assert cli_main([*argv[:argv.index("--train-backend")], "--train-backend", "fsdp",
                     *argv[argv.index("--update-weight-transfer-mode"):], "--json"]) == 0
    fsdp = json.loads(capsys.readouterr().out)["transfer"]
    assert titan["engine_staging"] == fsdp["engine_staging"] and titan["engine_staging"]["pieces"]
    assert titan["spread"] == fsdp["spread"] and titan["spread"]["gather_seconds"] == 0


@pytest.mark.parametrize("extra, message", [
    ([], "--simulate-transfer and --memory need the model: give --hf-config"),
    (["--hf-config", "/nonexistent/config.json"], "--hf-config /nonexistent/config.json: no such file"),
])
def test_plan_simulate_transfer_refuses_a_missing_model(extra, message, capsys):
    assert cli_main(["plan", "--rollout-num-gpus", "8", "--simulate-transfer", *extra]) == 2
    assert message in capsys.readouterr().err


def test_plan_simulates_a_mixture_of_experts_model_with_and_without_expert_parallelism(tmp_path, capsys):
    """A Qwen3-MoE config: every expert's gate/up/down in the plan (the model's bytes are its parameters'),
    each TP=2 worker planned half of every expert; under expert parallelism each rank holds and sends its own."""
    moe = {**QWEN3_8B, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(moe))
    model = ModelTensors.from_hf_config(str(config))
    experts = [t for t in model.tensors if ".mlp.experts." in t.name]
    assert len(experts) == (moe["num_hidden_layers"] - 1) * 8 * 3
    needs = vllm_worker_needs(model, 2)
    assert needs[1]["model.layers.1.mlp.experts.7.up_proj.weight"] == ((128, 256), (0, 4096))
    assert needs[0]["model.layers.1.mlp.experts.7.down_proj.weight"] == ((0, 4096), (0, 128))
    assert needs[0]["model.layers.1.mlp.gate.weight"] == needs[1]["model.layers.1.mlp.gate.weight"] == ((0, 8), (0, 4096))
    argv = ["plan", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--train-backend", "megatron",
            "--simulate-transfer", "--hf-config", str(config)]
    assert cli_main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["transfer"]["model_bytes"] == model.total_bytes
    # expert parallelism: a rank holds its expert-parallel rank's experts only (DP rank d is EP rank d % 2), and
    # every plan still serves every byte (the plans' coverage checks run as they are built)
    holdings = megatron_holdings(model, 1, 1, 4, ep=2)
    assert [("model.layers.1.mlp.experts.7.up_proj.weight" in h, "model.layers.1.mlp.experts.0.up_proj.weight" in h)
            for h in holdings] == [(False, True), (True, False), (False, True), (True, False)]
    assert cli_main(argv + ["--expert-model-parallel-size", "2", "--json"]) == 0
    transfer = json.loads(capsys.readouterr().out)["transfer"]
    assert transfer["runs"] == "spread" and transfer["spread"]["max_sender_bytes"] < model.total_bytes / 2
    assert cli_main(argv + ["--expert-model-parallel-size", "3"]) == 2
    assert "--expert-model-parallel-size 3 does not divide" in capsys.readouterr().err


def test_plan_memory_counts_a_ranks_experts_by_expert_parallelism(tmp_path, capsys):
    """``plan --memory``: the busiest megatron rank's state, written out by hand for a small MoE config (every
    layer sparse, untied head): at EP=2 each rank holds half the experts, whose optimizer state is sharded
    over the expert-data-parallel ranks (DP / EP), the rest over DP; fsdp shards everything over all ranks;
    an engine worker holds its TP slice of every tensor."""
    h, v, layers, experts, inter, heads, kv, hd = 256, 1024, 4, 8, 64, 4, 2, 64
    cfg = {"model_type": "qwen3_moe", "hidden_size": h, "intermediate_size": 512, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": v,
           "num_experts": experts, "num_experts_per_tok": 2, "moe_intermediate_size": inter,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    attention = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd + 2 * h  # q, o; k, v; q/k norms; two layer norms
    expert_params = layers * experts * 3 * inter * h
    dense = 2 * v * h + layers * (attention + experts * h) + h  # embedding, head, attention + router, final norm
    argv = ["plan", "--memory", "--hf-config", str(config), "--json", "--actor-num-gpus-per-node", "4",
            "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"]
    assert cli_main(argv + ["--train-backend", "megatron", "--expert-model-parallel-size", "2",
                            "--use-distributed-optimizer"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert (memory["parameters"], memory["expert_parameters"]) == (dense + expert_params, expert_params)
    held = dense + expert_params // 2
    assert memory["trainer_rank"] == {"parameters": held, "weights": 2 * held, "gradients": 4 * held,
                                      "optimizer": int(12 * (dense / 4 + expert_params / 2 / 2)), "gathered": 0,
                                      "total": 6 * held + int(12 * (dense / 4 + expert_params / 2 / 2))}
    # each engine worker (TP=2): half of every sharded tensor, the norms and routers whole
    whole = layers * (2 * hd + 2 * h + experts * h) + h
    assert memory["engine_worker_weights"] == 2 * ((dense + expert_params - whole) // 2 + whole)
    assert cli_main(argv + ["--train-backend", "fsdp"]) == 0
    rank = json.loads(capsys.readouterr().out)["memory"]["trainer_rank"]
    share = -(-(dense + expert_params) // 4)
    layer = attention + experts * h + experts * 3 * inter * h
    assert (rank["weights"], rank["gradients"], rank["optimizer"], rank["gathered"]) == (
        4 * share, 4 * share, 8 * share, 2 * layer)


def test_a_p2p_plan_of_alike_engines_is_built_once_and_prices_every_engines_writes():
    """Where every box has one holder (FSDP's rows, pieces), p2p's routes to every engine are engine 0's from
    the same senders: built and checked once (``build_write_plan``), with the same bytes per sender and per
    receiver and the same simulation as the plan of every engine built whole. Replicas (several holders of a
    box) are balanced per engine, so that plan is built whole."""
    from rlplacement.transfer.plan.build import build_write_plan

    model = ModelTensors.from_hf_config(SMALL_QWEN2)
    holdings, per_worker = fsdp_holdings(model, 4), vllm_worker_needs(model, 2)
    once = build_write_plan(model, holdings, per_worker, 3)
    every = build_plan(model, holdings, _needs(model, 2, 3), WRITE)
    assert once.engine_copies == 3 and 3 * len(once.routes) == once.num_routes == len(every.routes)
    assert once.bytes_per_sender() == every.bytes_per_sender()
    assert once.bytes_per_receiver() == every.bytes_per_receiver()
    assert once.summary() == every.summary()
    trainer = tuple((0, g) for g in range(4))
    engines = (((0, 4), (0, 5)), ((0, 6), (1, 0)), ((1, 1), (1, 2)))  # an engine across two nodes, too
    rates = LinkRates(ipc_gbps=1000.0, nvlink_gbps=2000.0, network_gbps=400.0, disk_gbps=10.0)
    assert simulate(once, trainer, engines, rates) == simulate(every, trainer, engines, rates)
    assert build_write_plan(model, megatron_holdings(model, 1, 1, 2), per_worker, 3).engine_copies == 1
    short = [dict(h) for h in holdings]
    del short[1]["model.norm.weight"]
    with pytest.raises(PlanCoverageError, match=r"model\.norm\.weight.* of engine 0 worker 0: .* are sent by no "
                                                r"trainer rank"):
        build_write_plan(model, short, per_worker, 3)


def test_the_running_p2p_plan_is_priced_at_hundreds_of_gpus(tmp_path, capsys):
    """Megatron's replicas each write their rows of every tensor to every p2p worker: 8B on 256 GPUs is 128
    engines' writes of 128 ranks' pieces (6.5 million routes), priced from one engine's routes."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_8B))
    argv = ["plan", "--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "128",
            "--train-backend", "megatron", "--update-weight-transfer-mode", "p2p", "--simulate-transfer",
            "--hf-config", str(config), "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)["transfer"]
    model_bytes = out["model_bytes"]
    spread = out["spread"]
    assert out["runs"] == "spread" and spread["routes"] > 1_000_000
    # every rank writes 1/128 of every tensor to each of 128 engines: the model once, spread over the ranks
    assert model_bytes <= spread["max_sender_bytes"] < 1.1 * model_bytes
    assert spread["max_receiver_bytes"] == model_bytes
    assert spread["predicted_seconds"] < out["rank0"]["predicted_seconds"] / 100
