"""Who sends which bytes to whom in a weight update: a :class:`TransferPlan` built once per layout from
the trainer's sharding and the slices each engine worker's loader takes, checked for coverage, and the
simulator that predicts an update's time from it.

Torch-free and pure: shapes in, routes out, so ``rlplacement plan --simulate-transfer`` and the tests
build plans for 1,024 GPUs without a cluster. The senders run the spread plan in split layouts of the
modes that spread: an FSDP rank sends its own rows of every tensor (the sharded plan's trainer side,
``transfer.pieces``), a Megatron or torchtitan rank its share of whole tensors
(:mod:`~rlplacement.transfer.plan.senders`); every worker receives its slices. Elsewhere the rank-0 plan
runs; the simulator prices all three.
"""

from rlplacement.transfer.plan.build import PlanCoverageError, Route, TransferPlan, build_plan  # noqa: F401
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: F401
