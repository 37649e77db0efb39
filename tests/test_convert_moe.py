"""Qwen3-MoE through `rlplacement convert` / `export-hf`: bit-exact round trips, a checkpoint converted at one
expert-parallel size read at others, and the converted model's logits equal to HF's at TP x EP layouts
(megatron's own MoE layer, router and all-to-all dispatcher over gloo, sequential experts)."""

import json
import shutil

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.megatron import checkpoint_layout as layout
from rlplacement.cli import main
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.test_convert import assert_same_tensors

# three layers, the middle one dense (mlp_only_layers): both kinds of layer in one model
SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                mlp_only_layers=(1,))


def _input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def _hf_logits(hf) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    with torch.no_grad():
        return model(_input_ids(model.config.vocab_size)).logits


def _megatron_logits(rank, world, hf, td, layouts):
    """Logits of the converted checkpoint read at each ``(tp, ep)`` of ``layouts`` (TP x EP = world), in eval
    mode (megatron refuses MoE with TP > 1 in training without sequence parallelism)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlplacement.backends.megatron import model_build as mm
    from rlplacement.families import megatron_mapping as mapping

    cfg = mm.load_hf_config(hf)
    out = {}
    for tp, ep in layouts:
        mm.init_model_parallel(tp, 1, ep=ep)
        model = mm.build_model(cfg, mapping.padded_vocab_size(cfg.vocab_size, tp), tp, 1, "local")
        mm.load_torch_dist(model, f"{td}/release")
        model.eval()
        ids = _input_ids(cfg.vocab_size)
        b, t = ids.shape
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(model(ids, torch.arange(t).expand(b, t), mask))
        out[(tp, ep)] = logits[..., :cfg.vocab_size].float()
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_convert_then_export_is_bit_exact_and_the_logits_are_hfs(tmp_path, capsys, norm_topk_prob):
    import dataclasses

    hf = make_tiny_model(tmp_path / "hf", dataclasses.replace(SPEC, norm_topk_prob=norm_topk_prob))
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"), "--no-progress"]) == 0
    assert main(["export-hf", "--load", str(tmp_path / "td"), "--save", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_same_tensors(hf, tmp_path / "out")
    capsys.readouterr()
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td")]) == 0
    assert "already converted" in capsys.readouterr().out
    # one rank, as the export ran: megatron's router renormalises over the chosen experts exactly when HF does
    got = launch.spawn(_megatron_logits, 1, str(hf), str(tmp_path / "td"), [(1, 1)], timeout_s=300)[0]
    assert (got[(1, 1)] - _hf_logits(hf)).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_moe_converted_at_ep2_reads_back_at_ep1_and_serves_hf_logits_at_tp_x_ep(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"), "--no-progress",
                 "--expert-model-parallel-size", "2"]) == 0
    meta = json.loads((tmp_path / "td" / layout.META).read_text())
    assert meta["expert_model_parallel_size"] == 2
    # experts are saved by their global index: read at EP=1, every byte comes back
    assert main(["export-hf", "--load", str(tmp_path / "td"), "--save", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_same_tensors(hf, tmp_path / "out")
    results = launch.spawn(_megatron_logits, 2, str(hf), str(tmp_path / "td"), [(1, 2), (2, 1)], timeout_s=300)
    want = _hf_logits(hf)
    for at, logits in results[0].items():
        assert (logits - want).abs().max().item() <= 1e-5, at


def test_moe_bad_input_is_refused_by_name_before_work(tmp_path, capsys):
    from rlplacement.backends.preflight import preflight
    from rlplacement.config import BackendConfig
    from rlplacement.errors import ConfigError

    hf = make_tiny_model(tmp_path / "hf", SPEC)

    def refused(*flags):
        assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"), *flags]) == 2
        assert not (tmp_path / "td").exists()
        return capsys.readouterr().err

    assert "--expert-model-parallel-size 3 does not divide num_experts 4" in refused("--expert-model-parallel-size", "3")
    assert "--expert-model-parallel-size must be 1 or more, got 0" in refused("--expert-model-parallel-size", "0")
    shared = tmp_path / "shared"
    shutil.copytree(hf, shared)
    cfg = json.loads((shared / "config.json").read_text())
    (shared / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 63}))
    hf = shared
    assert "--tensor-model-parallel-size 2 does not divide moe_intermediate_size 63" in refused(
        "--tensor-model-parallel-size", "2")
    (shared / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": 64}))
    assert "shared_expert_intermediate_size is set: shared experts are not supported for qwen3_moe" in refused()
    # fsdp and megatron train it; torchtitan refuses before a process starts, naming them
    with pytest.raises(ConfigError, match=r"qwen3_moe is a mixture-of-experts model, which --train-backend torchtitan "
                                          r"does not train yet: use --train-backend fsdp or megatron"):
        preflight(BackendConfig(name="torchtitan", hf_checkpoint=str(tmp_path / "hf")))
    for backend in ("fsdp", "megatron"):
        preflight(BackendConfig(name=backend, hf_checkpoint=str(tmp_path / "hf")))
