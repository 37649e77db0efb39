"""A step-time model fitted from one measured run; predicts any layout of the same job.

Phases, each fitted from the run's medians (``m`` = :class:`Measurement`, ``N_r``/``N_t`` =
rollout/trainer GPUs, ``l`` = max-response-length ratio, ``g`` = group-size ratio):

* rollout = scalable * (N_r0 / N_r) * g * l^e  +  fixed * l * H(n') / H(n)
  ``scalable`` is the throughput-bound part, which divides over engines: fitted per step from
  the samples' (length, finish time) pairs as ``c * tokens`` in ``finish_i = a * L_i + c * C_i``
  (a decode step costs a fixed weight read plus a part per running sequence; ``C_i`` is the
  tokens the batch decoded until sample i finished); without finish times, the time until
  ``bulk_quantile`` of the samples finished. ``fixed`` (the rest: per-step latency, the tail,
  dispatch) does not divide. Decode cost per token grows with context, hence
  ``e = rollout_length_exponent`` > 1. The fixed part follows the longest sample, whose
  expected length grows ~H(n) (harmonic number) with n samples for an exponential tail, and it
  runs once per decode *wave*: waves = ceil(sequences per engine / concurrency), concurrency =
  min(max_num_seqs, kv_cache_tokens // (prompt + response cap)) from the engine's own cache at
  start; the fixed part scales by waves(layout) / waves(measured) (1 when the run did not record
  its capacity).
* train = train0 * (N_t0 / N_t) * g * l: data parallel over the trainer's GPUs, linear in tokens.
* sync = fixed + bytes / bandwidth(path, mode): the path follows the transport that ran
  (``transfer_transport``; :func:`transfer_path`): NCCL is NVLink when a split fits one node and the
  ``--link-gbps`` network otherwise, CUDA IPC when colocated, the disk for disk-delta; ``fixed``
  (pause, resume, RPC) is what the measured sync had beyond its own wire time. Without the byte
  count, sync scales by the bandwidth ratio of the two paths. A path without an assumed rate (gloo
  or shared memory on CPU tensors) keeps the measured sync: there is nothing to scale it by.
* handoff (colocated only: engines sleep, trainer state to host memory and back) = for a colocated
  run, its own fixed part (what the hand-off cost beyond moving bytes) + its measured bytes per GPU x
  N_t0 / N_t (each GPU moves its own shard) at the rate the run moved them (``perf/handoff_bytes_*``
  over the moves' seconds); a run without byte counts scales its whole hand-off by N_t0 / N_t. For a
  split run, ``handoff_bytes_ratio`` x weight bytes / N_t over ``host_gbps``. A split layout has none.
* step = rollout + sync + train (+ handoff colocated; a split run synchronously); max(rollout, train)
  + sync for a split run one-step-off (the run's own loop shape; a colocated run's splits are
  assumed one-step-off, the reason to split at all).
* other = what the measured step had beyond the modelled one, either sign, kept constant: positive is
  driver time the phases miss (reward, logging), negative is overlap the composition does not see.
  A predicted step is never shorter than its longest phase.

So the current layout is reproduced by construction (its prediction is the measured step); the
model's claims are the *changes*, and the advisor states them against the measured step.

What-if directions that follow (the seed's two claims): a longer response cap grows rollout
faster than training (``e`` > 1, the latency-bound part follows the longest sample, and longer
sequences fit fewer at once in the KV cache), so GPUs shift to rollout. A larger group grows
throughput-bound rollout and training alike (both linear in samples) and the tail only ~log n,
so while every engine's KV cache holds all its sequences it does *not* shift GPUs to rollout;
once the sequences in flight exceed what the cache holds, decoding runs in more waves, each
another pass of the latency-bound part, and more rollout GPUs (more engines, fewer sequences
each) pay: then the group does shift GPUs to rollout.
"""

from __future__ import annotations

import dataclasses
import math

from rlplacement.advisor.measure import Measurement, Placement
from rlplacement.advisor.thresholds import ModelAssumptions
from rlplacement.transfer import registry
from rlplacement.transfer.spec import DISK, IPC


@dataclasses.dataclass(frozen=True)
class Workload:
    """What-if changes to the job; ``None`` keeps the measured value."""

    max_response_len: float | None = None
    group_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Prediction:
    placement: Placement
    rollout_time: float
    train_time: float
    sync_time: float
    step_time: float
    sync_path: str
    handoff_time: float = 0.0

    def to_json(self) -> dict:
        return {**self.placement.to_json(), "predicted_step_time": self.step_time,
                "rollout_time": self.rollout_time, "train_time": self.train_time,
                "sync_time": self.sync_time, "sync_path": self.sync_path, "handoff_time": self.handoff_time}


DEVICE_OF_TRANSPORT = {"nccl": "cuda", "cuda ipc": "cuda", "gloo": "cpu", "shared memory": "cpu"}
"""The tensors' device a recorded ``transfer_transport`` implies (other transports serve both)."""


def expected_transport(mode: str, colocate: bool, device: str | None) -> str | None:
    """What would carry ``mode``'s bytes on ``device``'s tensors (the transport names of the modes'
    ``BenchSpec.transport``, which the senders report); None when the device is not known."""
    spec = registry.spec(registry.colocated_mode() if colocate else mode)
    if spec.advisor_path == DISK:
        return "file"
    if device is None or spec.bench is None:
        return None
    return spec.bench.transport[device]


def transfer_path(p: Placement, mode: str, num_gpus_per_node: int, a: ModelAssumptions,
                  transport: str | None = None) -> tuple[str, float | None]:
    """(path name, achieved Gb/s) of ``mode`` in layout ``p``, the name as ``link/mode``.

    The link follows the transport that carries the bytes: ``nccl`` is NVLink when the layout fits one
    node and the network across nodes, ``file`` the disk, ``cuda ipc`` a handle on the same GPU,
    ``mooncake rdma`` the network; any other transport (``gloo``, ``shared memory``, ``mooncake tcp``:
    host memory and TCP) is named as it is and has no assumed rate (None: the measured sync stands).
    ``transport`` None (not recorded) assumes GPUs: CUDA IPC colocated, the disk for a mode whose spec
    says so, NCCL otherwise. Rates are scaled by the mode's ``advisor_efficiency`` (its spec's estimate).
    """
    if p.colocate:
        mode = registry.colocated_mode()
    spec = registry.spec(mode)
    if transport is None:
        transport = ("cuda ipc" if p.colocate or spec.advisor_path == IPC else
                     "file" if spec.advisor_path == DISK else "nccl")
    one_node = p.total_gpus <= num_gpus_per_node
    name = {"nccl": "nvlink" if one_node else "network", "file": "disk"}.get(transport, transport)
    gbps = {"nvlink": a.nvlink_gbps, "network": a.link_gbps, "cuda ipc": a.ipc_gbps, "disk": a.disk_gbps,
            "mooncake rdma": a.link_gbps}.get(name)
    return f"{name}/{mode}", (gbps * spec.advisor_efficiency if gbps is not None else None)


def _harmonic(n: float) -> float:
    return math.log(n) + 0.5772156649 + 1 / (2 * n) if n >= 1 else 1.0


@dataclasses.dataclass(frozen=True)
class StepModel:
    m: Measurement
    assumptions: ModelAssumptions
    other_time: float

    # ---- sync ------------------------------------------------------------------------------
    def _mode(self, p: Placement) -> str:
        if p.colocate:
            return registry.colocated_mode()
        if not self.m.placement.colocate and self.m.transfer_mode in registry.selectable_modes():
            return self.m.transfer_mode
        return self.assumptions.transfer_mode

    def _path(self, p: Placement) -> tuple[str, float | None]:
        """(path name, achieved Gb/s or None) that weights take to reach the engines in ``p``: the run's
        recorded transport for its own mode and kind of layout, else what that mode uses on the device
        the recorded transport implies."""
        m, mode = self.m, self._mode(p)
        if p.colocate == m.placement.colocate and mode == self._mode(m.placement):
            transport = m.transport
        else:
            transport = expected_transport(mode, p.colocate, DEVICE_OF_TRANSPORT.get(m.transport or ""))
        return transfer_path(p, mode, m.num_gpus_per_node, self.assumptions, transport)

    def sync_time(self, p: Placement) -> tuple[float, str]:
        path0, gbps0 = self._path(self.m.placement)
        path, gbps = self._path(p)
        if path == path0 or gbps is None or gbps0 is None:  # same path, or no rate to scale by: as measured
            return self.m.sync_time, path
        if self.m.sync_bytes:
            wire0 = self.m.sync_bytes * 8 / (gbps0 * 1e9)
            fixed = max(0.0, self.m.sync_time - wire0)
            return fixed + self.m.sync_bytes * 8 / (gbps * 1e9), path
        return self.m.sync_time * gbps0 / gbps, path

    def handoff_time(self, p: Placement) -> float:
        """Seconds per step the colocated hand-off costs in ``p`` (0 split)."""
        m = self.m
        if not p.colocate:
            return 0.0
        if m.placement.colocate:  # a colocated run without a measured hand-off fitted without one
            shards = m.placement.trainer_gpus / p.trainer_gpus
            if m.handoff_time and m.handoff_bytes and m.handoff_move_time:
                # each GPU moves its shard of the bytes at this run's rate: the moving seconds scale, the rest stays
                fixed = max(0.0, m.handoff_time - m.handoff_move_time)
                return fixed + m.handoff_move_time * shards
            return (m.handoff_time or 0.0) * shards
        if m.sync_bytes:
            a = self.assumptions
            return a.handoff_bytes_ratio * m.sync_bytes * 8 / (a.host_gbps * 1e9) / p.trainer_gpus
        return 0.0

    # ---- phases ------------------------------------------------------------------------------
    def _ratios(self, w: Workload) -> tuple[float, float, float]:
        m = self.m
        length = (w.max_response_len / m.max_response_len
                  if w.max_response_len and m.max_response_len == m.max_response_len else 1.0)
        group = 1.0
        if w.group_size:
            if not m.group_size:
                raise ValueError("--n-samples-per-prompt needs the run's own samples per prompt, which its rows lack: "
                                 "record group_size in the telemetry (StepRecorder(group_size=...); the example "
                                 "loop writes --n-samples-per-prompt there)")
            group = w.group_size / m.group_size
        n = max(m.samples_per_step, 1.0)
        tail_growth = _harmonic(n * group) / _harmonic(n)
        return length, group, tail_growth

    def waves(self, p: Placement, group: float = 1.0, length: float = 1.0) -> int:
        """Decode waves per engine in ``p``: ceil(sequences per engine / sequences the KV cache holds)."""
        m = self.m
        if not m.kv_cache_tokens or not m.max_response_len or m.max_response_len != m.max_response_len:
            return 1
        per_seq = (m.prompt_len or 0.0) + m.max_response_len * length
        concurrency = max(1, int(m.kv_cache_tokens // max(per_seq, 1.0)))
        if m.max_num_seqs:
            concurrency = min(concurrency, m.max_num_seqs)
        engines = max(1, p.rollout_gpus // m.gpus_per_engine)
        return max(1, math.ceil(m.samples_per_step * group / engines / concurrency))

    def predict(self, p: Placement, workload: Workload = Workload()) -> Prediction:
        m = self.m
        length, group, tail_growth = self._ratios(workload)
        r0 = m.placement.rollout_gpus
        t0 = m.placement.trainer_gpus
        fixed = m.rollout_time - m.rollout_scalable
        waves = self.waves(p, group, length) / self.waves(m.placement)
        rollout = (m.rollout_scalable * (r0 / p.rollout_gpus) * group * length ** self.assumptions.rollout_length_exponent
                   + fixed * length * tail_growth * waves)
        train = m.train_time * (t0 / p.trainer_gpus) * group * length
        sync, path = self.sync_time(p)
        handoff = self.handoff_time(p)
        step = max(self._compose(p, rollout, sync, train) + handoff + self.other_time, rollout, train, sync)
        return Prediction(p, rollout, train, sync, step, path, handoff)

    def _compose(self, p: Placement, rollout: float, sync: float, train: float) -> float:
        overlapped = self.m.overlapped if not self.m.placement.colocate else True
        if p.colocate or not overlapped:
            return rollout + sync + train
        return max(rollout, train) + sync


def fit(m: Measurement, assumptions: ModelAssumptions = ModelAssumptions()) -> StepModel:
    """Fit to ``m``; the residual of the measured step over the modelled one, either sign, is kept as
    'other', so the current layout's prediction is the measured step: clipped at 0, a run whose phases
    overlap more than the composition assumes would be predicted slower than measured, and every gain
    against that prediction overstated."""
    bare = StepModel(m, assumptions, 0.0)
    modelled = bare._compose(m.placement, m.rollout_time, m.sync_time, m.train_time) + bare.handoff_time(m.placement)
    return StepModel(m, assumptions, m.step_time - modelled)
