"""``advise`` recommends a transfer mode from the measured sync time and bytes (rlplacement.advisor.transfer_mode)."""

import dataclasses

import pytest

from rlplacement.advisor.measure import Measurement, Placement
from rlplacement.advisor.thresholds import ModelAssumptions
from rlplacement.advisor.transfer_mode import advise_transfer_mode


def _measured(mode="broadcast", sync_time=2.0, sync_bytes=16e9, density=None, colocate=False, gpus=(4, 4)):
    return Measurement(placement=Placement(colocate, *gpus), gpus_per_engine=1, num_gpus_per_node=8,
                       transfer_mode=mode, steps=3, step_time=10.0, rollout_time=6.0, sync_time=sync_time,
                       train_time=2.0, train_wait=0.0, rollout_wait=0.0, rollout_tail=0.0, rollout_scalable=6.0,
                       rollout_fit="quantile", finish_p50=1.0, finish_p99=2.0, tail_share=0.0,
                       samples_per_step=8, max_response_len=64, group_size=4, sync_bytes=sync_bytes,
                       sync_density=density, overlapped=False, response_lengths=(8,) * 8)


def test_a_wire_bound_broadcast_run_is_told_the_packed_saving():
    # 16 GB over NVLink at broadcast's 0.2 share: ~0.18 s of wire; packed (0.5) cuts that to ~0.07 s
    advice = advise_transfer_mode(_measured(sync_time=0.25))
    assert advice.recommended in ("broadcast_packed", "p2p")
    assert advice.saving_s == pytest.approx(0.25 - advice.predicted_sync_s[advice.recommended])
    assert advice.predicted_sync_s["broadcast"] == 0.25 and advice.saving_s > 0.1


def test_a_slow_cross_node_link_with_a_small_measured_delta_prefers_disk_delta():
    m = _measured(mode="disk-delta", sync_time=1.0, density=0.01, gpus=(8, 8))  # 16 GPUs: trainer and engines on other nodes
    slow = dataclasses.replace(ModelAssumptions(), link_gbps=10.0)
    advice = advise_transfer_mode(m, slow)
    assert advice.recommended == "disk-delta" and advice.saving_s == 0.0  # measured already, nothing better


def test_no_change_is_recommended_for_a_negligible_saving_or_a_colocated_run():
    small = advise_transfer_mode(_measured(sync_time=0.04, sync_bytes=1e6))  # fixed cost dominates: all equal
    assert small.recommended == "broadcast" and small.saving_s == 0.0
    colocated = advise_transfer_mode(_measured(mode="broadcast", colocate=True, gpus=(8, 8)))
    assert colocated.recommended == "cuda_ipc" and colocated.saving_s == 0.0
