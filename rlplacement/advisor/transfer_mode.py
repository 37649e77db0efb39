"""Which weight-transfer mode the measured run should use, and what it would save per step.

Each candidate's sync time = the run's fixed cost (its measured sync minus its own wire time,
as the step-time model splits it) + the bytes that mode puts on its path / that path's achieved
bandwidth (``ModelAssumptions``: ``--link-gbps`` for a cluster's links, NVLink inside a node,
``--disk-gbps`` for a mode on the disk path, each mode's ``ModeSpec.advisor_efficiency``). A mode
that moves only the changed bytes (disk-delta) is scaled by the run's measured
``perf/update_weights_density`` when it ran that mode, else ``--delta-density`` (an estimate). A colocated run has one path (CUDA IPC): nothing to choose.
Paths follow the transport the run recorded (``transfer_transport``): the measured mode keeps it, the
others use what they would on the same device; a mode on a path without an assumed rate (gloo or
shared memory on CPU tensors) is not predicted, and a run whose own path has none keeps its mode.
The measured mode keeps its measured sync time; the recommendation is the fastest candidate when
it saves at least ``min_gain`` of the measured sync (``--min-gain``), else the current mode.
"""

from __future__ import annotations

import dataclasses

from rlplacement.advisor.measure import Measurement
from rlplacement.advisor.model import DEVICE_OF_TRANSPORT, expected_transport, transfer_path
from rlplacement.advisor.thresholds import ModelAssumptions
from rlplacement.transfer import registry



@dataclasses.dataclass(frozen=True)
class ModeAdvice:
    recommended: str
    saving_s: float                    # per step, against the measured sync time
    predicted_sync_s: dict[str, float]  # per candidate mode
    why_kept: str = ""  # when no mode could be compared: why


def advise_transfer_mode(m: Measurement, a: ModelAssumptions = ModelAssumptions(), min_gain: float = 0.05) -> ModeAdvice:
    split_modes = registry.selectable_modes()
    current = registry.colocated_mode() if m.placement.colocate else (m.transfer_mode or a.transfer_mode)
    if m.placement.colocate or not m.sync_bytes or current not in split_modes:
        return ModeAdvice(current, 0.0, {current: m.sync_time})
    changed_only = {mode for mode in split_modes if registry.spec(mode).moves_changed_bytes_only}
    density = m.sync_density if (current in changed_only and m.sync_density) else a.delta_density
    device = DEVICE_OF_TRANSPORT.get(m.transport or "")
    rates = {mode: transfer_path(m.placement, mode, m.num_gpus_per_node, a,
                                 m.transport if mode == current else expected_transport(mode, False, device))
             for mode in split_modes}
    if rates[current][1] is None:
        return ModeAdvice(current, 0.0, {current: m.sync_time},
                          f"no rate is assumed for {rates[current][0].split('/')[0]}, so no mode can be compared")

    def wire(mode: str) -> float:
        nbytes = m.sync_bytes * (density if mode in changed_only else 1.0)
        return nbytes * 8 / (rates[mode][1] * 1e9)

    fixed = max(0.0, m.sync_time - wire(current))
    predicted = {mode: (m.sync_time if mode == current else fixed + wire(mode)) for mode in split_modes
                 if rates[mode][1] is not None}
    best = min(predicted, key=lambda mode: (predicted[mode], mode != current))
    if m.sync_time - predicted[best] < min_gain * m.sync_time:
        best = current
    return ModeAdvice(best, max(0.0, m.sync_time - predicted[best]), predicted)
