"""Experiment trackers: every step's telemetry row to a Weights & Biases run and a TensorBoard event file.

A tracker has two methods: ``log(step, row)`` and ``close()``. :func:`build_trackers` makes the ones a
:class:`~rlplacement.config.TrackingConfig` asks for (``--use-wandb``, ``--use-tensorboard``) as one
:class:`Trackers`, itself a tracker and a context manager; give it to ``StepRecorder(..., trackers=...)``
and every row ``end_step`` returns is logged, or call ``trackers.log(step, row)`` from any loop.

What is logged from a row (:func:`scalars`), each under its own key, at the row's step:

* a number (``perf/step_time``, ``reward``, ``trainer_gpus`` ...) as it is; a bool (``colocate``) as 0 or 1;
* a list of numbers (``rollout/response_lengths``, ``rollout/sample_finish_times``) as three summaries,
  ``<key>/mean``, ``<key>/min`` and ``<key>/max`` (a nested list or an array counts every number in it);
* skipped: ``step`` (it is the step axis), None (not measured this step), strings (``transfer_mode``,
  ``transfer_transport``), an empty list or one holding anything but numbers, and dicts (``timeline``).

wandb, tensorboardX and tensorboard are imported where a tracker is made, never by importing this module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import sys
from typing import Any, Iterable, Iterator, Mapping, Protocol, runtime_checkable

from rlplacement.config import TrackingConfig
from rlplacement.errors import ConfigError

INSTALL_HINT = "pip install 'rlplacement[trackers]'"
# the event-file writers, in the order one is picked: tensorboardX (the [trackers] extra), else torch's,
# which needs the `tensorboard` package (torch.utils.tensorboard fails to import without it)
TENSORBOARD_WRITERS = {"tensorboardX": "tensorboardX", "torch": "tensorboard"}
SUMMARIES = ("mean", "min", "max")


@runtime_checkable
class Tracker(Protocol):
    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """Record the scalars of ``row`` (a telemetry row, or any dict of metrics) at ``step``."""

    def close(self) -> None:
        """Write out what is pending and release the run; nothing is logged after."""


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (wandb takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec
        return sys.modules.get(module) is not None


def wandb_installed() -> bool:
    return _installed("wandb")


def tensorboard_writer_available() -> str | None:
    """The event-file writer :class:`TensorBoardTracker` would use (``tensorboardX`` or ``torch``), or None."""
    return next((name for name, module in TENSORBOARD_WRITERS.items() if _installed(module)), None)


def _numbers(value: Any) -> list[float] | None:
    """Every number of a (nested) list, tuple or array, or None when it holds anything else."""
    if hasattr(value, "tolist") and not isinstance(value, numbers.Number):
        value = value.tolist()
    if isinstance(value, numbers.Real):  # bools included, as 0/1
        return [float(value)]
    if isinstance(value, (list, tuple)):
        out: list[float] = []
        for item in value:
            inner = _numbers(item)
            if inner is None:
                return None
            out.extend(inner)
        return out
    return None


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The values of ``row`` a tracker logs, by key (the rules are in this module's docstring)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or value is None or isinstance(value, (str, bytes, Mapping)):
            continue
        if isinstance(value, numbers.Real) or (hasattr(value, "tolist") and getattr(value, "ndim", 1) == 0):
            out[key] = float(value)
            continue
        values = _numbers(value)
        if values:  # a list of numbers; an empty one has nothing to summarise
            out[f"{key}/mean"] = math.fsum(values) / len(values)
            out[f"{key}/min"] = min(values)
            out[f"{key}/max"] = max(values)
    return out


def _plain(value: Any) -> Any:
    """A run configuration wandb can store: dataclasses as dicts, anything unusual as its text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class WandbTracker:
    """One Weights & Biases run; each ``log`` is one history row at ``step`` (steps must increase).

    ``--wandb-mode`` is given to ``wandb.setup`` as well as ``wandb.init``: wandb's own usage telemetry is
    configured from the process-wide setup, not from ``init``'s mode, so without it an offline run still
    tried to reach W&B's server from a background thread (wandb 0.31.0). Offline and disabled runs make no
    network connection and never log in; tests/test_trackers.py checks the offline run.
    """

    def __init__(self, config: TrackingConfig, run_config: Any = None):
        import wandb

        if config.wandb_mode is not None:
            wandb.setup(settings=wandb.Settings(mode=config.wandb_mode))
        if config.wandb_dir is not None:
            os.makedirs(config.wandb_dir, exist_ok=True)  # wandb falls back to a temporary folder otherwise
        self.run = wandb.init(project=config.wandb_project, group=config.wandb_group, dir=config.wandb_dir,
                              mode=config.wandb_mode, config=_plain(run_config) if run_config is not None else None)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self.run.log(scalars(row), step=int(step))

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """A TensorBoard event file in ``log_dir``, one scalar per key per step, flushed after every step.

    ``writer``: ``tensorboardX`` (its ``SummaryWriter``) or ``torch`` (``torch.utils.tensorboard``, which needs
    the ``tensorboard`` package); None: the first of the two that is installed.
    """

    def __init__(self, log_dir: str | os.PathLike, writer: str | None = None):
        writer = writer or tensorboard_writer_available()
        if writer is None:
            raise ConfigError(f"--use-tensorboard needs a TensorBoard writer and neither tensorboardX nor tensorboard "
                              f"is installed: {INSTALL_HINT} (tensorboardX), or drop --use-tensorboard.")
        if writer not in TENSORBOARD_WRITERS:
            raise ValueError(f"writer {writer!r} is unknown: use one of {', '.join(TENSORBOARD_WRITERS)}")
        if writer == "tensorboardX":
            from tensorboardX import SummaryWriter
        else:
            from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer_name = writer
        self.writer = SummaryWriter(self.log_dir)
        # said once, as W&B names its run folder: the default folder is relative to where the run started
        print(f"rlplacement: TensorBoard events go to {os.path.abspath(self.log_dir)}", file=sys.stderr, flush=True)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, int(step))
        self.writer.flush()  # a step is seconds to minutes: TensorBoard shows it as soon as it ends

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The trackers of a run as one: ``log`` goes to each, ``close`` closes each (also on leaving a ``with``)."""

    def __init__(self, trackers: Iterable[Tracker] = ()):
        self._trackers = list(trackers)

    def __iter__(self) -> Iterator[Tracker]:
        return iter(self._trackers)

    def __len__(self) -> int:
        return len(self._trackers)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for tracker in self._trackers:
            tracker.log(step, row)

    def close(self) -> None:
        trackers, self._trackers = self._trackers, []
        errors = []
        for tracker in trackers:  # each gets closed though another fails
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_trackers(config: TrackingConfig, run_config: Any = None) -> Trackers:
    """The trackers ``config`` asks for (none: an empty :class:`Trackers`, whose ``log`` does nothing).

    ``run_config`` (a dict or a dataclass such as the whole :class:`~rlplacement.config.Config`) is stored
    as the W&B run's configuration."""
    made: list[Tracker] = []
    try:
        if config.use_wandb:
            if not wandb_installed():
                raise ConfigError(f"--use-wandb needs the wandb package, which is not installed: {INSTALL_HINT}, "
                                  f"or drop --use-wandb.")
            made.append(WandbTracker(config, run_config))
        if config.use_tensorboard:
            assert config.tb_log_dir is not None  # TrackingConfig refuses use_tensorboard without it
            made.append(TensorBoardTracker(config.tb_log_dir))
    except BaseException:
        Trackers(made).close()
        raise
    return Trackers(made)

