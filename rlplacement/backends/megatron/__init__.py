"""The megatron-core trainer backend (``--train-backend megatron``): :class:`.backend.MegatronBackend`.

Importing this package imports nothing heavy (no torch, no megatron-core): the backend registry names
``rlplacement.backends.megatron.backend:MegatronBackend`` and imports it only when chosen, and the
torch-free checkpoint layout (:mod:`.checkpoint_layout`) is read by preflight before any trainer starts.

Importing it registers the backend's spec (:data:`MEGATRON`), whose ``"module:function"`` fields
name this package's holdings for the transfer plan and its torch-free :mod:`.preflight`.
"""

from __future__ import annotations

from rlplacement.specs.backend import LAYERS, BackendSpec, register_backend

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


MEGATRON = register_backend(BackendSpec(
    name="megatron", backend="rlplacement.backends.megatron.backend:MegatronBackend",
    summary="megatron-core: tensor, pipeline and expert parallelism, its distributed optimizer",
    model_parallel=True, sequence_parallel=True, expert_parallel=True, distributed_optimizer=True,
    fp32_switches=True, recompute=LAYERS, trains_moe=True, moe_layer_flags=True,
    lora=True, trains_during_rollout=True, lora_check="rlplacement.backends.megatron.lora:check_supported",
    sends_pieces=True, holdings=f"{_HERE}:megatron_holdings", piece_holdings=f"{_HERE}:megatron_piece_holdings",
    share_holdings=f"{_HERE}:megatron_share_holdings", memory="rlplacement.advisor.memory:megatron_rank_memory",
    load_config="rlplacement.backends.megatron.preflight:check_load",
    load_hint=" or --load (a folder from `rlplacement convert`)",
    preflight="rlplacement.backends.megatron.preflight:preflight"))
