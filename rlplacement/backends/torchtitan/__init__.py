"""The torchtitan trainer backend (``--train-backend torchtitan``): :class:`.backend.TorchtitanBackend`.

Importing this package imports nothing heavy: the backend registry names
``rlplacement.backends.torchtitan.backend:TorchtitanBackend`` and imports it (torch, and torchtitan
where it runs) only when chosen.

Importing it registers the backend's spec (:data:`TORCHTITAN`): FSDP2's holdings (:mod:`rlplacement.backends.fsdp`)
and its torch-free :mod:`.preflight`.
"""

from __future__ import annotations

from rlplacement.specs.backend import GRADIENT_CHECKPOINTING, BackendSpec, register_backend


TORCHTITAN = register_backend(BackendSpec(
    name="torchtitan", backend="rlplacement.backends.torchtitan.backend:TorchtitanBackend",
    summary="torchtitan's model definitions under FSDP2 (CUDA only)",
    recompute=GRADIENT_CHECKPOINTING,
    sends_pieces=True, holdings="rlplacement.backends.fsdp:fsdp2_holdings",
    share_holdings="rlplacement.backends.fsdp:fsdp2_share_holdings", memory="rlplacement.advisor.memory:fsdp_rank_memory",
    preflight="rlplacement.backends.torchtitan.preflight:preflight"))
