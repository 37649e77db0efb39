"""Every number the advisor decides with, in two documented dataclasses.

:class:`Thresholds` turns measurements into a diagnosis and a decision; :class:`ModelAssumptions`
holds the physics the step-time model cannot measure from one run (link speeds, how much of a
link each transfer mode achieves, how decode cost grows with length). ``rlplacement advise``
exposes each field as ``--<field-name>`` (underscores -> dashes), with the help text below, except a
field that says what a library flag says, which takes that flag's name (:func:`flag_names`).
"""

from __future__ import annotations

import dataclasses


def _field(default, help: str, flags: tuple[str, ...] = ()):
    """``flags``: the field's flag names when not ``--<field-name>`` (the first is the name, the rest aliases)."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Thresholds:
    skip_steps: int = _field(1, "Leading steps ignored as warm-up (compilation, caches) when more remain.")
    sync_share: float = _field(0.3, "sync-bound when weight transfer takes at least this share of the step.")
    imbalance: float = _field(1.3, "rollout-bound when rollout time >= this x train time; train-bound "
                                   "the other way round; balanced in between.")
    tail_ratio: float = _field(2.0, "long-tail needs p99 sample finish time >= this x p50 ...")
    tail_share: float = _field(0.3, "... and at least this share of rollout time spent after "
                                    "--bulk-quantile of the samples finished (engines mostly idle).")
    bulk_quantile: float = _field(0.9, "Samples finished by this quantile make the 'bulk' of rollout, which "
                                       "scales with engines; the rest is the tail, which does not.")
    min_gain: float = _field(0.05, "Recommend a change only when it is predicted to cut the step by at least "
                                   "this fraction; else keep the current layout.")

    def __post_init__(self) -> None:
        checks = {"skip_steps": self.skip_steps >= 0, "sync_share": 0 < self.sync_share <= 1,
                  "imbalance": self.imbalance >= 1, "tail_ratio": self.tail_ratio >= 1,
                  "tail_share": 0 < self.tail_share <= 1, "bulk_quantile": 0 < self.bulk_quantile < 1,
                  "min_gain": 0 <= self.min_gain < 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} is out of range: "
                                 f"{field_help(Thresholds)[name]}")




@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelAssumptions:
    link_gbps: float = _field(400.0, "Network between nodes in Gb/s (NDR InfiniBand's datasheet rate), used when "
                                     "a split layout's trainer and engines sit on different nodes.")
    nvlink_gbps: float = _field(3600.0, "GPU-to-GPU inside a node in Gb/s (NVLink 4's datasheet 450 GB/s each way; "
                                        "what NCCL reached beside it: benchmarks/README.md).")
    ipc_gbps: float = _field(16800.0, "In-GPU copy through a CUDA IPC handle in Gb/s (colocated; an H200's "
                                      "device-to-device copy, measured: benchmarks/README.md).")
    disk_gbps: float = _field(11.2, "Shared disk write + fsync in Gb/s for disk-delta (an estimate from one "
                                    "machine's local disk, benchmarks/README.md; measure yours).")
    delta_density: float = _field(0.03, "disk-delta: share of the bytes that change per step when the run did not "
                                        "measure it (verl's published delta-sync estimate: ~1-3% of bf16 bytes).")
    transfer_mode: str = _field("broadcast", "Transfer mode assumed for split layouts when the measured run "
                                             "was colocated (a split run keeps its own mode); the library's "
                                             "--update-weight-transfer-mode (--transfer-mode: the advisor's older "
                                             "name, kept as an alias).",
                                flags=("--update-weight-transfer-mode", "--transfer-mode"))
    host_gbps: float = _field(430.0, "GPU <-> pinned host memory in Gb/s per GPU for the colocated hand-off, as "
                                     "the trainer's offload achieves it on an H200 (measured: benchmarks/README.md); a "
                                     "colocated run with --offload-* measures its own bytes and rate, used instead.")
    handoff_bytes_ratio: float = _field(
        12.0, "Bytes the colocated hand-off moves per step, per byte of bf16 weights sent: the trainer's fp32 master "
              "weights and fp32 AdamW moments (6x) out and back (12x); the engines' weights do not cross (level-2 "
              "sleep, refilled by the update). With bf16 weights and moments it is 6x.")
    rollout_length_exponent: float = _field(
        1.5, "Rollout work grows as (max response length)^this: each decoded token reads the whole KV "
             "cache, so per-token cost rises with context (1 = no attention cost, 2 = all attention). "
             "Training grows linearly: its matmuls dominate.")

    def __post_init__(self) -> None:
        if not 0 < self.delta_density <= 1:
            raise ValueError(f"--delta-density {self.delta_density} must be in (0, 1]")
        for name in ("link_gbps", "nvlink_gbps", "ipc_gbps", "disk_gbps", "host_gbps", "handoff_bytes_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        from rlplacement.transfer.registry import selectable_modes

        if self.transfer_mode not in selectable_modes():
            raise ValueError(f"--update-weight-transfer-mode {self.transfer_mode!r} is unknown: use one of "
                             f"{list(selectable_modes())}")
        if not 1 <= self.rollout_length_exponent <= 2:
            raise ValueError(f"--rollout-length-exponent {self.rollout_length_exponent} must be in [1, 2]")


def field_help(cls) -> dict[str, str]:
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The ``advise`` flag(s) of a field: its own, else ``--<field-name>``."""
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
