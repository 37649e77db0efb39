"""Block FP8: the quantizer against a per-block reference written out plainly, the conversion tool on a real
folder (dense and mixture of experts), and every scheme or flag the library cannot serve refused by name."""

import json

import pytest
import torch

from rlplacement.cli import main as cli_main
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.quantization import fp8_block
from rlplacement.quantization.scheme import read_config_scheme, read_scheme

DENSE = TinySpec(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                 dtype="bfloat16")
MOE = TinySpec(family="qwen3_moe", hidden_size=64, intermediate_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, dtype="bfloat16", num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=64)


def reference_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at a time: scale = the block's absolute maximum / 448 (1 for an all-zero block)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = part.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (part / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scales


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((300, 200), (128, 128)), ((70, 33), (16, 8))],
                         ids=["whole-blocks", "partial-blocks", "small-blocks"])
def test_block_quantization_equals_a_per_block_reference_bit_for_bit(shape, block):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[: block[0], : block[1]] = 0  # an all-zero block: scale 1, not 0
    q, scale_inv = fp8_block.quantize(w, block)
    ref_q, ref_scale = reference_block_quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == fp8_block.scale_shape(shape, block)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale_inv, ref_scale)
    assert scale_inv[0, 0] == 1.0
    # each block's largest magnitude lands on e4m3's largest finite value, and the round trip is e4m3-close
    assert q.float().abs().max() == 448.0
    back = fp8_block.dequantize(q, scale_inv, block)
    bound = fp8_block.dequantize(torch.full(shape, 448.0 / 16).to(torch.float8_e4m3fn), scale_inv, block)
    assert torch.all((back - w.float()).abs() <= bound)


def test_quantizing_a_cut_on_a_block_boundary_equals_quantizing_the_whole_and_off_it_does_not():
    """What a trainer rank's piece must respect: rows cut at a multiple of the block give the whole tensor's
    scales; a cut inside a block gives other scales (the reason pieces are assembled before quantizing)."""
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole_q, whole_s = fp8_block.quantize(w)
    parts = [fp8_block.quantize(w[:128]), fp8_block.quantize(w[128:])]
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), whole_q.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_s)
    w[100, 0] = 50.0  # the largest value sits in rows 64..127 of block 0
    whole_s = fp8_block.quantize(w)[1]
    off = [fp8_block.quantize(w[:64])[1], fp8_block.quantize(w[64:])[1]]
    assert not torch.equal(off[0][0], whole_s[0])


def test_a_dense_folder_converts_to_block_fp8_and_a_rerun_does_nothing(tmp_path, capsys):
    src = make_tiny_model(tmp_path / "bf16", DENSE)
    out = tmp_path / "fp8"
    assert cli_main(["convert", "--to-fp8", "--hf-checkpoint", str(src), "--save", str(out), "--no-progress"]) == 0
    assert "14 weights quantized in blocks of 128x128" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == \
        ("fp8", "e4m3", "dynamic", [128, 128])
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.0.input_layernorm"} <= \
        set(qc["modules_to_not_convert"])
    scheme = read_scheme(out)
    assert scheme.block == (128, 128) and len(scheme.quantized) == 14
    from safetensors.torch import load_file

    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, tensor in before.items():
        if name in scheme.quantized:
            q, s = fp8_block.quantize(tensor)
            assert torch.equal(after[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(after[scheme.scale_name(name)], s)
        else:
            assert torch.equal(after[name], tensor) and after[name].dtype == torch.bfloat16
    assert (out / "tokenizer.json").is_file() and not (tmp_path / "fp8.tmp").exists()
    assert cli_main(["convert", "--to-fp8", "--hf-checkpoint", str(src), "--save", str(out)]) == 0
    assert "already converted: nothing to do" in capsys.readouterr().out


def test_a_mixture_of_experts_keeps_its_router_and_quantizes_each_expert(tmp_path):
    src = make_tiny_model(tmp_path / "bf16", MOE)
    out = tmp_path / "fp8"
    assert cli_main(["convert", "--to-fp8", "--hf-checkpoint", str(src), "--save", str(out), "--no-progress"]) == 0
    scheme = read_scheme(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.gate" in qc["modules_to_not_convert"]
    assert "model.layers.0.mlp.gate.weight" not in scheme.quantized
    experts = {n for n in scheme.quantized if ".mlp.experts." in n}
    assert len(experts) == 2 * 4 * 3  # 2 layers, 4 experts, gate/up/down each


def _write_config(folder, quantization_config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not served"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2': only e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "no weight_block_size .per-tensor"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static' with block scales"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\] must be two positive"),
], ids=["other-method", "e5m2", "per-tensor", "static-activations", "one-number-block"])
def test_a_scheme_the_engines_cannot_serve_is_refused_by_name(tmp_path, qc, match):
    _write_config(tmp_path, qc)
    with pytest.raises(ConfigError, match=match):
        read_config_scheme(json.loads((tmp_path / "config.json").read_text()), str(tmp_path))


def _refused(capsys, argv: list[str], match: str) -> None:
    """The CLI returns 2 and says ``match`` (a regular expression) on stderr."""
    import re

    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_bad_conversion_input_is_refused_before_anything_is_written(tmp_path, capsys):
    src = make_tiny_model(tmp_path / "bf16", DENSE)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    convert = ["convert", "--to-fp8", "--hf-checkpoint", str(src)]
    _refused(capsys, [*convert, "--save", str(src)], "is --hf-checkpoint's folder")
    _refused(capsys, [*convert, "--save", str(busy)], "is not empty and not an FP8 conversion")
    _refused(capsys, [*convert, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "2"],
             "--tensor-model-parallel-size: a torch_dist conversion's flags")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and not (tmp_path / "x").exists()
    _refused(capsys, ["convert", "--hf-checkpoint", str(src), "--save", str(tmp_path / "y"), "--fp8-block-size", "64",
                      "64"], "--fp8-block-size goes with --to-fp8")
    fp8 = tmp_path / "fp8"
    assert cli_main([*convert, "--save", str(fp8), "--no-progress"]) == 0
    _refused(capsys, ["convert", "--to-fp8", "--hf-checkpoint", str(fp8), "--save", str(tmp_path / "z")],
             "is quantized already")
    _refused(capsys, [*convert, "--save", str(fp8), "--fp8-block-size", "64", "64"],
             r"FP8 conversion with block \[128, 128\], not --fp8-block-size 64 64")
