"""GPU utilization sampled inside one phase, through NVML (``nvidia-ml-py``).

A run-wide average hides starvation (a trainer at 100% for a third of the step and 0% otherwise
averages to a healthy-looking number), so utilization is sampled only while a phase runs and
reported per role. Where ``pynvml`` is not importable or no GPU/driver is present, every reading
is ``None`` ("absent"), never 0: a CPU run must not look like an idle GPU.
"""

from __future__ import annotations

import threading
from typing import Sequence

_nvml_state: dict[str, object] = {}


def _nvml():
    """The initialised ``pynvml`` module, or ``None`` where NVML cannot run. Initialised once."""
    if "module" not in _nvml_state:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_state["module"] = pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
        except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            _nvml_state["module"] = None
    return _nvml_state["module"]


def nvml_available() -> bool:
    return _nvml() is not None


class PhaseUtilSampler:
    """Polls the utilization of ``devices`` every ``period_s`` between ``start()`` and ``stop()``.

    ``stop()`` returns the mean utilization in percent over all samples and devices, or ``None``
    when NVML is absent, no devices were given, or the phase ended before the first sample.
    """

    def __init__(self, devices: Sequence[int] | None, period_s: float = 0.05):
        self._devices = list(devices or [])
        self._period = period_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PhaseUtilSampler":
        nvml = _nvml()
        if nvml is None or not self._devices:
            return self
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self._devices]

        def poll() -> None:
            while True:
                for h in handles:
                    self._samples.append(float(nvml.nvmlDeviceGetUtilizationRates(h).gpu))
                if self._stop.wait(self._period):
                    return

        self._thread = threading.Thread(target=poll, name="rlplacement-gpu-util", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return sum(self._samples) / len(self._samples) if self._samples else None
