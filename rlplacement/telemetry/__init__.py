"""Step telemetry: phase timers per role, wait times derived from intervals, one JSONL row per step.

Pure Python (NVML through ``nvidia-ml-py`` only where importable and a GPU exists). The row
names follow DESIGN.md "contract: telemetry"; see :mod:`.recorder` for the invariants.
"""

from rlplacement.telemetry.intervals import Interval, idle_time, phase_time, union_length
from rlplacement.telemetry.jsonl import append_row, read_rows
from rlplacement.telemetry.recorder import RunLayout, StepRecorder, quantile

__all__ = ["Interval", "RunLayout", "StepRecorder", "append_row", "idle_time", "phase_time", "quantile",
           "read_rows", "union_length"]
