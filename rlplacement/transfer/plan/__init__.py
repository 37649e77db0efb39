"""Who sends which bytes to whom in a weight update: a :class:`TransferPlan` built once per layout from
the trainer's sharding and the slices each engine worker's loader takes, checked for coverage, and the
simulator that predicts an update's time from it.

Torch-free and pure: shapes in, routes out, so ``rlplacement plan --simulate-transfer`` and the tests
build plans for 1,024 GPUs without a cluster. The senders today still run the rank-0 plan
(:func:`~rlplacement.transfer.plan.trainer_shards.rank0_holdings` with whole tensors to every worker);
the sharded plan is what they are being moved to, and the simulator prices both.
"""

from rlplacement.transfer.plan.build import PlanCoverageError, Route, TransferPlan, build_plan  # noqa: F401
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: F401
