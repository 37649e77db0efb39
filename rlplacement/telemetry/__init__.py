"""Step telemetry: phase timers per role, wait times derived from intervals, one JSONL row per step.

Pure Python (NVML through ``nvidia-ml-py`` only where importable and a GPU exists). The row
names follow the telemetry contract in docs/telemetry.md; see :mod:`.recorder` for the invariants. Beyond the
contract each row carries ``rollout/logprob_abs_diff_max`` (``rollout/logprob_abs_diff`` is the
mean), ``num_gpus_per_node``, ``transfer_mode``, ``max_response_len``, ``group_size`` (what the
advisor models with), the placement flags that refuse layouts (``one_step_off``, ``offload_*``),
``perf/update_weights_bytes`` and ``transfer_transport`` when the loop passes the update's
``metrics`` to ``end_step``, and
``timeline``: ``{"t0", "step_start", "step_end", "intervals": [[role, phase, start, end], ...]}``
in seconds after ``t0`` (the run's first timestamp), which the advisor's Gantt plot draws.

Rows also go to experiment trackers (W&B, TensorBoard: :mod:`.trackers`) given to ``StepRecorder(trackers=...)``.
"""

from rlplacement.telemetry.intervals import Interval, idle_time, phase_time, union_length
from rlplacement.telemetry.jsonl import append_row, read_rows
from rlplacement.telemetry.recorder import RunLayout, StepRecorder, quantile
from rlplacement.telemetry.trackers import Tracker, Trackers, build_trackers

__all__ = ["Interval", "RunLayout", "StepRecorder", "Tracker", "Trackers", "append_row", "build_trackers", "idle_time",
           "phase_time", "quantile", "read_rows", "union_length"]
