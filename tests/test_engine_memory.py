"""An engine's memory budget: what an update holds on each worker under ``--update-weight-staging``
counts inside the budget whoever set it, ``auto`` picks what fits, and a staging that leaves vLLM no
room is refused naming the flags that change it. Pure functions of a model folder's safetensors headers."""

import json
import struct

import pytest

from rlplacement.engines.engine_settings import largest_bucket_bytes, model_bytes, resolve_engine_memory
from rlplacement.errors import ConfigError

GIB = 1 << 30


def _headers_only_model(path, hidden: int, layers: int, vocab: int):
    """A model folder whose safetensors file has real headers and no data: shapes are all the budget reads."""
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden // 4, hidden],
                       p + "self_attn.v_proj.weight": [hidden // 4, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                       p + "mlp.gate_proj.weight": [3 * hidden, hidden], p + "mlp.up_proj.weight": [3 * hidden, hidden],
                       p + "mlp.down_proj.weight": [hidden, 3 * hidden]})
    header = {n: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for n, s in shapes.items()}
    blob = json.dumps(header).encode()
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    (path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    return path


@pytest.fixture
def model_70b_like(tmp_path):
    return _headers_only_model(tmp_path / "m", hidden=8192, layers=80, vocab=128256)  # ~68 B parameters


def test_the_staging_counts_against_a_budget_the_user_set(model_70b_like):
    h200 = 141 * 10**9
    memory = resolve_engine_memory(model_70b_like, "bfloat16", staging="bucket", bucket_bytes=512 << 20,
                                   utilization=0.85, total_bytes=h200)
    largest = largest_bucket_bytes(model_70b_like, "bfloat16", 512 << 20)
    assert largest == 128256 * 8192 * 2  # the embedding goes alone, over the bucket size
    assert memory.staging_bytes == 2 * largest
    assert memory.vllm_utilization == pytest.approx(0.85 - 2 * largest / h200, abs=1e-4)


def test_auto_is_full_while_the_whole_model_is_a_small_share_of_the_gpu_else_bucket(model_70b_like, tmp_path):
    small = _headers_only_model(tmp_path / "small", hidden=1024, layers=4, vocab=32000)
    h200 = 141 * 10**9
    assert resolve_engine_memory(small, "bfloat16", staging="auto", bucket_bytes=512 << 20, total_bytes=h200).staging \
        == "full"
    big = resolve_engine_memory(model_70b_like, "bfloat16", staging="auto", bucket_bytes=512 << 20, total_bytes=h200)
    assert big.staging == "bucket" and big.staging_bytes < 4 * GIB  # two embeddings' worth, not 119 GiB


def test_full_staging_of_a_70b_model_is_refused_naming_bucket_staging(model_70b_like):
    assert model_bytes(model_70b_like, "bfloat16") > 110 * GIB
    with pytest.raises(ConfigError, match=r"--update-weight-staging full holds 1\d\d\.\d GiB in bfloat16 on each "
                                          r"engine worker, .*use --update-weight-staging bucket \(two buckets, 3\.9 "
                                          r"GiB.*More GPUs per engine do not help"):
        resolve_engine_memory(model_70b_like, "bfloat16", staging="full", bucket_bytes=512 << 20,
                              total_bytes=141 * 10**9)


def test_bucket_staging_that_leaves_no_room_names_the_bucket_size(model_70b_like):
    with pytest.raises(ConfigError, match=r"--vllm-gpu-memory-utilization 0\.12: lower --update-weight-buffer-size"):
        resolve_engine_memory(model_70b_like, "bfloat16", staging="bucket", bucket_bytes=4 * GIB, utilization=0.12,
                              total_bytes=80 * 10**9)


def test_a_wide_engine_whose_workers_receive_their_slices_stages_each_workers_share(tmp_path):
    """A 70B-shaped Llama engine at TP=8 on an 80 GB card: whole tensors under full staging cannot fit, each
    worker's share (its q/k/v heads, gate/up rows, o/down columns and vocabulary rows; norms whole) does, and
    the refusal for whole tensors names the way out."""
    from rlplacement.engines.engine_settings import worker_tensor_bytes

    model = _headers_only_model(tmp_path / "m", hidden=8192, layers=80, vocab=128256)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 24576,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 16, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}))
    whole = model_bytes(model, "bfloat16")
    share = sum(worker_tensor_bytes(model, "bfloat16", 8).values())
    assert share == pytest.approx(whole / 8, rel=0.01)
    memory = resolve_engine_memory(model, "bfloat16", staging="full", bucket_bytes=512 << 20, utilization=0.9,
                                   total_bytes=80 * 10**9, sliced_width=8)
    assert memory.staging_bytes == share and memory.vllm_utilization == pytest.approx(0.9 - share / 80e9, abs=1e-4)
    with pytest.raises(ConfigError, match=r"workers receive whole tensors \(a mode that sends slices, with "
                                          r"--update-weight-slices auto, sends each worker its share\)"):
        resolve_engine_memory(model, "bfloat16", staging="full", bucket_bytes=512 << 20, total_bytes=80 * 10**9)


def test_pieces_from_several_trainer_ranks_count_the_assembled_tensors_too(tmp_path):
    """Where the trainer's ranks each send their rows (``transfer.pieces``), a worker holds the pieces it received
    and the tensors it assembled from them: full staging counts its share twice; bucket staging two buckets (each
    sender's bucket is halved for the tensors assembling), or three times a fused group larger than half a bucket."""
    from rlplacement.engines.engine_settings import staging_per_option, worker_tensor_bytes

    model = _headers_only_model(tmp_path / "m", hidden=8192, layers=80, vocab=128256)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 24576,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 16, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}))
    sizes = worker_tensor_bytes(model, "bfloat16", 8)
    share = sum(sizes.values())
    plain, pieces = staging_per_option(sizes, 512 << 20), staging_per_option(sizes, 512 << 20, pieces=True)
    assert pieces["full"] == 2 * plain["full"] == 2 * share
    # bucket: every fused group of a worker's share (the largest, the embedding's eighth: 263 MB) is at most half a
    # 512 MiB bucket, so two buckets, as with whole tensors; at 256 MiB buckets, three of that group
    group = 128256 * 8192 * 2 // 8
    assert pieces["bucket"] == plain["bucket"] == 2 * (512 << 20)
    assert staging_per_option(sizes, 256 << 20, pieces=True)["bucket"] == 3 * group > 2 * (256 << 20)
    assert staging_per_option(sizes, 256 << 20)["bucket"] == 2 * (256 << 20)
    memory = resolve_engine_memory(model, "bfloat16", staging="full", bucket_bytes=512 << 20, utilization=0.9,
                                   total_bytes=80 * 10**9, sliced_width=8, pieces=True)
    assert memory.staging_bytes == 2 * share and memory.vllm_utilization == pytest.approx(0.9 - 2 * share / 80e9,
                                                                                          abs=1e-4)
    assert staging_per_option({"w": 10}, 512 << 20, pieces=True) == {"full": 20, "bucket": 20}  # never over all twice


def test_the_job_tells_engines_when_its_trainer_sends_pieces(tmp_path):
    """One rule (``trainer_sends_pieces``) for what the engines' memory is sized for: an FSDP, torchtitan or
    Megatron trainer of several ranks in a split layout of a mode where every rank sends (experts too); not one
    rank, LoRA or colocated. The job reads it from its flags and the model's config."""
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.job_start import trainer_sends_pieces_for
    from rlplacement.transfer.pieces import trainer_sends_pieces
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))

    def job_flags(*argv, model=tmp_path):
        return trainer_sends_pieces_for(config_from_args(build_parser().parse_args(list(argv))))

    split = ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--train-backend", "fsdp"]
    assert job_flags(*split)
    assert job_flags(*split, "--update-weight-transfer-mode", "p2p")
    assert job_flags(*split, model=tmp_path / "moe")  # a rank sends its own experts
    assert job_flags("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--train-backend", "megatron",
                     model=tmp_path / "moe")
    assert not job_flags(*split, "--lora-rank", "8")
    assert job_flags("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--train-backend", "megatron")
    assert job_flags("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--train-backend", "torchtitan")
    assert not job_flags(*split, "--colocate")
    assert not job_flags("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--train-backend", "fsdp")

    assert trainer_sends_pieces("fsdp", 2, SHARES, lora=False)
    assert trainer_sends_pieces("megatron", 2, SHARES, lora=False)
    assert trainer_sends_pieces("torchtitan", 2, SHARES, lora=False)
    for backend, world, who, lora in (("fsdp", 1, SHARES, False), ("megatron", 2, SHARES, True),
                                      ("torchtitan", 1, SHARES, False), ("fsdp", 2, SHARES, True),
                                      ("fsdp", 2, OWN_GPU, False), ("fsdp", 2, RANK0, False)):
        assert not trainer_sends_pieces(backend, world, who, lora=lora), (backend, world, who, lora)
