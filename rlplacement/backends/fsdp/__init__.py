"""The FSDP2 trainer backend (``--train-backend fsdp``): :class:`.backend.FSDPBackend`.

Importing this package imports nothing heavy: the backend registry names
``rlplacement.backends.fsdp.backend:FSDPBackend`` and imports it (and torch) only when chosen.

Importing it registers the backend's spec (:data:`FSDP`) and FSDP2's holdings for the transfer plan, which
torchtitan's spec names too (its model runs under FSDP2).
"""

from __future__ import annotations

from rlplacement.specs.backend import GRADIENT_CHECKPOINTING, BackendSpec, register_backend

_HERE = __name__


def fsdp2_holdings(model, *, world: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """FSDP2's dim-0 shards over every rank (fsdp and torchtitan)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.fsdp_holdings(model, world)


def fsdp2_share_holdings(model, *, world: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """The whole tensors each FSDP2 rank sends as its share (gathered from every rank's shard)."""
    from rlplacement.transfer.plan import trainer_shards

    return trainer_shards.share_holdings(model, world)


FSDP = register_backend(BackendSpec(
    name="fsdp", backend="rlplacement.backends.fsdp.backend:FSDPBackend",
    summary="the HF model under torch's FSDP2, every parameter sharded over every rank",
    recompute=GRADIENT_CHECKPOINTING, trains_moe=True, lora=True, trains_during_rollout=True,
    sends_pieces=True, holdings=f"{_HERE}:fsdp2_holdings", share_holdings=f"{_HERE}:fsdp2_share_holdings",
    memory="rlplacement.advisor.memory:fsdp_rank_memory"))
