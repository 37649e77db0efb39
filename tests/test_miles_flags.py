"""Miles' own launch flags: its Qwen3-4B script's training, parallelism, optimizer and perf flags parse;
what is not built is refused naming the flag; the fp32 flags reach megatron's config and DDP."""

import pytest
import torch
import torch.distributed as dist

from rlplacement.args import build_parser, config_from_args
from rlplacement.errors import ConfigError

SPLIT = ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"]
# the training, parallelism, optimizer and perf part of Miles' run-qwen3-4B script (its flag names and values)
MILES_QWEN3_4B = [
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--optimizer", "adam", "--lr", "1e-6",
    "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--train-backend", "megatron",
]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_miles_qwen3_4b_training_flags_parse_and_land_in_the_config():
    cfg = config_from_args(parse(*SPLIT, *MILES_QWEN3_4B))
    assert cfg.optim.name == "adamw" and cfg.optim.betas == (0.9, 0.98) and cfg.optim.weight_decay == 0.1
    assert cfg.train.accumulate_allreduce_grads_in_fp32 and cfg.train.attention_softmax_in_fp32
    assert (cfg.backend.context_parallel_size, cfg.backend.expert_model_parallel_size,
            cfg.backend.expert_tensor_parallel_size) == (1, 1, 1)
    assert config_from_args(parse(*SPLIT, "--optimizer", "sgd")).optim.name == "sgd"


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "2"], r"--context-parallel-size 2: context parallelism is not built .* use "
                                       r"--context-parallel-size 1"),
    (["--train-backend", "fsdp", "--expert-model-parallel-size", "2"],
     r"--expert-model-parallel-size 2 is megatron's expert parallelism; the fsdp backend shards experts .* use "
     r"--expert-model-parallel-size 1"),
    (["--train-backend", "fsdp", "--moe-token-dispatcher-type", "alltoall"],
     r"--moe-token-dispatcher-type configures megatron's MoE layer; the fsdp backend runs the model's own MoE blocks"),
    (["--moe-aux-loss-coeff", "-0.1"], r"--moe-aux-loss-coeff -0.1: a loss weight is 0 or more"),
    (["--moe-grouped-gemm"], r"--moe-grouped-gemm: megatron's grouped expert layouts .* are not built"),
    (["--expert-model-parallel-size", "3"], r"--expert-model-parallel-size 3 does not divide the trainer's 4 "
                                            r"data-parallel ranks"),
    (["--expert-tensor-parallel-size", "4"], r"--expert-tensor-parallel-size 4: .* use --expert-tensor-parallel-size 1"),
    (["--attention-dropout", "0.1"], r"--attention-dropout 0.1: dropout makes the trainer's log-probs .* use "
                                     r"--attention-dropout 0"),
    (["--hidden-dropout", "0.1"], r"--hidden-dropout 0.1: .* use --hidden-dropout 0"),
    (["--train-backend", "fsdp", "--no-accumulate-allreduce-grads-in-fp32"],
     r"--no-accumulate-allreduce-grads-in-fp32 configure megatron; the fsdp backend reduces gradients in fp32"),
    (["--train-backend", "torchtitan", "--no-attention-softmax-in-fp32"],
     r"--no-attention-softmax-in-fp32 configure megatron; the torchtitan backend"),
])
def test_what_is_not_built_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(parse(*SPLIT, *argv))


def test_optimizer_choices_are_megatrons(capsys):
    with pytest.raises(SystemExit):
        parse(*SPLIT, "--optimizer", "lion")
    assert "invalid choice: 'lion'" in capsys.readouterr().err


@pytest.fixture
def single_rank():
    from rlplacement.backends import launch

    launch.init_single_process("gloo")
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("on", [True, False])
def test_the_fp32_flags_reach_megatrons_config_and_ddp(tmp_path, single_rank, on):
    from rlplacement.backends import make_backend
    from rlplacement.config import BackendConfig, OptimConfig
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    flags = [] if on else ["--no-accumulate-allreduce-grads-in-fp32", "--no-attention-softmax-in-fp32"]
    cfg = config_from_args(parse("--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", *flags))
    hf_dir = make_tiny_model(tmp_path / "hf", TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2))
    backend = make_backend(BackendConfig(name="megatron", hf_checkpoint=str(hf_dir)), OptimConfig(lr=1e-3),
                           train=cfg.train)
    try:
        assert backend.model.config.attention_softmax_in_fp32 is on
        assert backend._training.ddp.ddp_config.grad_reduce_in_fp32 is on
        assert torch.isfinite(torch.tensor(backend.train_step(_batch())["loss"]))
    finally:
        backend.close()


def _batch():
    from rlplacement.backends.hf_reference import random_batch

    return random_batch(300, seed=1)  # TinySpec's vocabulary
