"""rlplacement's vLLM worker extension plus the tests' faults and probes, reached by method name on every
worker (``engine.call_workers.remote("hook_...", *args)``) as the engine reaches its own: nothing is
pickled into vLLM's engine core. Engines start with it through
``create_engine_actor(..., worker_extension_cls=HOOKED_WORKER_EXTENSION)``."""

import os

from rlplacement.engines.vllm.vllm_worker import RlplacementWorkerExtension
from tests.transfer_helpers import faults, ipc_probes

HOOKED_WORKER_EXTENSION = f"{__name__}.HookedWorkerExtension"


class HookedWorkerExtension(RlplacementWorkerExtension):
    """Each ``hook_*`` is the function of the same name in ``faults`` or ``ipc_probes``, on ``self`` = the
    worker; ``hook_pid`` and ``hook_environ`` say which process a worker runs in and what it was given."""

    hook_fail_receive_after_buckets = faults.fail_receive_after_buckets
    hook_flip_first_byte_of_next_update = faults.flip_first_byte_of_next_update
    hook_stall_next_receive = faults.stall_next_receive
    hook_cpu_standin_discard_weights = faults.cpu_standin_discard_weights
    hook_fail_next_load_part_way = faults.fail_next_load_part_way
    hook_fail_next_staging_on_rank = faults.fail_next_staging_on_rank
    hook_fail_next_load_on_rank = faults.fail_next_load_on_rank
    hook_fail_bucketwise_load_after_buckets = faults.fail_bucketwise_load_after_buckets
    hook_keep_another_workers_slices = faults.keep_another_workers_slices
    hook_keep_own_slices = faults.keep_own_slices
    hook_keep_whole_tensors = faults.keep_whole_tensors
    hook_receiver_stats = ipc_probes.receiver_stats

    def hook_pid(self) -> int:
        return os.getpid()

    def hook_environ(self, name: str) -> str | None:
        return os.environ.get(name)
