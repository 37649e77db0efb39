"""Who sends which bytes to whom in a weight update: a :class:`TransferPlan` built once per layout from
the trainer's sharding and the slices each engine worker's loader takes, checked for coverage, and the
simulator that predicts an update's time from it.

Torch-free and pure: shapes in, routes out, so ``rlplacement plan --simulate-transfer`` and the tests
build plans for 1,024 GPUs without a cluster. The senders run the spread plan in split layouts of the
modes that spread (every rank sends its share, :mod:`~rlplacement.transfer.plan.senders`, and every worker
receives whole tensors) and the rank-0 plan elsewhere; the sharded plan, where each worker receives only its
slice, is what receivers move to next; the simulator prices all three.
"""

from rlplacement.transfer.plan.build import PlanCoverageError, Route, TransferPlan, build_plan  # noqa: F401
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: F401
