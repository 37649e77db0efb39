"""LoRA on the megatron backend (``backends.megatron.lora``): adapters on megatron's parallel linear layers
against one HF model with the same peft adapters (the same initial ``A``), on gloo: one rank's two SGD steps
give the reference's gradient norms and adapters; TP=2 and DP=2 give one rank's; the base stays
bit-identical; the adapter stream has the names and shapes the engines expect, and the merged stream is
``W + alpha / r * B A`` of the streamed adapters."""

import dataclasses
import json

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.hf_reference import hf_reference_step, load_hf, random_batch
from rlplacement.config import LORA_MODULES, BackendConfig, LoRAConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
TRAIN = TrainConfig(micro_batch_size=1)
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=LORA_MODULES)


def _megatron_lora(rank, world, hf, tp, batches_per_rank):
    from rlplacement.backends import make_backend
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    backend = make_backend(BackendConfig(name="megatron", hf_checkpoint=hf, lora=LORA, tensor_model_parallel_size=tp),
                           SGD, TRAIN)
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    dp = world // tp
    norms = []
    for seeds in batches_per_rank:
        mine = seeds[(rank // tp) * len(seeds) // dp:((rank // tp) + 1) * len(seeds) // dp]
        batch = random_batch(SPEC.vocab_size, seed=mine[0]) if len(mine) == 1 else _joined(mine)
        norms.append(backend.train_step(batch)["grad_norm"])
    adapters = {share: {n: t.clone() for n, t in backend.iter_update_tensors(share)} for share in (RANK0, SHARES, OWN_GPU)}
    base = {n: t.clone() for n, t in backend.iter_base_tensors()}
    backend.lora = dataclasses.replace(LORA, merge_for_rollout=True)
    merged = {n: t.clone() for n, t in backend.iter_update_tensors(RANK0)}
    backend.close()
    return {"norms": norms, "adapters": adapters, "base": base, "merged": merged, "trainable": trainable}


def _joined(seeds):
    from rlplacement.train_io import Batch

    parts = [random_batch(SPEC.vocab_size, seed=s) for s in seeds]
    return Batch(torch.cat([p.input_ids for p in parts]), torch.cat([p.loss_mask for p in parts]),
                 torch.cat([p.advantages for p in parts]))


def _reference(hf, seeds_per_step):
    from tests.reference_checks import peft_reference

    ref = peft_reference(hf, LORA)
    norms = [hf_reference_step(ref, [random_batch(SPEC.vocab_size, seed=s) for s in seeds], SGD, TRAIN)["grad_norm"]
             for seeds in seeds_per_step]
    return ref, norms


@pytest.mark.slow
def test_megatron_lora_matches_hf_with_peft_at_one_rank_tp2_and_dp2(tmp_path):
    from rlplacement.lora_format import adapter_shapes
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    steps = [[10, 11], [20, 21]]
    ref, expected = _reference(hf, steps)
    one = launch.spawn(_megatron_lora, 1, str(hf), 1, steps, timeout_s=300)[0]
    tp2 = launch.spawn(_megatron_lora, 2, str(hf), 2, steps, timeout_s=300)
    dp2 = launch.spawn(_megatron_lora, 2, str(hf), 1, steps, timeout_s=300)
    assert one["norms"] == pytest.approx(expected, rel=1e-5) and expected[1] > 0
    for res in (*tp2, *dp2):
        assert res["norms"] == pytest.approx(one["norms"], rel=1e-5)
    # the adapters: peft's names and shapes, the reference's values, and only they train
    shapes = adapter_shapes(json.loads((hf / "config.json").read_text()), LORA.rank, LORA_MODULES)
    params = dict(ref.named_parameters())
    assert one["trainable"] == sum(a * b for a, b in shapes.values())
    for res in (one, tp2[0], dp2[0]):
        adapters = res["adapters"][RANK0]
        assert {n: tuple(t.shape) for n, t in adapters.items()} == shapes
        for name, tensor in adapters.items():
            module, matrix = name.removeprefix("base_model.model.").split(".lora_")
            want = params[f"{module}.lora_{matrix[0]}.default.weight"].detach()
            assert (tensor - want).abs().max().item() <= 1e-5, name
    for ranks in (tp2, dp2):
        assert ranks[1]["adapters"][RANK0] == {} and ranks[1]["base"] == {}
        assert sum(len(r["adapters"][SHARES]) for r in ranks) == len(shapes)
        assert all(torch.equal(r["adapters"][OWN_GPU][n], t) for r in ranks for n, t in ranks[0]["adapters"][RANK0].items())
    # the base is the checkpoint's, bit for bit; the merged stream is W + alpha / r * B A of the adapters
    original = dict(load_hf(hf).named_parameters())
    for res in (one, tp2[0]):
        assert set(res["base"]) <= set(original)
        assert all(torch.equal(t, original[n]) for n, t in res["base"].items())
        adapters = res["adapters"][RANK0]
        for name, tensor in res["merged"].items():
            module = name.removesuffix(".weight")
            a = adapters.get(f"base_model.model.{module}.lora_A.weight")
            want = original[name] if a is None else \
                original[name] + LORA.scaling * adapters[f"base_model.model.{module}.lora_B.weight"] @ a
            assert (tensor - want).abs().max().item() <= 1e-6, name


def _refusal(rank, world, hf, lora, extra):
    from rlplacement.backends import make_backend

    make_backend(BackendConfig(name="megatron", hf_checkpoint=hf, lora=lora, **extra), SGD, TRAIN)


@pytest.mark.parametrize("lora,extra,message", [
    (dataclasses.replace(LORA, dropout=0.1), {}, r"--lora-dropout 0.1 with --train-backend megatron: .* use "
                                                 r"--lora-dropout 0"),
    (dataclasses.replace(LORA, target_modules=("q_proj", "o_proj")), {},
     r"megatron fuses q_proj, k_proj, v_proj into linear_qkv; adapt all of them or none \(add k_proj,v_proj, or "
     r"exclude q_proj\)"),
], ids=["dropout", "part-of-qkv"])
def test_megatron_lora_refuses_what_it_does_not_cover(tmp_path, lora, extra, message):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    with pytest.raises(RuntimeError, match=message):
        launch.spawn(_refusal, 1, str(hf), lora, extra, timeout_s=300)
