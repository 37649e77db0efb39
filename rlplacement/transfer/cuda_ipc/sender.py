"""Trainer side of ``cuda_ipc``: a resident update goes direct (one manifest of the trainer's own
allocations) where it can, else by buckets packed into two exported slot buffers."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, BucketManifest, NamedTensor, UpdateRefused, UpdateReport,
                                       tensor_checksum)
from rlplacement.transfer.bucket import GroupFn, fused_group_of, pack_into
from rlplacement.transfer.cuda_ipc.buckets import SharedSlots
from rlplacement.transfer.cuda_ipc.direct import AllocationExports
from rlplacement.transfer.cuda_ipc.protocol import (DIRECT_ACK_TAG, KIND_CHECKSUMS, KIND_DIRECT, KIND_DIRECT_COMMIT,
                                                    Ack, ReceiversFailed, failed_ranks)
from rlplacement.transfer.wire import KIND_END, FramedSender, guard

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)

HOST_MEMORY = ("the trainer's tensors are in host memory, which the engines cannot map in place (the direct path "
               "maps CUDA allocations)")
"""Why a resident update on CPU goes by buckets (through /dev/shm)."""


@dataclasses.dataclass(frozen=True)
class IpcUpdateReport(UpdateReport):
    """UpdateReport plus ``perf/update_weights_fallback``: 1 when a resident update, which could have been read
    in place, went by buckets (``fallback`` says why), else 0."""

    @property
    def metrics(self) -> dict[str, Any]:
        return {**super().metrics, "perf/update_weights_fallback": int(bool(self.fallback))}


class IpcSender(FramedSender):
    """A sending trainer rank under --colocate: one exported buffer per slot, two slots, one handle each."""

    mode: ClassVar[str] = "cuda_ipc"
    NUM_SLOTS = 2

    def __init__(self, bucket_bytes: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of):
        import torch

        super().__init__(bucket_bytes, check_equal=check_equal, timeout_s=timeout_s, device=device, group_of=group_of)
        self.backend, self.wire_device = "gloo", torch.device("cpu")  # control only; bytes go by handle
        self.buffers = SharedSlots(self.device, min_nbytes=bucket_bytes)
        self.exports = AllocationExports(self.device) if self.device.type == "cuda" else None
        self._direct_sent: bytes | None = None  # the direct manifest every receiver holds
        self._direct_kept: bytes | None = None  # the direct manifest every receiver mapped and kept mapped
        self.last_direct_rounds = 0  # acknowledgement rounds of the last direct update (2, or 1 when kept)
        self._fallback_said = False  # the first fallback is logged; its telemetry key is in every report

    @property
    def transport(self) -> str:
        """Bytes go by handle, not over the gloo control group: CUDA IPC on a GPU, a /dev/shm mapping on CPU."""
        return "cuda ipc" if self.device.type == "cuda" else "shared memory"

    def connect(self) -> None:
        """A new group's receivers have nothing open, and a slot's name is unlinked once the old group opened
        it: the slots are made afresh, under new names, at their first use."""
        super().connect()
        self._in_flight = {}
        self.buffers.close()
        self._direct_sent = self._direct_kept = None

    def keep_mapped_between_updates(self) -> bool:
        if self.exports is None:  # on CPU the direct path does not run: nothing is mapped elsewhere
            return False
        self.exports.keep_mapped = True
        return True

    @property
    def mapped_elsewhere(self) -> bool:
        return self.exports is not None and self.exports.mapped_elsewhere

    def receivers_unmapped(self) -> None:
        if self.exports is not None:
            self.exports.mapped_elsewhere = False

    def _forget_sent(self) -> None:
        super()._forget_sent()
        self._direct_sent = self._direct_kept = None

    def update(self, version: int, named_tensors, *, resident: bool = False, hf_shapes=None) -> IpcUpdateReport:
        report = super().update(version, named_tensors, resident=resident, hf_shapes=hf_shapes)
        return IpcUpdateReport(**{f.name: getattr(report, f.name) for f in dataclasses.fields(report)})

    def _fall_back(self, reason: str) -> None:
        """A resident update goes by buckets: ``reason`` in its report, and said once per sender (a job's
        colocated trainer keeps one; only a one-rank trainer sends resident tensors), since buckets copy
        every byte twice more than the direct path."""
        self.fallback = reason
        if not self._fallback_said:
            self._fallback_said = True
            log.warning("rlplacement cuda_ipc: weight updates go by buckets, not the direct path: %s", reason)

    def _send_update(self, version: int, named_tensors, resident: bool, hf_shapes=None):
        if not resident:
            return super()._send_update(version, named_tensors, resident, hf_shapes)
        if self.exports is None:
            self._fall_back(HOST_MEMORY)
            return super()._send_update(version, named_tensors, resident, hf_shapes)
        tensors = list(guard(named_tensors))  # resident: listing them holds no extra memory
        self.instants.mark("listed")
        blob, reason = self.exports.manifest(tensors, hf_shapes)
        if blob is None:
            self._fall_back(reason)
            return super()._send_update(version, tensors, resident, hf_shapes)
        import torch

        self.instants.mark("manifest")
        torch.cuda.synchronize(self.device)  # the optimizer's last kernels have written what engines read
        self.instants.mark("synced")
        # the receivers still hold every mapping of this manifest unless the trainer was told they let go
        kept = blob is self._direct_kept and self.exports.mapped_elsewhere
        self.exports.mapped_elsewhere = self.exports.mapped_elsewhere or self.exports.keep_mapped
        if kept and not self.check_equal:
            return self._commit_at_once(version, tensors)
        self._direct_kept, self.last_direct_rounds = None, 2
        self._send_frame(KIND_DIRECT, version, b"" if blob is self._direct_sent else blob, len(tensors))
        self._direct_sent = blob
        self.instants.mark("direct_sent")
        checksums = None
        if self.check_equal:  # hashed here while every receiver hashes what it mapped: one pass of wall time
            checksums = {n: tensor_checksum(t) for n, t in tensors}
            self._send_frame(KIND_CHECKSUMS, version, json.dumps(checksums).encode(), len(tensors))
        failed = failed_ranks(self._direct_acks())
        self.instants.mark("mapped_acked")
        if failed:
            raise ReceiversFailed(f"engine worker rank(s) {', '.join(map(str, failed))} could not map or "
                                   f"verify the trainer's weights")
        self._send_frame(KIND_END, version, b"", len(tensors))
        self._direct_kept = blob if self.exports.keep_mapped else None
        return self._committed(version, tensors, checksums)

    def _commit_at_once(self, version: int, tensors: list[NamedTensor]):
        """The steady-state direct update: one frame, one acknowledgement (see the module docstring)."""
        self.last_direct_rounds = 1
        self._send_frame(KIND_DIRECT_COMMIT, version, b"", len(tensors))
        self.instants.mark("direct_sent")
        return self._committed(version, tensors, None)

    def _committed(self, version: int, tensors: list[NamedTensor], checksums):
        failed = failed_ranks(self._direct_acks())  # each receiver committed (or dropped) and unmapped (or kept)
        self.instants.mark("committed_acked")
        if failed:
            self._direct_kept = None  # a receiver that failed may not hold every mapping any more
            raise UpdateRefused(f"engine worker rank(s) {', '.join(map(str, failed))} did not commit update "
                                f"{version} from the trainer's memory and keep their previous version; the "
                                f"other engines serve {version}")
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        return len(tensors), 1, nbytes, checksums, "direct"

    def _direct_acks(self) -> "torch.Tensor":
        """Every receiver's flag (non-zero: failed), one message each (the bucket path's per-bucket
        acknowledgements are all-reduces, overlapped with packing; here nothing overlaps them)."""
        import torch

        status = torch.zeros(self._endpoint.world_size, dtype=torch.int32)
        works = [self._group.recv(status[rank:rank + 1], rank, DIRECT_ACK_TAG) for rank in range(1, status.numel())]
        for work in works:
            work.wait()
        return status

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        self._wait_ack(slot)
        buf, desc = self.buffers.get(slot, manifest.nbytes)
        pack_into(buf, bucket, manifest)
        if buf.device.type == "cuda":
            import torch

            torch.cuda.current_stream(buf.device).synchronize()  # receivers read it from another process
        return slot, desc

    def _manifest_wire(self, manifest: BucketManifest, prepared) -> dict:
        wire = manifest.to_wire()
        if prepared is not None:
            slot, desc = prepared
            wire["payload"] = {**desc, "slot": slot}
        return wire

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        import torch

        if prepared is None:
            return
        status = torch.zeros(self._endpoint.world_size, dtype=torch.int32)
        self._in_flight[prepared[0]] = Ack(self._group.all_reduce_sum(status, async_op=True), status, manifest.index)

    def _wait_ack(self, slot: int) -> None:
        ack = self._in_flight.pop(slot, None)
        if ack is None:
            return
        ack.work.wait()
        failed = failed_ranks(ack.status)
        if failed:
            raise ReceiversFailed(f"engine worker rank(s) {', '.join(map(str, failed))} failed on bucket {ack.index}")
        self.buffers.release(slot)  # every receiver has it open: its name may go

    def _drain(self) -> None:
        for slot in sorted(self._in_flight, key=lambda s: self._in_flight[s].index):
            self._wait_ack(slot)

    def _drain_quietly(self) -> None:
        acks, self._in_flight = self._in_flight, {}
        for ack in sorted(acks.values(), key=lambda a: a.index):
            ack.work.wait()

    def close(self) -> None:
        super().close()
        self._in_flight = {}
        self.buffers.close()
        if self.exports is not None:
            self.exports.close()
