"""The running job and every way a loop drives it.

:class:`RLJob` (``lifecycle``) is the facade a loop calls: start, generate, train, update weights, close.
Around it, each rollout mode a loop can run (sync ``rollout``, ``one_step_off``, ``fully_async``) and the
repairs of ``--use-fault-tolerance`` (``fault_tolerance``): each is built by the job (``RLJob.one_step_off``,
``RLJob.fully_async``, ``RLJob.ft``) and drives it, so they live with it, one package, imports pointing from
the modes to the job's parts and never back at module level.
"""

from rlplacement.job.lifecycle import DEFAULT_TIMEOUT_S, RLJob
from rlplacement.job.rollout import PendingRollout, RolloutSample

__all__ = ["DEFAULT_TIMEOUT_S", "PendingRollout", "RLJob", "RolloutSample"]
