"""preflight: every refusal a backend would raise later, raised up front from config.json, messages matched."""

import json
import shutil
import time

import pytest

from rlplacement.config import BackendConfig
from rlplacement.errors import ConfigError
from rlplacement.backends import preflight
from rlplacement.backends.megatron import checkpoint_layout as layout
from rlplacement.hf_folder import copy_side_files
from rlplacement.models.tiny import TinySpec, make_tiny_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    # 4 heads / 2 kv groups / 4 layers: TP=2 and PP=2 are valid, TP=4 and PP=3 are not
    return make_tiny_model(tmp_path_factory.mktemp("pf") / "qwen3",
                           TinySpec("qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4))


def _variant(hf, tmp_path, **changes):
    out = tmp_path / "variant"
    shutil.copytree(hf, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def cfg(name="megatron", hf=None, load=None, tp=1, pp=1):
    return BackendConfig(name=name, hf_checkpoint=None if hf is None else str(hf), load=load,
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def test_valid_configs_pass_quickly(hf):
    start = time.perf_counter()
    preflight(cfg("megatron", hf, tp=2, pp=2))
    preflight(cfg("fsdp", hf))
    preflight(cfg("fsdp"), str(hf))  # the job's HF folder stands in for --hf-checkpoint
    preflight(cfg("torchtitan", hf), cuda_available=True)
    assert time.perf_counter() - start < 2.0


def test_parallel_sizes_that_do_not_divide_the_model(hf):
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 4 does not divide num_key_value_heads 2 "
                                          r"of .*config.json: use a divisor of 2"):
        preflight(cfg("megatron", hf, tp=4))
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 3 does not divide num_attention_heads 4"):
        preflight(cfg("megatron", hf, tp=3))
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 3 does not divide num_hidden_layers 4 "
                                          r"of .*config.json: use a divisor of 4"):
        preflight(cfg("megatron", hf, pp=3))
    with pytest.raises(ConfigError, match=r"apply to --train-backend megatron, not fsdp"):
        preflight(cfg("fsdp", hf, tp=2))


def test_missing_or_bad_hf_folder(hf, tmp_path):
    with pytest.raises(ConfigError, match=r"--train-backend fsdp needs --hf-checkpoint"):
        preflight(cfg("fsdp"))
    with pytest.raises(ConfigError, match=r"--train-backend megatron needs --hf-checkpoint .* or --load"):
        preflight(cfg("megatron"))
    with pytest.raises(ConfigError, match=r"--hf-checkpoint .*nowhere: no such folder"):
        preflight(cfg("fsdp", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--hf-checkpoint .*empty: no config.json there"):
        preflight(cfg("fsdp", tmp_path / "empty"))
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(hf / "config.json", weightless / "config.json")
    with pytest.raises(ConfigError, match=r"--hf-checkpoint .*weightless: no \*.safetensors weights there"):
        preflight(cfg("fsdp", weightless))
    with pytest.raises(ConfigError, match=r"--train-backend 'jax' is unknown: use one of fsdp, megatron, torchtitan"):
        preflight(cfg("jax", hf))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "mistral"}, r"model_type 'mistral' has no mapping; known: llama, qwen2, qwen3"),
    ({"num_experts": 8}, r"model_type 'qwen3' with experts is not a model rlplacement knows; the mixture-of-experts "
                         r"family it knows is qwen3_moe"),
    ({"model_type": "mixtral", "num_local_experts": 8},
     r"model_type 'mixtral' is a mixture-of-experts family rlplacement has no mapping for; the mixture-of-experts "
     r"families it knows: qwen3_moe"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, r"rope type 'yarn' is not supported"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"rope type 'dynamic' is not supported"),  # pre-5.x transformers configs
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
])
def test_unsupported_architectures_name_the_config_file(hf, tmp_path, changes, message):
    with pytest.raises(ConfigError, match=r"config.json: " + message):
        preflight(cfg("fsdp", _variant(hf, tmp_path, **changes)))


def test_load_must_be_a_finished_conversion(hf, tmp_path):
    with pytest.raises(ConfigError, match=r"--load .*absent: no such folder; convert first"):
        preflight(cfg("megatron", load=str(tmp_path / "absent")))
    half = tmp_path / "half"
    (half / layout.RELEASE).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"--load .*half is neither a finished conversion nor a --save folder "
                                          r"\(no latest_checkpointed_iteration.txt\): rerun `rlplacement convert"):
        preflight(cfg("megatron", load=str(half)))
    done = tmp_path / "done"
    copy_side_files(hf, done / layout.HF_CONFIG_DIR)
    (done / layout.META).write_text(json.dumps({"padded_vocab_size": 384}))
    (done / layout.MARKER).write_text("release")
    preflight(cfg("megatron", load=str(done), tp=2))
    with pytest.raises(ConfigError, match=r"padded vocabulary of 384, not divisible by --tensor-model-parallel-size 5"):
        preflight(cfg("megatron", load=str(done), tp=5))
    with pytest.raises(ConfigError, match=r"--load .*done: latest_checkpointed_iteration.txt says 'release', not an "
                                          r"iteration: this is not a --save folder of this backend"):
        preflight(cfg("fsdp", hf, load=str(done)))
    (done / layout.MARKER).write_text("4")  # a megatron --save folder whose iteration 4 was cut short
    (done / "iter_0000004").mkdir()
    with pytest.raises(ConfigError, match=r"--load .*done: .*iter_0000004/.metadata is missing, so iteration 4 was "
                                          r"cut short"):
        preflight(cfg("megatron", load=str(done)))


def test_torchtitan_refusals(hf, tmp_path):
    with pytest.raises(ConfigError, match=r"--train-backend torchtitan needs CUDA on the trainer ranks: torchtitan "
                                          r"0.3.0 cannot train without CUDA: importing any of its models imports triton"):
        preflight(cfg("torchtitan", hf), cuda_available=False)
    qwen2 = _variant(hf, tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ConfigError, match=r"--train-backend torchtitan has no qwen2 model"):
        preflight(cfg("torchtitan", qwen2), cuda_available=True)


def test_preflight_imports_no_torch(hf, tmp_path):
    """The driver calls preflight before any process starts: it must not pay for torch (seconds) to do so.
    A fresh interpreter runs every check that passes, and a refusal, then asserts torch was never imported."""
    import os
    import subprocess
    import sys

    code = f"""
import sys
from rlplacement.backends.preflight import preflight
from rlplacement.config import BackendConfig
from rlplacement.errors import ConfigError
hf = {str(hf)!r}
preflight(BackendConfig(name="megatron", hf_checkpoint=hf, tensor_model_parallel_size=2,
                        pipeline_model_parallel_size=2))
preflight(BackendConfig(name="fsdp", hf_checkpoint=hf))
preflight(BackendConfig(name="torchtitan", hf_checkpoint=hf), cuda_available=True)
try:
    preflight(BackendConfig(name="megatron", hf_checkpoint=hf, tensor_model_parallel_size=3))
except ConfigError:
    pass
else:
    raise SystemExit("tp=3 was not refused")
import rlplacement.backends
heavy = sorted(m for m in ("torch", "megatron", "torchtitan", "transformers", "ray") if m in sys.modules)
assert not heavy, heavy
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
