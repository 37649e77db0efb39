"""`rlplacement convert` / `export-hf` at TP=1 through the CLI: bit-exact round trips, reruns, bad input."""

import pytest
import torch
from safetensors.torch import load_file

from rlplacement.cli import main
from rlplacement.backends.megatron import checkpoint_layout as layout
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPECS = {
    "qwen3-gqa-untied": TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": TinySpec(family="qwen2", num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
    "llama-gqa-tied": TinySpec(family="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                               vocab_size=333),
    "qwen3-bf16": TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16"),
}


def _load_folder(folder):
    """All tensors of an HF folder, single file or sharded with an index."""
    import json
    from pathlib import Path

    index = Path(folder) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(f"{folder}/{f}"))
    return out


def assert_same_tensors(a_dir, b_dir):
    a, b = _load_folder(a_dir), _load_folder(b_dir)
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k  # raw bytes


@pytest.mark.parametrize("label", list(SPECS))
def test_convert_then_export_is_bit_exact(tmp_path, label, capsys):
    hf = make_tiny_model(tmp_path / "hf", SPECS[label])
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"), "--no-progress"]) == 0
    assert (tmp_path / "td" / layout.MARKER).read_text() == "release"
    assert main(["export-hf", "--load", str(tmp_path / "td"), "--save", str(tmp_path / "out")]) == 0
    assert_same_tensors(hf, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    # a second run on the finished folder does nothing and says so
    capsys.readouterr()
    before = sorted(p.stat().st_mtime_ns for p in (tmp_path / "td" / "release").iterdir())
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td")]) == 0
    assert "already converted" in capsys.readouterr().out
    assert before == sorted(p.stat().st_mtime_ns for p in (tmp_path / "td" / "release").iterdir())


def test_half_finished_folder_is_detected_and_redone(tmp_path, capsys):
    hf = make_tiny_model(tmp_path / "hf", SPECS["qwen3-gqa-untied"])
    td = tmp_path / "td"
    (td / layout.RELEASE).mkdir(parents=True)
    (td / layout.RELEASE / "__0_0.distcp").write_bytes(b"truncated")  # a crash mid-save, no marker
    assert layout.state(td) == "partial"
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(td), "--no-progress"]) == 0
    assert "half-finished" in capsys.readouterr().out
    assert layout.state(td) == "finished"
    assert main(["export-hf", "--load", str(td), "--save", str(tmp_path / "out")]) == 0
    assert_same_tensors(hf, tmp_path / "out")


def test_bad_input_is_refused_before_work(tmp_path, capsys):
    assert main(["convert", "--hf-checkpoint", str(tmp_path), "--save", str(tmp_path / "td")]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err
    hf = make_tiny_model(tmp_path / "hf", SPECS["qwen2-tied"])  # 1 kv head
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"),
                 "--tensor-model-parallel-size", "2"]) == 2
    assert "--tensor-model-parallel-size 2 does not divide num_key_value_heads 1" in capsys.readouterr().err
    assert not (tmp_path / "td").exists()
    assert main(["export-hf", "--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "o")]) == 2
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().err


def test_sharded_hf_folders_are_read_and_written(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPECS["qwen3-gqa-untied"])
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td"), "--no-progress"]) == 0
    assert main(["export-hf", "--load", str(tmp_path / "td"), "--save", str(tmp_path / "sharded"),
                 "--max-shard-bytes", "40000"]) == 0
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    assert_same_tensors(hf, tmp_path / "sharded")
    # the sharded folder converts like the single-file one
    assert main(["convert", "--hf-checkpoint", str(tmp_path / "sharded"), "--save", str(tmp_path / "td2"),
                 "--no-progress"]) == 0
    assert main(["export-hf", "--load", str(tmp_path / "td2"), "--save", str(tmp_path / "out")]) == 0
    assert_same_tensors(hf, tmp_path / "out")


def test_bad_hf_checkpoint_fails_at_once_naming_the_flag(tmp_path, capsys):
    import json
    import shutil
    import time

    def refused(hf) -> str:
        start = time.perf_counter()
        assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td")]) == 2
        assert time.perf_counter() - start < 5.0, "refusal must come from config.json, before any work"
        assert not (tmp_path / "td").exists()
        return capsys.readouterr().err

    assert "error: --hf-checkpoint " + str(tmp_path / "missing") + ": no such folder" in refused(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "--hf-checkpoint " + str(tmp_path / "empty") + ": no config.json there" in refused(tmp_path / "empty")
    hf = make_tiny_model(tmp_path / "hf", SPECS["qwen2-tied"])
    other = tmp_path / "mistral"
    shutil.copytree(hf, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    assert "model_type 'mistral' has no mapping; known: llama, qwen2, qwen3" in refused(other)
    (other / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    assert "config.json: model_type 'qwen2' with experts is not a model rlplacement knows" in refused(other)
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3", "n_routed_experts": 256}))
    assert ("model_type 'deepseek_v3' is a mixture-of-experts family rlplacement has no mapping for; the "
            "mixture-of-experts families it knows: qwen3_moe") in refused(other)
    for f in other.glob("*.safetensors"):
        f.unlink()
    (other / "config.json").write_text(json.dumps(cfg))
    assert "--hf-checkpoint " + str(other) + ": no *.safetensors weights there" in refused(other)


@pytest.mark.parametrize("command", ["convert", "export-hf"])
def test_help_explains_with_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"rlplacement {command}" in out and "examples:" in out and "DIR" in out
