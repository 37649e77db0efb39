"""The built-in trainer backends' specs (megatron, fsdp, torchtitan), registered on import
(:mod:`rlplacement.specs.backend` imports this module on its first lookup), and the calls their
``"module:function"`` fields name for the transfer plan.

Torch-free: each call imports what it uses when called.
"""

from __future__ import annotations

from rlplacement.specs.backend import GRADIENT_CHECKPOINTING, LAYERS, BackendSpec, register_backend

_HERE = __name__


def megatron_holdings(model, *, world: int, tp: int, pp: int, ep: int):
    """Megatron's TP x PP x DP boxes (under EP each rank its experts)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.megatron_holdings(model, tp, pp, _dp(world, tp, pp), ep)


def megatron_piece_holdings(model, *, world: int, tp: int, pp: int, ep: int):
    """Megatron's pieces: each rank its rows of its TP boxes, split over the data-parallel replicas."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.megatron_piece_holdings(model, tp, pp, _dp(world, tp, pp), ep)


def megatron_share_holdings(model, *, world: int, tp: int, pp: int, ep: int):
    """The whole tensors each Megatron rank sends as its share (gathered from its TP peers)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.megatron_share_holdings(model, tp, pp, _dp(world, tp, pp), ep)


def _dp(world: int, tp: int, pp: int) -> int:
    if world % (tp * pp):
        raise ValueError(f"the trainer's {world} GPUs are not a multiple of --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}")
    return world // (tp * pp)


def fsdp2_holdings(model, *, world: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """FSDP2's dim-0 shards over every rank (fsdp and torchtitan)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.fsdp_holdings(model, world)


def fsdp2_share_holdings(model, *, world: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """The whole tensors each FSDP2 rank sends as its share (gathered from every rank's shard)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.share_holdings(model, world)


MEGATRON = register_backend(BackendSpec(
    name="megatron", backend="rlplacement.backends.megatron:MegatronBackend",
    summary="megatron-core: tensor, pipeline and expert parallelism, its distributed optimizer",
    model_parallel=True, sequence_parallel=True, expert_parallel=True, distributed_optimizer=True,
    fp32_switches=True, recompute=LAYERS, trains_moe=True, moe_layer_flags=True,
    lora=True, lora_check="rlplacement.backends.megatron_lora:check_supported",
    sends_pieces=True, holdings=f"{_HERE}:megatron_holdings", piece_holdings=f"{_HERE}:megatron_piece_holdings",
    share_holdings=f"{_HERE}:megatron_share_holdings", memory="rlplacement.advisor.memory:megatron_rank_memory",
    load_config="rlplacement.backends.megatron_preflight:check_load",
    load_hint=" or --load (a folder from `rlplacement convert`)",
    preflight="rlplacement.backends.megatron_preflight:preflight"))

FSDP = register_backend(BackendSpec(
    name="fsdp", backend="rlplacement.backends.fsdp:FSDPBackend",
    summary="the HF model under torch's FSDP2, every parameter sharded over every rank",
    recompute=GRADIENT_CHECKPOINTING, trains_moe=True, lora=True,
    sends_pieces=True, holdings=f"{_HERE}:fsdp2_holdings", share_holdings=f"{_HERE}:fsdp2_share_holdings",
    memory="rlplacement.advisor.memory:fsdp_rank_memory"))

TORCHTITAN = register_backend(BackendSpec(
    name="torchtitan", backend="rlplacement.backends.torchtitan:TorchtitanBackend",
    summary="torchtitan's model definitions under FSDP2 (CUDA only)",
    recompute=GRADIENT_CHECKPOINTING,
    sends_pieces=True, holdings=f"{_HERE}:fsdp2_holdings", share_holdings=f"{_HERE}:fsdp2_share_holdings",
    memory="rlplacement.advisor.memory:fsdp_rank_memory", preflight="rlplacement.backends.torchtitan_preflight:preflight"))
