"""Megatron trains with megatron-core's own DDP, optimizer and schedules (``backends/megatron/train.py``),
in real gloo processes on the CPU shims: every layout of the same global batch (TP=2, PP=2, DP=2, with
and without the distributed optimizer, in micro-batches) ends two AdamW steps with the weights and
losses of one rank taking it in one piece; a step whose gradient is not finite is skipped, nothing applied."""

import math

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
ADAMW = OptimConfig(name="adamw", lr=1e-3, eps=1e-3, max_grad_norm=1.0)  # eps: a step not just sign(g)


def _batches():
    from rlplacement.backends.hf_reference import random_batch

    return [random_batch(SPEC.vocab_size, batch=4, seq=12, seed=10 + i) for i in range(2)]


def _worker(rank, world, hf, tp, pp, train, nan_step, steps, overlap):
    from megatron.core import parallel_state as ps

    from rlplacement.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, tensor_model_parallel_size=tp,
                                                        pipeline_model_parallel_size=pp), ADAMW, train,
                                          overlap_grad_reduce=overlap)
    dp, dp_rank = backend.data_parallel_size, backend.data_parallel_rank
    initial = {n: t.clone() for n, t in backend.iter_hf_tensors()}  # HF names: no TP-dependent vocab padding
    from megatron.core import tensor_parallel

    recomputed, checkpoint = [], tensor_parallel.checkpoint  # what recompute runs through, counted
    tensor_parallel.checkpoint = lambda *a, **k: recomputed.append(1) or checkpoint(*a, **k)
    metrics = []
    for i, batch in enumerate(_batches()[:steps]):
        share = len(batch) // dp
        mine = batch.rows(slice(dp_rank * share, (dp_rank + 1) * share))
        if i == nan_step and dp_rank == 0:  # one data-parallel rank's gradient goes NaN
            mine.advantages[:] = float("nan")
        metrics.append(backend.train_step(mine))
    full = {n: t.clone() for n, t in backend.iter_hf_tensors()}
    out = {"metrics": metrics, "params": full if rank == 0 else None, "initial": initial if rank == 0 else None,
           "skipped": backend.skipped_steps, "dp": dp, "stage": ps.get_pipeline_model_parallel_rank(),
           "recomputed": len(recomputed)}
    tensor_parallel.checkpoint = checkpoint
    backend.close()
    return out


def _run(tmp_path, world, tp=1, pp=1, nan_step=None, steps=2, overlap=None, **train):
    hf = tmp_path / "hf"
    if not hf.exists():
        make_tiny_model(hf, SPEC)
    return launch.spawn(_worker, world, str(hf), tp, pp, TrainConfig(**train), nan_step, steps, overlap,
                        timeout_s=600)


@pytest.fixture(scope="module")
def one_piece(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, pp, train", [
    (2, 1, 1, {}), (2, 1, 1, {"use_distributed_optimizer": True}), (2, 2, 1, {}), (2, 1, 2, {"micro_batch_size": 1}),
    (1, 1, 1, {"micro_batch_size": 1}),
    (2, 1, 1, {"micro_batch_size": 1, "use_distributed_optimizer": True, "overlap": True}),
    (1, 1, 1, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    (2, 1, 2, {"micro_batch_size": 1, "recompute_granularity": "full", "recompute_method": "block",
               "recompute_num_layers": 1}),
    (1, 1, 1, {"recompute_granularity": "selective"}),
], ids=["dp2", "dp2-distributed-optimizer", "tp2", "pp2-micro-batches", "micro-batches",
        "dp2-distributed-optimizer-overlapped-reduce", "recompute-full-uniform", "pp2-recompute-full-block",
        "recompute-selective"])
def test_every_layout_takes_the_same_two_steps_as_one_rank_in_one_piece(tmp_path, one_piece, world, tp, pp, train):
    results = _run(tmp_path, world, tp, pp, **train)
    got, want = results[0], one_piece
    for step, (a, b) in enumerate(zip(got["metrics"], want["metrics"])):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), step
        assert a["optimizer_steps"] == 1
    assert set(got["params"]) == set(want["params"])
    for name, t in want["params"].items():
        torch.testing.assert_close(got["params"][name], t, atol=2e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(t, want["initial"][n]) for n, t in want["params"].items())  # the steps moved it
    assert (got["recomputed"] > 0) == ("recompute_granularity" in train) and want["recomputed"] == 0


@pytest.mark.slow
def test_a_step_with_a_non_finite_gradient_is_skipped_on_every_rank(tmp_path):
    results = _run(tmp_path, 2, nan_step=1)  # DP=2: rank 0's share of the second step has NaN advantages
    assert [r["skipped"] for r in results] == [1, 1]
    assert results[0]["metrics"][1]["optimizer_steps"] == 0 and math.isinf(results[0]["metrics"][1]["grad_norm"])
    after_first = _run(tmp_path, 2, steps=1)[0]
    for name, t in after_first["params"].items():  # nothing of the second step was applied
        assert torch.equal(results[0]["params"][name], t), name


def _bf16_worker(rank, world, hf, train):
    from megatron.core.transformer.module import Float16Module

    from rlplacement.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf), ADAMW, train)
    dp, dp_rank = backend.data_parallel_size, backend.data_parallel_rank
    metrics = []
    for batch in _batches():
        share = len(batch) // dp
        metrics.append(backend.train_step(batch.rows(slice(dp_rank * share, (dp_rank + 1) * share))))
    opt = backend.optimizer
    rounded = None
    if hasattr(opt, "fp32_from_float16_groups"):  # one rank's plain optimizer: every main parameter whole
        pairs = [(m, f) for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, f in zip(mg, fg)]
        rounded = {"main_dtypes": sorted({str(f.dtype) for _, f in pairs}),
                   "equal": all(torch.equal(m, f.to(m.dtype)) for m, f in pairs),
                   "moved": any(not torch.equal(f, f.to(torch.bfloat16).float()) for _, f in pairs)}
    out = {"metrics": metrics, "params": {n: t.clone() for n, t in backend.iter_hf_tensors()} if rank == 0 else None,
           "model": {n: p.detach().clone() for n, p in backend.local_megatron_parameters()} if rank == 0 else None,
           "float16_module": isinstance(backend._training.ddp.module, Float16Module), "rounded": rounded}
    backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, train", [(1, {}), (2, {"use_distributed_optimizer": True})],
                         ids=["one-rank", "dp2-distributed-optimizer"])
def test_bf16_trains_bf16_parameters_from_fp32_main_parameters_inside_float16module(tmp_path, one_piece, world, train):
    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    got = launch.spawn(_bf16_worker, world, str(hf), TrainConfig(bf16=True, **train), timeout_s=600)[0]
    assert got["float16_module"]
    assert {t.dtype for t in got["params"].values()} == {torch.bfloat16}  # served as trained: the bf16 parameters
    assert {p.dtype for p in got["model"].values()} == {torch.bfloat16}
    if got["rounded"] is not None:  # the bf16 parameters are the fp32 main ones rounded, which kept finer steps
        assert got["rounded"] == {"main_dtypes": ["torch.float32"], "equal": True, "moved": True}
    for a, b in zip(got["metrics"], one_piece["metrics"]):  # the fp32 run's steps, to bf16's precision
        assert a["loss"] == pytest.approx(b["loss"], rel=5e-2, abs=5e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)
    for name, t in one_piece["params"].items():
        torch.testing.assert_close(got["params"][name].float(), t, atol=2e-2, rtol=2e-2, msg=name)


KL_ENTROPY = {"use_kl_loss": True, "kl_loss_coef": 0.5, "entropy_coef": 0.05}


@pytest.fixture(scope="module")
def one_piece_kl(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref_kl"), 1, **KL_ENTROPY)[0]


@pytest.mark.slow
def test_kl_and_entropy_terms_follow_the_hf_reference_steps(tmp_path, one_piece_kl):
    import copy

    from rlplacement.backends.hf_reference import hf_reference_step, load_hf

    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    model = load_hf(hf)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    opt = ADAMW.build(model.parameters())
    train = TrainConfig(**KL_ENTROPY)
    for step, (batch, got) in enumerate(zip(_batches(), one_piece_kl["metrics"])):
        want = hf_reference_step(model, [batch], ADAMW, train, reference, iteration=step, optimizer=opt)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
    assert one_piece_kl["metrics"][0]["entropy"] > 0 and one_piece_kl["metrics"][1]["kl"] > 0  # both terms acted


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, pp, train", [(2, 2, 1, {}), (2, 1, 2, {"micro_batch_size": 1}),
                                                   (1, 1, 1, {"micro_batch_size": 1})],
                         ids=["tp2", "pp2-micro-batches", "micro-batches-of-one-sample"])
def test_kl_and_entropy_terms_train_alike_in_every_layout(tmp_path, one_piece_kl, world, tp, pp, train):
    got = _run(tmp_path, world, tp, pp, **KL_ENTROPY, **train)[0]
    for step, (a, b) in enumerate(zip(got["metrics"], one_piece_kl["metrics"])):
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (step, key)
    for name, t in one_piece_kl["params"].items():
        torch.testing.assert_close(got["params"][name], t, atol=2e-6, rtol=1e-5, msg=name)


def _four_batches():
    from rlplacement.backends.hf_reference import random_batch

    return [random_batch(SPEC.vocab_size, batch=4, seq=12, seed=20 + i) for i in range(4)]


def _resume_worker(rank, world, hf, root, tp, train, phase, lora=None):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.config import LoRAConfig

    cfg = BackendConfig(name="megatron", hf_checkpoint=None if phase == "resume" and lora is None else hf,
                        load=root if phase == "resume" else None, tensor_model_parallel_size=tp,
                        lora=lora or LoRAConfig())
    backend = MegatronBackend.from_config(cfg, ADAMW, train)
    dp, dp_rank = backend.data_parallel_size, backend.data_parallel_rank
    resumed = None if backend.resumed is None else {k: backend.resumed[k] for k in ("train_calls", "step",
                                                                                      "weight_version")}
    steps = {"whole": range(4), "first": range(2), "resume": range(2, 4)}[phase]
    metrics = []
    for i in steps:
        batch = _four_batches()[i]
        share = len(batch) // dp
        metrics.append(backend.train_step(batch.rows(slice(dp_rank * share, (dp_rank + 1) * share))))
    if phase == "first":
        backend.save_checkpoint(root, weight_version=7)
    params = {n: t.clone() for n, t in backend.iter_hf_tensors()}  # collective over TP
    out = {"metrics": metrics, "resumed": resumed, "params": params if rank == 0 else None}
    if lora is not None:  # the adapters as an update streams them (collective)
        from rlplacement.transfer.spec import RANK0

        out["adapters"] = {n: t.clone() for n, t in backend.iter_update_tensors(RANK0)}
    backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, train", [
    (2, 1, {"use_distributed_optimizer": True, "bf16": True, **KL_ENTROPY}), (2, 2, {})],
    ids=["dp2-distributed-optimizer-bf16-kl", "tp2"])
def test_a_run_saved_after_two_steps_and_resumed_ends_where_one_that_never_stopped_ends(tmp_path, world, tp, train):
    from rlplacement.backends import train_checkpoint
    from rlplacement.backends.megatron import checkpoint_layout as megatron_checkpoint

    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    run = lambda phase: launch.spawn(_resume_worker, world, str(hf), str(tmp_path / "save"), tp,  # noqa: E731
                                     TrainConfig(**train), phase, timeout_s=600)[0]
    whole, first = run("whole"), run("first")
    assert megatron_checkpoint.is_training_checkpoint(tmp_path / "save")
    assert train_checkpoint.latest(tmp_path / "save").name == "iter_0000002"
    resumed = run("resume")
    assert resumed["resumed"] == {"train_calls": 2, "step": 2, "weight_version": 7}
    assert [m["loss"] for m in first["metrics"] + resumed["metrics"]] == [m["loss"] for m in whole["metrics"]]
    for name, t in whole["params"].items():  # bit for bit: main parameters, moments and the reference came back
        assert torch.equal(resumed["params"][name], t), name
    if not train.get("use_kl_loss"):  # KL asked of a checkpoint that holds no reference: refused by name
        with pytest.raises(RuntimeError, match=r"--use-kl-loss with --load .*: that run had no --use-kl-loss, so its "
                                               r"checkpoint holds no reference model"):
            launch.spawn(_resume_worker, world, str(hf), str(tmp_path / "save"), tp,
                         TrainConfig(**train, **KL_ENTROPY), "resume", timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, train", [
    (2, 1, {"use_distributed_optimizer": True, "bf16": True, **KL_ENTROPY}), (2, 2, {})],
    ids=["dp2-distributed-optimizer-bf16-kl", "tp2"])
def test_a_lora_run_saved_and_resumed_ends_where_one_that_never_stopped_ends(tmp_path, world, tp, train):
    """Megatron LoRA's ``--save``: the adapters (TP-split ones sharded as megatron shards its own) and their
    optimizer state alone; ``--load`` with ``--hf-checkpoint`` rebuilds the base (and the KL reference, the
    base itself) from the HF folder and goes on bit for bit. ``export-hf`` reads the saved adapters back
    whole, as the run streamed them."""
    from megatron.core import dist_checkpointing

    from rlplacement.backends import train_checkpoint
    from rlplacement.convert.peft_export import read_adapters
    from rlplacement.config import LORA_MODULES, LoRAConfig

    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    lora = LoRAConfig(rank=4, target_modules=LORA_MODULES)
    run = lambda phase: launch.spawn(_resume_worker, world, str(hf), str(tmp_path / "save"), tp,  # noqa: E731
                                     TrainConfig(**train), phase, lora, timeout_s=600)[0]
    whole, first = run("whole"), run("first")
    folder = train_checkpoint.latest(tmp_path / "save")
    model_keys = [k for k in dist_checkpointing.load_tensors_metadata(str(folder)) if not k.startswith("optimizer")]
    assert model_keys and all(k.startswith("lora.layers.") for k in model_keys), model_keys
    exported = read_adapters(folder)
    assert set(exported) == set(first["adapters"]) and all(torch.equal(exported[n], t)
                                                            for n, t in first["adapters"].items())
    resumed = run("resume")
    assert resumed["resumed"] == {"train_calls": 2, "step": 2, "weight_version": 7}
    assert [m["loss"] for m in first["metrics"] + resumed["metrics"]] == [m["loss"] for m in whole["metrics"]]
    for name, t in whole["params"].items():  # the merged weights: adapters, moments and the base came back
        assert torch.equal(resumed["params"][name], t), name


def _offload_worker(rank, world, hf, train, offload, lora=None):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.backends.offload import local_tensor
    from rlplacement.config import LoRAConfig

    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, lora=lora or LoRAConfig()),
                                          ADAMW, train)
    base = sum(p.numel() * p.element_size() for p in backend.model.parameters() if not p.requires_grad)
    dp, dp_rank = backend.data_parallel_size, backend.data_parallel_rank
    reserved = backend.reserve_host_memory()["bytes"] if offload else None
    reports, freed = [], []
    for i in range(3):
        batch = _four_batches()[i]
        share = len(batch) // dp
        backend.train_step(batch.rows(slice(dp_rank * share, (dp_rank + 1) * share)))
        if offload:
            reports.append(backend.offload_to_host())
            held = backend._resident_tensors() + backend._dropped_tensors()
            freed.append(all(local_tensor(t).untyped_storage().nbytes() == 0 for t in held))
            backend.reload_from_host()
    params = {n: t.clone() for n, t in backend.iter_hf_tensors()}
    main = [v.clone() for opt in backend._torch_optimizers() for g in opt.param_groups for p in g["params"]
            for v in [p, *[s for s in opt.state[p].values() if isinstance(s, torch.Tensor) and s.dim()]]]
    backend.close()
    return {"params": params, "main": main, "reserved": reserved, "freed": freed, "base": base,
            "moved": [r["bytes"] for r in reports], "dropped": [r["dropped_bytes"] for r in reports],
            "kept": [r["kept_bytes"] for r in reports]}


@pytest.mark.slow
def test_the_hand_off_moves_megatrons_state_and_frees_its_gradient_buffers_and_training_stays_bit_exact(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    train = TrainConfig(bf16=True, use_distributed_optimizer=True)  # fp32 main parameters, sharded over DP=2
    moved = launch.spawn(_offload_worker, 2, str(hf), train, True, timeout_s=600)
    stayed = launch.spawn(_offload_worker, 2, str(hf), train, False, timeout_s=600)
    for a, b in zip(moved, stayed):
        assert a["freed"] == [True] * 3  # parameters, main parameters, moments and gradient buffers all let go
        assert min(a["dropped"]) > 0 and a["reserved"] == max(a["moved"])  # gradients freed, not moved
        assert all(torch.equal(x, y) for x, y in zip(a["main"], b["main"])) and len(a["main"]) == len(b["main"])
        for name, t in b["params"].items():
            assert torch.equal(a["params"][name], t), name


@pytest.mark.slow
def test_a_megatron_lora_hand_off_copies_the_frozen_base_once_and_training_stays_bit_exact(tmp_path):
    """Under LoRA megatron's base is frozen: the first offload copies it with the adapters' state, later ones
    free it without a copy (kept on host), and training after each reload equals a run that never offloaded."""
    from rlplacement.config import LORA_MODULES, LoRAConfig

    hf = tmp_path / "hf"
    make_tiny_model(hf, SPEC)
    train = TrainConfig(bf16=True, use_distributed_optimizer=True)
    lora = LoRAConfig(rank=4, target_modules=LORA_MODULES)
    moved = launch.spawn(_offload_worker, 2, str(hf), train, True, lora, timeout_s=600)
    stayed = launch.spawn(_offload_worker, 2, str(hf), train, False, lora, timeout_s=600)
    for a, b in zip(moved, stayed):
        assert a["freed"] == [True] * 3 and a["base"] > 0
        assert a["kept"] == [0.0, a["base"], a["base"]] and a["moved"][1] == a["moved"][0] - a["base"]
        assert 0 < a["moved"][1] < a["base"] / 2  # bf16 adapters with fp32 main copies and moments: 14 B each
        assert all(torch.equal(x, y) for x, y in zip(a["main"], b["main"])) and len(a["main"]) == len(b["main"])
        assert all(torch.equal(a["params"][n], t) for n, t in b["params"].items())
    assert stayed[0]["params"]  # rank 0 streams the merged weights
