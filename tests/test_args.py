"""Flags: added once, validated in one place, rejections name the flag and the fix."""

import argparse

import pytest

from rlplacement.args import add_arguments, build_parser, config_from_args
from rlplacement.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_defaults_follow_miles():
    args = parse("--rollout-num-gpus", "8")
    cfg = config_from_args(args)
    assert cfg.placement.actor_num_nodes == 1 and cfg.placement.actor_num_gpus_per_node == 8
    assert cfg.placement.rollout_num_gpus_per_engine == 1 and cfg.placement.num_gpus_per_node == 8
    assert cfg.transfer.mode == "broadcast" and cfg.transfer.bucket_bytes == 512 * 1024 * 1024
    assert cfg.transfer.options is None and cfg.backend.name == "megatron"  # broadcast has no options of its own


def test_add_arguments_skips_flags_the_parser_has():
    parser = argparse.ArgumentParser()
    parser.add_argument("--colocate", type=int, default=7)  # a foreign definition wins
    add_arguments(parser)
    add_arguments(parser)  # twice is harmless
    args = parser.parse_args(["--colocate", "0", "--rollout-num-gpus", "2"])
    assert args.colocate == 0 and args.rollout_num_gpus == 2
    assert parser.parse_args([]).update_weight_transfer_mode == "broadcast"


def test_config_from_a_foreign_namespace_uses_defaults_for_missing_flags():
    cfg = config_from_args(argparse.Namespace(colocate=True, actor_num_gpus_per_node=4))
    assert cfg.placement.rollout_num_gpus == 4 and cfg.transfer.mode == "cuda_ipc" and cfg.transfer.requested_mode == "broadcast"


def test_colocate_derives_rollout_without_rewriting_args():
    args = parse("--colocate", "--actor-num-gpus-per-node", "4")
    cfg = config_from_args(args)
    assert cfg.placement.rollout_num_gpus == 4
    assert args.rollout_num_gpus is None  # never written back


@pytest.mark.parametrize("argv, want", [
    (["--colocate", "--actor-num-gpus-per-node", "2"], (None, None)),  # unset: decided from memory each step
    (["--colocate", "--actor-num-gpus-per-node", "2", "--no-offload-train"], (False, None)),
    (["--colocate", "--actor-num-gpus-per-node", "2", "--no-offload-rollout"], (None, False)),
    (["--colocate", "--actor-num-gpus-per-node", "2", "--offload-train", "--offload-rollout"], (True, True)),
    (["--colocate", "--actor-num-gpus-per-node", "2", "--no-offload-train", "--no-offload-rollout"], (False, False)),
    (["--rollout-num-gpus", "2"], (False, False)),  # split: each side keeps its own GPUs
    (["--rollout-num-gpus", "2", "--no-offload-train"], (False, False)),  # saying no to nothing is harmless
])
def test_offload_flags_resolve_without_rewriting_args(argv, want):
    args = parse(*argv)
    p = config_from_args(args).placement
    assert (p.offload_train, p.offload_rollout) == want
    assert args.offload_train is (False if "--no-offload-train" in argv else True if "--offload-train" in argv
                                  else None)  # never written back


@pytest.mark.parametrize("argv, match", [
    (["--rollout-num-gpus", "2", "--offload-rollout-keep-weights"], "without --colocate nothing sleeps: add --colocate"),
    (["--colocate", "--actor-num-gpus-per-node", "2", "--no-offload-rollout", "--offload-rollout-keep-weights"],
     "--no-offload-rollout keeps the engines awake: drop one of the two flags"),
])
def test_keeping_engine_weights_without_sleeping_engines_is_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_args(parse(*argv))


def test_keeping_engine_weights_is_carried_into_the_placement():
    p = config_from_args(parse("--colocate", "--actor-num-gpus-per-node", "2", "--offload-rollout-keep-weights")).placement
    assert p.offload_rollout_keep_weights and p.offload_rollout is None


def test_config_is_frozen():
    cfg = config_from_args(parse("--rollout-num-gpus", "2"))
    with pytest.raises(Exception):
        cfg.placement.rollout_num_gpus = 3


@pytest.mark.parametrize("argv, pattern", [
    ([], r"split layout .*needs --rollout-num-gpus"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
     r"--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"),
    (["--rollout-num-gpus", "12", "--rollout-num-gpus-per-engine", "12"],
     r"--rollout-num-gpus-per-engine 12 is wider than a node .*not a whole number of nodes"),
    (["--colocate", "--rollout-num-gpus", "4"], r"--colocate .*--rollout-num-gpus is 4.*set it to 8"),
    (["--colocate", "--update-weight-transfer-mode", "p2p"], r"p2p cannot be used with --colocate"),
    (["--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4",
      "--rollout-num-gpus-per-engine", "8"],
     r"--colocate with --actor-num-nodes 2: an engine of --rollout-num-gpus-per-engine 8 must lie inside one node "
     r".*use a divisor of 4, or --actor-num-nodes 1"),
    (["--colocate", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/x"],
     r"disk-delta cannot be used with --colocate"),
    (["--rollout-num-gpus", "2", "--update-weight-transfer-mode", "disk-delta"],
     r"disk-delta needs --update-weight-disk-dir"),
    (["--rollout-num-gpus", "0"], r"--rollout-num-gpus must be positive, got 0"),
    (["--rollout-num-gpus", "2", "--actor-num-nodes", "-1"], r"--actor-num-nodes must be positive"),
    (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "0"], r"--rollout-num-gpus-per-engine must be positive"),
    (["--rollout-num-gpus", "2", "--update-weight-buffer-size", "0B"], r"--update-weight-buffer-size must be positive"),
    (["--rollout-num-gpus", "2", "--p2p-transfer-timeout", "0"], r"--p2p-transfer-timeout must be positive"),
    (["--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "8", "--num-gpus-per-node", "4"],
     r"--actor-num-gpus-per-node 8 is larger than --num-gpus-per-node 4"),
    (["--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "4"],
     r"6 GPUs are not divisible by --tensor-model-parallel-size 4"),
    (["--rollout-num-gpus", "2", "--train-backend", "fsdp", "--tensor-model-parallel-size", "2"],
     r"apply to --train-backend megatron, not fsdp"),
    (["--rollout-num-gpus", "2", "--offload-train"],
     r"--offload-train hands GPU memory .* only share GPUs under --colocate.*drop --offload-train, or add --colocate"),
    (["--rollout-num-gpus", "2", "--offload-train", "--offload-rollout"],
     r"--offload-train and --offload-rollout hand GPU memory .*drop --offload-train and --offload-rollout"),
    (["--rollout-num-gpus", "2", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/x",
      "--update-weight-staging", "bucket"],
     r"--update-weight-staging bucket: --update-weight-transfer-mode disk-delta stages whole updates on each engine "
     r"worker\. Use --update-weight-staging full, or a split layout with one of: broadcast, broadcast_packed, p2p"),
    (["--colocate", "--update-weight-staging", "bucket"],
     r"--update-weight-staging bucket: under --colocate the engines take updates through cuda_ipc, which stages"),
    (["--colocate", "--one-step-off"], r"--one-step-off overlaps generation with training, but under --colocate .*"
                                       r"drop --one-step-off, or drop --colocate"),
])
def test_rejections_name_the_flag(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_args(parse(*argv))


@pytest.mark.parametrize("argv", [["--update-weight-transfer-mode", "nccl"], ["--train-backend", "deepspeed"],
                                  ["--update-weight-delta-encoding", "zip"], ["--p2p-protocol", "ucx"]])
def test_unknown_choices_rejected_by_argparse(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "invalid choice" in capsys.readouterr().err


def test_unknown_mode_from_a_foreign_parser_is_rejected():
    ns = argparse.Namespace(rollout_num_gpus=2, update_weight_transfer_mode="nccl")
    with pytest.raises(ConfigError, match="--update-weight-transfer-mode 'nccl' is unknown"):
        config_from_args(ns)


def test_rljob_refuses_a_mode_not_built_before_any_process_starts(tmp_path, monkeypatch):
    import ray

    from rlplacement import RLJob
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.transfer import registry

    config = config_from_args(build_parser().parse_args(
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--update-weight-transfer-mode", "p2p"]))
    registry.specs()  # the built-in modes registered
    monkeypatch.delitem(registry._SPECS, "p2p")  # a config made before the mode left this build
    was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"weight transfer 'p2p' \(from --update-weight-transfer-mode\) is not "
                                          r"available in this build: use one of broadcast, broadcast_packed, cuda_ipc, "
                                          r"disk-delta\."):
        RLJob.start(config, str(tmp_path / "no-model-needed"))
    assert ray.is_initialized() == was_up  # refused before Ray, placement or any actor


@pytest.mark.parametrize("has_rdma, flags, want", [
    (False, [], "tcp"), (True, [], "rdma"), (True, ["--p2p-protocol", "tcp"], "tcp"),
    (False, ["--p2p-protocol", "rdma"], None)])
def test_p2p_protocol_defaults_to_the_hosts_transport_and_keeps_a_set_value(monkeypatch, has_rdma, flags, want):
    from rlplacement.transfer import p2p

    monkeypatch.setattr(p2p, "rdma_device_present", lambda: has_rdma)
    argv = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--update-weight-transfer-mode", "p2p", *flags]
    if want is None:
        with pytest.raises(ConfigError, match=r"--p2p-protocol rdma: this host has no RDMA device .* use --p2p-protocol tcp"):
            config_from_args(build_parser().parse_args(argv))
    else:
        assert config_from_args(build_parser().parse_args(argv)).transfer.options.protocol == want


def test_every_flag_works_on_a_base_install():
    """--check-weight-update-equal hashes with xxhash: it must be a base requirement, not an extra's."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "install_requires")
    assert "xxhash" in requires


def test_choice_flags_follow_their_registries(monkeypatch, capsys):
    """--train-backend accepts a backend registered after import; a mode no longer registered is refused."""
    from rlplacement.backends import registry as backends
    from rlplacement.transfer import registry as modes

    from rlplacement.specs.backend import BackendSpec

    backends.known_backends()  # the built-in backends registered
    monkeypatch.setitem(backends.REGISTRY._specs, "my_backend",
                        BackendSpec(name="my_backend", backend="my_pkg.backend:MyBackend", summary="registered late"))
    cfg = config_from_args(parse("--rollout-num-gpus", "8", "--train-backend", "my_backend"))
    assert cfg.backend.name == "my_backend"
    assert "my_backend" in build_parser().format_help()
    modes.specs()  # the built-in modes registered
    monkeypatch.delitem(modes._SPECS, "p2p")
    with pytest.raises(SystemExit):
        parse("--update-weight-transfer-mode", "p2p")
    assert "invalid choice: 'p2p'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--update-weight-transfer-mode 'p2p' is unknown: use one of broadcast, "
                                          r"broadcast_packed, disk-delta\."):
        config_from_args(argparse.Namespace(rollout_num_gpus=2, update_weight_transfer_mode="p2p"))


def test_each_flag_default_is_its_config_field_default():
    """Defaults are written once, on the configs; the flags read them."""
    from rlplacement.args import flag_default
    from rlplacement.config import BackendConfig, PlacementConfig, TransferConfig, default_of
    from rlplacement.transfer.p2p import P2POptions

    pairs = {("actor_num_gpus_per_node", PlacementConfig, "actor_num_gpus_per_node"),
             ("update_weight_transfer_mode", TransferConfig, "requested_mode"),
             ("update_weight_buffer_size", TransferConfig, "bucket_bytes"),
             ("p2p_transfer_timeout", P2POptions, "transfer_timeout_s"),
             ("train_backend", BackendConfig, "name")}
    for dest, cls, field in pairs:
        assert flag_default(dest) == default_of(cls, field), dest
    cfg = config_from_args(parse("--rollout-num-gpus", "8"))
    assert cfg.transfer == TransferConfig(mode="broadcast")  # every other field at its default
    with pytest.raises(TypeError):
        PlacementConfig(False, 1, 8, 8)  # keyword-only


@pytest.mark.parametrize("argv, message", [
    (["--global-batch-size", "4", "--micro-batch-size", "4", "--actor-num-gpus-per-node", "2"],
     r"--micro-batch-size 4 is larger than a rank's share of an optimizer step \(--global-batch-size 4 over 2 "
     r"data-parallel ranks = 2\): lower --micro-batch-size to 2 or less"),
    (["--global-batch-size", "3", "--actor-num-gpus-per-node", "2"],
     r"--global-batch-size 3 does not split over the trainer's 2 data-parallel ranks: use a multiple of 2"),
    (["--use-dynamic-batch-size"], r"--use-dynamic-batch-size packs micro-batches by token count: set --max-tokens"),
    (["--max-tokens-per-gpu", "4096"], r"--max-tokens-per-gpu applies to --use-dynamic-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "9", "--micro-batch-size", "2"],
     r"--micro-batch-size and --use-dynamic-batch-size both size micro-batches: keep one"),
    (["--kl-loss-type", "k2"], r"--kl-loss-type k2 chooses the KL estimator of --use-kl-loss: add --use-kl-loss"),
    (["--kl-loss-coef", "0.1"], r"--kl-loss-coef weighs the KL term of --use-kl-loss"),
    (["--lr-decay-style", "cosine"], r"--lr-decay-style cosine needs --lr-decay-iters"),
    (["--lr-decay-style", "linear", "--lr-decay-iters", "5", "--lr-warmup-iters", "5"],
     r"--lr-decay-iters 5 must exceed --lr-warmup-iters 5"),
    (["--min-lr", "1e-3"], r"--min-lr 0.001 must be between 0 and --lr 1e-06"),
    (["--save-interval", "10"], r"--save-interval says how often to write a checkpoint: set --save"),
    (["--micro-batch-size", "0"], r"--micro-batch-size must be positive, got 0"),
    (["--train-backend", "fsdp", "--use-distributed-optimizer"],
     r"--use-distributed-optimizer is megatron's DistributedOptimizer; the fsdp backend shards"),
    (["--train-backend", "megatron", "--gradient-checkpointing"],
     r"--gradient-checkpointing is the fsdp and torchtitan backends' recompute; megatron recomputes through its own "
     r"flags: use --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    (["--train-backend", "megatron", "--recompute-granularity", "full"],
     r"--recompute-granularity full needs --recompute-method \(uniform or block\) and --recompute-num-layers N"),
    (["--train-backend", "megatron", "--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     r"--recompute-num-layers apply only with --recompute-granularity full \(got selective\)"),
    (["--train-backend", "megatron", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], r"--recompute-num-layers 0: use 1 or more"),
    (["--train-backend", "fsdp", "--sequence-parallel"],
     r"--sequence-parallel is megatron's sequence parallelism over its TP ranks; the fsdp backend has no tensor"),
    (["--train-backend", "megatron", "--sequence-parallel"],
     r"--sequence-parallel splits the sequence over the tensor-parallel ranks, and --tensor-model-parallel-size is 1"),
    (["--train-backend", "fsdp", "--recompute-granularity", "selective"],
     r"are megatron's; the fsdp backend recomputes with --gradient-checkpointing: use that instead"),
])
def test_train_step_flags_are_refused_naming_the_fix(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(parse("--rollout-num-gpus", "8", *argv))


def test_train_step_flags_reach_the_configs():
    cfg = config_from_args(parse("--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "4", "--train-backend", "fsdp",
                                 "--global-batch-size",
                                 "64", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
                                 "--gradient-checkpointing", "--use-kl-loss", "--kl-loss-coef", "0.01", "--eps-clip-high",
                                 "0.28", "--rollout-temperature", "0.7", "--lr", "2e-6", "--lr-decay-style", "cosine",
                                 "--lr-decay-iters", "100", "--lr-warmup-iters", "10", "--clip-grad", "0",
                                 "--adam-beta2", "0.95", "--no-bf16", "--save", "/ckpt", "--save-interval", "5"))
    t, o = cfg.train, cfg.optim
    assert (t.global_batch_size, t.max_tokens_per_gpu, t.gradient_checkpointing, t.kl_loss_type) == (
        64, 16384, True, "low_var_kl")
    assert (t.eps_clip, t.eps_clip_upper, t.rollout_temperature, t.bf16, t.save, t.save_interval) == (
        0.2, 0.28, 0.7, False, "/ckpt", 5)
    assert (o.lr, o.lr_decay_style, o.lr_decay_iters, o.lr_warmup_iters, o.max_grad_norm, o.betas) == (
        2e-6, "cosine", 100, 10, 0.0, (0.9, 0.95))
    assert config_from_args(parse("--rollout-num-gpus", "8")).train.bf16 is None  # on where the trainer has a GPU


def test_a_framework_parser_that_defines_lr_and_bf16_first_keeps_working():
    """Megatron's parser (Miles builds on it) defines --lr with no default and --bf16 as store_true before
    ours are added."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--bf16", action="store_true")
    add_arguments(parser)
    fsdp = ["--rollout-num-gpus", "8", "--train-backend", "fsdp"]
    cfg = config_from_args(parser.parse_args([*fsdp, "--lr", "1e-5", "--bf16"]))
    assert cfg.optim.lr == 1e-5 and cfg.train.bf16 is True
    assert config_from_args(parser.parse_args([*fsdp, "--lr", "1e-5"])).train.bf16 is False
    with pytest.raises(ConfigError, match=r"--lr is unset \(the parser that defines it gives it no default\): set --lr"):
        config_from_args(parser.parse_args(fsdp))


def test_megatron_recompute_flags_reach_the_model_config_and_its_stage_bound_is_checked():
    import torch

    from rlplacement.backends.megatron.model_config import transformer_config
    from rlplacement.errors import ConfigError as Refused
    from rlplacement.families import family_for
    from rlplacement.models.tiny import TinySpec, build_config

    cfg = config_from_args(parse("--rollout-num-gpus", "8", "--train-backend", "megatron", "--recompute-granularity",
                                 "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    t = cfg.train
    recompute = {"recompute_granularity": t.recompute_granularity, "recompute_method": t.recompute_method,
                 "recompute_num_layers": t.recompute_num_layers}
    hf = build_config(TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4))
    tc = transformer_config(hf, family_for(hf), 1, 2, torch.float32, recompute=recompute)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    with pytest.raises(Refused, match=r"--recompute-num-layers 3 is more than a pipeline stage's 2 layers \(4 over "
                                      r"--pipeline-model-parallel-size 2\): use 2 or fewer"):
        transformer_config(hf, family_for(hf), 1, 2, torch.float32, recompute={**recompute, "recompute_num_layers": 3})


@pytest.mark.parametrize("spec, te_fusions", [("te", True), ("local", False)])
def test_megatron_turns_on_its_default_fusions_on_a_gpu_only(spec, te_fusions):
    from rlplacement.backends.megatron.model_config import fusions

    names = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
             "gradient_accumulation_fusion")
    assert [fusions(spec, on_gpu=True, wgrad_kernel=True)[n] for n in names] == [True, True] + [te_fusions] * 3
    assert not fusions(spec, on_gpu=True, wgrad_kernel=False)["gradient_accumulation_fusion"]  # as megatron's training
    assert not any(fusions(spec, on_gpu=False, wgrad_kernel=True)[n] for n in names)


def test_sequence_parallel_needs_transformer_engine_and_says_so_before_building_anything():
    import torch

    from rlplacement.backends.megatron.model_config import transformer_config
    from rlplacement.errors import ConfigError as Refused
    from rlplacement.families import family_for
    from rlplacement.models.tiny import TinySpec, build_config

    cfg = config_from_args(parse("--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "2", "--train-backend",
                                 "megatron", "--tensor-model-parallel-size", "2", "--sequence-parallel"))
    assert cfg.backend.sequence_parallel
    hf = build_config(TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(Refused, match=r"--sequence-parallel needs TP > 1 and the TransformerEngine layer spec, and the "
                                      r"layer spec is 'local', not TransformerEngine's"):
        transformer_config(hf, family_for(hf), 2, 1, torch.float32, "local", sequence_parallel=True)


@pytest.mark.parametrize("argv, message", [
    (["--rollout-temperature", "0"], r"--rollout-temperature 0.0: the trainer divides its logits by the temperature, "
                                     r"so it must be above 0"),
    (["--eps-clip", "-1"], r"^--eps-clip -1.0 must be 0 or more: set --eps-clip to 0 or a positive value\.$"),
    (["--eps-clip-high", "-0.1"], r"^--eps-clip-high -0.1 must be 0 or more"),
    (["--kl-loss-coef", "-1", "--use-kl-loss"], r"^--kl-loss-coef -1.0 must be 0 or more"),
    (["--p2p-transfer-timeout", "0.0"], r"--p2p-transfer-timeout must be positive, got 0.0: set --p2p-transfer-timeout "
                                        r"to a value above 0\."),
])
def test_a_bad_value_is_named_alone_with_what_to_set(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(parse("--rollout-num-gpus", "2", *argv))


@pytest.mark.parametrize("given, size", [("512MiB", 512 << 20), ("2GB", 2_000_000_000), ("64KiB", 64 << 10),
                                         ("1.5GiB", 3 << 29), ("1048576", 1 << 20), ("100B", 100)])
def test_buffer_sizes_take_units(given, size):
    assert config_from_args(parse("--rollout-num-gpus", "2", "--update-weight-buffer-size", given)).transfer.bucket_bytes == size


def test_a_bare_buffer_size_under_a_mebibyte_is_refused_naming_the_unit(capsys):
    with pytest.raises(SystemExit):
        parse("--rollout-num-gpus", "2", "--update-weight-buffer-size", "512")
    assert ("argument --update-weight-buffer-size: 512 is 512 bytes, smaller than a bucket usefully is: write the "
            "unit, e.g. 512MiB (or 512B if you mean bytes)") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--update-weight-buffer-size", "lots")
    assert "'lots' is not a size: write bytes with a unit, e.g. 512MiB or 2GB" in capsys.readouterr().err


def test_a_misspelled_flag_gets_the_flag_it_resembles(capsys):
    from rlplacement.cli import main

    with pytest.raises(SystemExit):
        parse("--rollout-num-gpus", "2", "--update-weights-transfer-mode", "p2p")
    assert "--update-weights-transfer-mode: did you mean --update-weight-transfer-mode?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a subcommand's flags too
        main(["plan", "--rolout-num-gpus", "2"])
    assert "--rolout-num-gpus: did you mean --rollout-num-gpus?" in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [
    (["--rollout-num-gpus", "2"], "auto"),
    (["--rollout-num-gpus", "2", "--update-weight-staging", "bucket"], "bucket"),
    (["--rollout-num-gpus", "2", "--update-weight-transfer-mode", "p2p", "--update-weight-staging", "full"], "full"),
    (["--colocate"], "full"),  # the colocated path stages whole updates (a direct one stages nothing)
    (["--rollout-num-gpus", "2", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/x"],
     "full"),
])
def test_update_weight_staging_resolves_per_mode(argv, want):
    assert config_from_args(parse(*argv)).transfer.staging == want


def test_bucket_staging_agrees_between_a_modes_spec_and_its_receiver():
    from rlplacement.transfer import registry

    for name, spec in registry.specs().items():
        assert spec.bucket_staging == spec.receiver_class().bucketwise, name


def test_update_weight_slices_is_auto_unless_turned_off_and_a_bad_value_is_refused_by_name(capsys):
    assert config_from_args(parse("--rollout-num-gpus", "2")).transfer.slices == "auto"
    assert config_from_args(parse("--rollout-num-gpus", "2", "--update-weight-slices", "off")).transfer.slices == "off"
    with pytest.raises(SystemExit):
        parse("--update-weight-slices", "some")
    assert "--update-weight-slices: invalid choice: 'some'" in capsys.readouterr().err
