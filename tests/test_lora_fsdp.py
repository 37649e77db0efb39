"""LoRA on the fsdp backend (``--lora-rank``): peft's adapters on every decoder linear layer of the HF model,
the base frozen, two gloo ranks against one HF model with the same adapters (``peft`` injected, the same
initial ``A``): two optimizer steps' gradient norms equal the reference's, the base weights stay bit-identical,
and every way of streaming an update sends the merged ``W + alpha / r * B A`` under the HF names (what the
engine serves under ``--lora-merge-for-rollout``)."""

import dataclasses
import json

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.hf_reference import hf_reference_step, load_hf, random_batch
from rlplacement.config import LORA_MODULES, BackendConfig, LoRAConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(num_hidden_layers=2)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
TRAIN = TrainConfig(micro_batch_size=1)
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=LORA_MODULES, merge_for_rollout=True)


def _lora_steps(rank, world, hf):
    from rlplacement.backends import make_backend
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    backend = make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LORA), SGD, TRAIN)
    trainable = sorted(n for n, p in backend.model.named_parameters() if p.requires_grad)
    norms = [backend.train_step(random_batch(SPEC.vocab_size, seed=seed + rank))["grad_norm"] for seed in (10, 20)]
    streams = {share: {n: t.clone() for n, t in backend.iter_update_tensors(share)} for share in (RANK0, SHARES, OWN_GPU)}
    base = {n: p.full_tensor().clone() for n, p in backend.model.named_parameters() if ".base_layer." in n}
    sizes = backend._update_sizes()
    # the same trained model under adapter-only updates (the default): the stream is the adapters alone
    backend.lora = dataclasses.replace(LORA, merge_for_rollout=False)
    backend.__dict__.pop("_update_owners", None)  # the shares of the merged stream's names
    adapters = {share: {n: t.clone() for n, t in backend.iter_update_tensors(share)} for share in (RANK0, SHARES, OWN_GPU)}
    base_stream = {n: t.clone() for n, t in backend.iter_base_tensors()}
    adapter_sizes = backend._update_sizes()
    backend.close()
    return {"norms": norms, "trainable": trainable, "streams": streams, "base": base, "sizes": sizes,
            "adapters": adapters, "base_stream": base_stream, "adapter_sizes": adapter_sizes}


@pytest.mark.slow
def test_fsdp_lora_two_ranks_match_an_hf_model_with_the_same_adapters(tmp_path):
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES
    from tests.reference_checks import peft_reference

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    results = launch.spawn(_lora_steps, 2, str(hf), timeout_s=300)
    original = load_hf(hf)
    ref = peft_reference(hf, LORA)
    # only the adapters train: A and B of every adapted layer
    layers = SPEC.num_hidden_layers * len(LORA_MODULES)
    assert len(results[0]["trainable"]) == 2 * layers and all(".lora_" in n for n in results[0]["trainable"])
    expected = []
    for seed in (10, 20):
        expected.append(hf_reference_step(ref, [random_batch(SPEC.vocab_size, seed=seed + r) for r in range(2)],
                                          SGD, TRAIN)["grad_norm"])
    assert results[0]["norms"] == pytest.approx(expected, rel=1e-5)
    assert expected[1] > 0 and results[0]["norms"][1] != pytest.approx(expected[0], rel=1e-3)
    # the base weights stay bit-identical to the checkpoint's
    reference_weights = dict(original.named_parameters())
    for r in range(2):
        for name, weight in results[r]["base"].items():
            assert torch.equal(weight, reference_weights[name.replace(".base_layer.", ".")]), name
    # every way of streaming sends the merged weights under HF names, the same tensors as HF's own merge
    merged = {n: p.detach().clone() for n, p in original.named_parameters()}
    scaling = LORA.alpha / LORA.rank
    params = dict(ref.named_parameters())
    for name in list(merged):
        prefix = name.removesuffix(".weight")
        a = params.get(f"{prefix}.lora_A.default.weight")
        if a is not None:
            b = params[f"{prefix}.lora_B.default.weight"]
            merged[name] = merged[name] + scaling * (b.detach() @ a.detach())
    whole = results[0]["streams"][RANK0]
    assert set(whole) == set(merged) and results[1]["streams"][RANK0] == {}
    assert sum(len(r["streams"][SHARES]) for r in results) == len(whole)
    for name, tensor in whole.items():
        assert (tensor - merged[name]).abs().max().item() <= 1e-6, name
        assert all(torch.equal(r["streams"][OWN_GPU][name], tensor) for r in results)
    for r in range(2):
        assert all(torch.equal(t, whole[n]) for n, t in results[r]["streams"][SHARES].items())
    assert [n for n, _ in results[0]["sizes"]] == list(whole)
    # adapter-only updates: A and B alone under PEFT's saved names, with the names and shapes the engine
    # expects (lora_format.adapter_shapes), the same tensors as the reference's adapters
    from rlplacement.lora_format import adapter_shapes

    expected_shapes = adapter_shapes(json.loads((hf / "config.json").read_text()), LORA.rank, LORA_MODULES)
    adapters = results[0]["adapters"][RANK0]
    assert {n: tuple(t.shape) for n, t in adapters.items()} == expected_shapes and results[1]["adapters"][RANK0] == {}
    for name, tensor in adapters.items():
        module, matrix = name.removeprefix("base_model.model.").split(".lora_")
        want = params[f"{module}.lora_{matrix[0]}.default.weight"].detach()
        assert (tensor - want).abs().max().item() <= 1e-6, name
        assert all(torch.equal(r["adapters"][OWN_GPU][name], tensor) for r in results)
    assert sum(len(r["adapters"][SHARES]) for r in results) == len(adapters)
    assert all(len(r["adapters"][SHARES]) > 0 for r in results)  # both ranks send a share
    assert [n for n, _ in results[0]["adapter_sizes"]] == list(adapters)
    # the frozen base, unmerged, whole on rank 0: the checkpoint's bytes
    assert results[1]["base_stream"] == {}
    assert set(results[0]["base_stream"]) == set(reference_weights)
    assert all(torch.equal(t, reference_weights[n]) for n, t in results[0]["base_stream"].items())


def test_lora_flags_are_refused_where_they_cannot_work(tmp_path):
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.backends.preflight import preflight
    from rlplacement.errors import ConfigError

    def refused(message, *argv):
        with pytest.raises(ConfigError, match=message):
            config_from_args(build_parser().parse_args(["--colocate", "--train-backend", "fsdp", *argv]))

    lora = ["--lora-rank", "8", "--lora-merge-for-rollout"]
    refused(r"--target-modules qkv: not a decoder linear layer; use all-linear or HF names", *lora,
            "--target-modules", "qkv")
    refused(r"--lora-rank with --train-backend torchtitan: LoRA adapters train on the fsdp and megatron backends",
            *lora, "--train-backend", "torchtitan")
    refused(r"--update-weight-staging bucket with --lora-rank: an adapter-only update is staged whole .* use "
            r"--update-weight-staging full or auto, or add --lora-merge-for-rollout", "--lora-rank", "8",
            "--update-weight-staging", "bucket")
    refused(r"--lora-rank 600: vLLM serves adapters up to rank 512; use a smaller rank or --lora-merge-for-rollout",
            "--lora-rank", "600")
    refused(r"--lora-dropout 1.0: use 0 <= p < 1", *lora, "--lora-dropout", "1.0")
    megatron = ["--train-backend", "megatron", "--lora-rank", "8"]
    refused(r"--lora-dropout 0.1 with --train-backend megatron: .* use --lora-dropout 0", *megatron,
            "--lora-dropout", "0.1")
    refused(r"--lora-rank with --sequence-parallel: .* drop --sequence-parallel", *megatron, "--sequence-parallel",
            "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
    refused(r"--target-modules q_proj: megatron fuses q_proj, k_proj, v_proj into linear_qkv; adapt all of them or "
            r"none", *megatron, "--target-modules", "q_proj")
    refused(r"leaves no layer to adapt", *lora, "--target-modules", "linear_qkv", "--exclude-modules", "q_proj,k_proj,v_proj")
    config = config_from_args(build_parser().parse_args(["--colocate", "--train-backend", "fsdp", *lora,
                                                         "--target-modules", "linear_fc1,o_proj"]))
    assert config.backend.lora.target_modules == ("o_proj", "gate_proj", "up_proj")
    hf = str(make_tiny_model(tmp_path / "hf", SPEC))
    moe = str(make_tiny_model(tmp_path / "moe", TinySpec(family="qwen3_moe", num_attention_heads=2,
                                                        num_key_value_heads=2)))
    preflight(BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LORA))
    with pytest.raises(ConfigError, match=r"--lora-rank 4096 is larger than q_proj's smaller side \d+ .* use "
                                          r"--lora-rank \d+ or less"):
        preflight(BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LoRAConfig(rank=4096, merge_for_rollout=True)))
    with pytest.raises(ConfigError, match=r"--lora-rank with .*mixture-of-experts qwen3_moe: LoRA adapters are built "
                                          r"for dense models only"):
        preflight(BackendConfig(name="fsdp", hf_checkpoint=moe, lora=LORA))


def test_plan_memory_counts_only_the_adapters_state(tmp_path, capsys):
    """``plan --memory --lora-rank``: the base's weights on every fsdp rank's share, gradients and AdamW moments
    of the adapters alone (``rank x (in + out)`` per adapted layer)."""
    import json

    from rlplacement.cli import main as cli_main

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    argv = ["plan", "--memory", "--hf-config", str(hf / "config.json"), "--json", "--colocate", "--train-backend",
            "fsdp", "--actor-num-gpus-per-node", "2"]
    assert cli_main(argv) == 0
    full = json.loads(capsys.readouterr().out)["memory"]
    assert cli_main(argv + ["--lora-rank", "4", "--lora-merge-for-rollout", "--target-modules", "q_proj"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    cfg = json.loads((hf / "config.json").read_text())
    q_out = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    adapters = SPEC.num_hidden_layers * 4 * (cfg["hidden_size"] + q_out)
    assert memory["adapter_parameters"] == adapters
    share = -(-(memory["parameters"] + adapters) // 2)
    assert memory["trainer_rank"]["weights"] == 4 * share
    assert (memory["trainer_rank"]["gradients"], memory["trainer_rank"]["optimizer"]) == (4 * (adapters // 2),
                                                                                        8 * (adapters // 2))
    assert memory["trainer_rank"]["total"] < full["trainer_rank"]["total"] / 2
    # megatron at TP=2: q_proj is column-parallel, so each rank holds A whole and half of B; the distributed
    # optimizer spreads the adapters' fp32 state over the one data-parallel rank
    megatron = ["plan", "--memory", "--hf-config", str(hf / "config.json"), "--json", "--colocate", "--train-backend",
                "megatron", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--no-bf16"]
    assert cli_main(megatron + ["--lora-rank", "4", "--target-modules", "q_proj,k_proj,v_proj"]) == 0
    meg = json.loads(capsys.readouterr().out)["memory"]["trainer_rank"]
    kv_out = cfg["num_key_value_heads"] * (q_out // cfg["num_attention_heads"])
    per_rank = SPEC.num_hidden_layers * (3 * 4 * cfg["hidden_size"] + 4 * (q_out + 2 * kv_out) // 2)
    assert (meg["gradients"], meg["optimizer"]) == (4 * per_rank, 8 * per_rank), meg


def _save_resume(rank, world, hf, root):
    from rlplacement.backends import make_backend

    cfg = BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LORA)
    adam = OptimConfig(name="adamw", lr=1e-2)
    first = make_backend(cfg, adam, TRAIN)
    first.train_step(random_batch(SPEC.vocab_size, seed=10 + rank))
    first.save_checkpoint(root, weight_version=2)
    after = first.train_step(random_batch(SPEC.vocab_size, seed=20 + rank))
    expected = {n: t.clone() for n, t in first.iter_hf_tensors()}
    first.close()
    resumed = make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf, lora=LORA, load=root), adam, TRAIN)
    again = resumed.train_step(random_batch(SPEC.vocab_size, seed=20 + rank))
    got = {n: t.clone() for n, t in resumed.iter_hf_tensors()}
    resumed.close()
    return {"same_norm": after["grad_norm"] == again["grad_norm"],
            "equal": rank != 0 or (set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in got))}


@pytest.mark.slow
def test_a_lora_run_resumed_from_its_checkpoint_goes_on_bit_exact(tmp_path):
    """``--save`` then ``--load`` under LoRA (AdamW: the adapters' moments are in the checkpoint): the resumed
    step's gradient norm and the merged weights it streams equal the uninterrupted run's bit for bit. The
    checkpoint holds the adapters and their optimizer state alone (the base is the model folder's, named by
    the checkpoint's identity); a run without ``--lora-rank`` refuses it by name."""
    import torch.distributed.checkpoint as dcp

    from rlplacement.backends import train_checkpoint

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    root = tmp_path / "ckpt"
    results = launch.spawn(_save_resume, 2, str(hf), str(root), timeout_s=300)
    assert all(r["same_norm"] and r["equal"] for r in results), results
    folder = train_checkpoint.latest(root)
    keys = list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    weights = [k for k in keys if k.startswith("model.")]
    layers = SPEC.num_hidden_layers * len(LORA_MODULES)
    assert len(weights) == 2 * layers and all(".lora_" in k for k in weights), weights
    assert all(".lora_" in k for k in keys if k.startswith("optim.state.")), keys
    assert train_checkpoint.read_state(folder)["trainable_only"] is True
    with pytest.raises(RuntimeError, match=r"ConfigError: --load .*: its checkpoint holds the trainable parameters "
                                           r"alone \(a LoRA "
                                          r"run's adapters\): resume it with the same --lora-rank flags"):
        launch.spawn(_load_without_lora, 1, str(hf), str(root), timeout_s=300)
    _check_exports(hf, root, tmp_path)


VLLM_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, adapter = sys.argv[1], sys.argv[2]
kwargs = dict(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=64)
llm = LLM(model=base, enable_lora=adapter != "-", max_lora_rank=8, **kwargs)
out = llm.generate([{"prompt_token_ids": [5, 9, 17, 33]}], SamplingParams(max_tokens=8, temperature=0, logprobs=0),
                   lora_request=LoRARequest("exported", 1, adapter) if adapter != "-" else None, use_tqdm=False)
o = out[0].outputs[0]
print("RESULT", json.dumps({"tokens": list(o.token_ids), "logprobs": [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]}))
"""


def _served(base, adapter="-"):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(base), str(adapter)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _check_exports(hf, root, tmp_path):
    """``export-hf`` of the LoRA checkpoint: a PEFT adapter folder that peft loads with the checkpoint's
    adapters bit for bit and vLLM serves as a LoRA, and ``--merge-lora``'s merged folder, which vLLM serves
    with the same greedy tokens and log-probs (within 1e-4)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from rlplacement.backends import train_checkpoint
    from rlplacement.cli import main as cli_main
    from rlplacement.convert.peft_export import read_adapters

    adapters = read_adapters(train_checkpoint.latest(root))
    assert cli_main(["export-hf", "--load", str(root), "--save", str(tmp_path / "peft"), "--hf-config", str(hf)]) == 0
    assert cli_main(["export-hf", "--load", str(root), "--save", str(tmp_path / "merged"), "--hf-config", str(hf),
                     "--merge-lora"]) == 0
    written = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert set(written) == set(adapters) and all(torch.equal(written[n], adapters[n]) for n in written)
    peft_model = PeftModel.from_pretrained(load_hf(hf), str(tmp_path / "peft"))
    loaded = {n: p for n, p in peft_model.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(adapters)
    for name, tensor in adapters.items():
        module, matrix = name.removeprefix("base_model.model.").split(".lora_")
        assert torch.equal(loaded[f"base_model.model.{module}.lora_{matrix[0]}.default.weight"], tensor), name
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n)  # trained: B moved from zero
    live, merged = _served(hf, tmp_path / "peft"), _served(tmp_path / "merged")
    assert live["tokens"] == merged["tokens"]
    assert live["logprobs"] == pytest.approx(merged["logprobs"], abs=1e-4)
    assert _served(hf)["logprobs"] != pytest.approx(merged["logprobs"], abs=1e-4)  # the adapters change what is served


def _load_without_lora(rank, world, hf, root):
    from rlplacement.backends import make_backend

    make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf, load=root), OptimConfig(name="adamw"), TRAIN)


@pytest.mark.slow
def test_adapter_only_updates_hold_the_engines_base_against_the_trainers_once(tmp_path):
    """Adapter-only updates never send the base, so ``--check-weight-update-equal`` holds the checkpoint each
    engine loaded against the trainer's frozen base before the first update: engines started from another
    model of the same shapes are refused, naming the engine and a tensor, and nothing is sent."""
    import rlplacement
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.errors import WeightUpdateError

    trainer_model = make_tiny_model(tmp_path / "trainer", SPEC)
    engine_model = make_tiny_model(tmp_path / "engine", dataclasses.replace(SPEC, seed=1))
    config = config_from_args(build_parser().parse_args(
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--train-backend", "fsdp", "--lora-rank", "4",
         "--hf-checkpoint", str(trainer_model), "--check-weight-update-equal"]))
    with rlplacement.RLJob.start(config, str(engine_model)) as job:
        with pytest.raises(WeightUpdateError, match=r"engine 0: the base it serves is not the trainer's: .*"
                                                    r"model\.(embed_tokens|layers\.\d+\.\S+|norm)\.weight"):
            job.update_weights()
        assert job.version == 0


def _started_from_folder(rank, world, hf, folder, backend):
    from rlplacement.backends import make_backend
    from rlplacement.transfer.spec import RANK0

    lora = dataclasses.replace(LORA, merge_for_rollout=False, adapter_path=folder)
    built = make_backend(BackendConfig(name=backend, hf_checkpoint=hf, lora=lora,
                                       tensor_model_parallel_size=world if backend == "megatron" else 1), SGD, TRAIN)
    streamed = {n: t.clone() for n, t in built.iter_update_tensors(RANK0)}
    built.close()
    return streamed


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_adapters_start_from_a_peft_folder_bit_for_bit(tmp_path, backend):
    """``--lora-adapter-path``: every rank's adapters (FSDP shards, megatron's TP=2 parts) start as the folder's
    tensors; the adapter stream gives them back bit for bit. A folder of another rank, alpha, module set or
    model is refused by name before any process starts (preflight)."""
    from rlplacement.backends.preflight import preflight
    from rlplacement.errors import ConfigError
    from tests.reference_checks import write_adapter_folder

    spec = TinySpec(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    hf = make_tiny_model(tmp_path / "hf", spec)
    tensors = write_adapter_folder(tmp_path / "adapter", hf, LORA.rank, LORA.alpha, LORA_MODULES)
    streamed = launch.spawn(_started_from_folder, 2, str(hf), str(tmp_path / "adapter"), backend, timeout_s=300)[0]
    assert set(streamed) == set(tensors) and all(torch.equal(streamed[n], t) for n, t in tensors.items())
    if backend == "megatron":
        return
    lora = dataclasses.replace(LORA, adapter_path=str(tmp_path / "adapter"))
    preflight(BackendConfig(name="fsdp", hf_checkpoint=str(hf), lora=lora))
    for change, message in [
            ({"rank": 8}, r"adapter_config.json says r = 4, not --lora-rank 8; use --lora-rank 4"),
            ({"alpha": 2.0}, r"says lora_alpha = 8.0, not --lora-alpha 2.0; use --lora-alpha 8.0"),
            ({"target_modules": ("q_proj", "k_proj", "v_proj")}, r"adapter_model.safetensors holds .*down_proj.lora_A.weight, "
                                                                 r"which --target-modules does not adapt \(0 missing, "
                                                                 r"16 extra\)")]:
        with pytest.raises(ConfigError, match=message):
            preflight(BackendConfig(name="fsdp", hf_checkpoint=str(hf), lora=dataclasses.replace(lora, **change)))
    wider = make_tiny_model(tmp_path / "wider", dataclasses.replace(spec, hidden_size=128))
    with pytest.raises(ConfigError, match=r"--lora-adapter-path .*: base_model\.model\..* is \[4, 64\], not \[4, 128\] "
                                          r"as this model's layers need: it was trained on another model"):
        preflight(BackendConfig(name="fsdp", hf_checkpoint=str(wider), lora=lora))
    with pytest.raises(ConfigError, match=r"--lora-adapter-path .*: no adapter_config.json there"):
        preflight(BackendConfig(name="fsdp", hf_checkpoint=str(hf),
                                lora=dataclasses.replace(lora, adapter_path=str(tmp_path))))
