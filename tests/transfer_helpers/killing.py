"""The fault matrix's "engine killed mid-update", shared by the per-mode tests."""

import concurrent.futures as cf
import time

import pytest


def kill_engine_mid_update(trainer, engines, version: int, victim: int, *, seed: int, timeout_s: float = 12.0,
                           check_equal: bool = False) -> None:
    """Slow the trainer's stream (25 tensors -> ~2.5 s), start update ``version`` to ``engines``, kill
    ``engines[victim]`` after 1 s, and check the driver names it within the timeout."""
    import ray

    from rlplacement.runtime import waits
    from rlplacement.runtime import transfer_driver as driver
    from rlplacement.transfer.base import WeightUpdateError

    ray.get(trainer.perturb.remote(seed))
    ray.get(trainer.set_slow.remote(0.1))
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            future = pool.submit(driver.run_update, trainer, engines, version, timeout_s=timeout_s,
                                 check_equal=check_equal)
            time.sleep(1.0)
            ray.kill(engines[victim])
            with pytest.raises(WeightUpdateError, match=rf"engine {victim}: actor died"):
                future.result(timeout=60)
            assert time.monotonic() - start < timeout_s + waits.FAILURE_GRACE_S + 5
    finally:
        ray.get(trainer.set_slow.remote(0.0))
