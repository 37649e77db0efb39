"""A process group for weight transfer that never touches the trainer's default group.

Rank 0 (the trainer) hosts a fresh ``TCPStore`` (``rendezvous.host_store``); every engine worker connects
to it and the group is built directly as ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a
``PrefixStore`` (no ``init_process_group``), so the trainer's own torch.distributed world and
vLLM's internal groups are left alone, and a failed group can be dropped and rebuilt with a
new ``group_name``. The backend follows the device of the tensors: gloo for CPU, NCCL for CUDA.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def backend_for(device: "torch.device | str") -> str:
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def default_device() -> "torch.device":
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gpu_identity(device: "torch.device | str", local_index: int = 0) -> str:
    """Which GPU ``device`` is, as every process on the host names it: its UUID under CUDA; on a host without
    CUDA, the logical GPU the placement gave this process (entry ``local_index`` of its
    ``CUDA_VISIBLE_DEVICES``, Ray's GPU id), or "" where it has none."""
    import os

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[local_index].strip() if local_index < len(visible) else ""


def local_host() -> str:
    """Where the group's store listens: loopback for a one-machine job, else Ray's node IP
    (:func:`rlplacement.rendezvous.job_host`; the store is bound to that interface only)."""
    from rlplacement.rendezvous import job_host

    return job_host()


class TransferGroup:
    """Broadcast from rank 0 over a private gloo/NCCL group; every call blocks until done.

    Each op is bounded by ``timeout_s``: a peer that dies makes the others raise instead of
    hanging (gloo raises on a closed connection at once, NCCL after its timeout).
    """

    def __init__(self, store, group_name: str, rank: int, world_size: int, backend: str,
                 device: "torch.device | str", timeout_s: float):
        import torch
        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        prefixed = dist.PrefixStore(f"rlplacement/{group_name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            raise ValueError(f"transfer backend {backend!r} is unknown: use gloo or nccl")
        self._store = store  # keep the rendezvous alive as long as the group
        self.collectives = 0
        """Broadcasts and all-reduces this member issued (what a mode's wire costs in round trips)."""

    def broadcast(self, tensor: "torch.Tensor", *, async_op: bool = False):
        """Broadcast from rank 0 into ``tensor``; with ``async_op`` return the work to ``wait()`` on.

        Ops complete in issue order on every rank (each gets the next collective tag), so a
        sender may issue the next frame before the previous payload has left.
        """
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.collectives += 1
        work = self._pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce_sum(self, tensor: "torch.Tensor", *, async_op: bool = False):
        """Sum ``tensor`` over every rank in place (acknowledgements in mode ``cuda_ipc``)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.collectives += 1
        work = self._pg.allreduce([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def send(self, tensor: "torch.Tensor", dst: int, tag: int) -> None:
        """Send ``tensor`` to rank ``dst`` (blocking; messages of one ``tag`` between two ranks keep
        their order). One message: for a small acknowledgement, half the latency of an all-reduce."""
        self._pg.send([tensor], dst, tag).wait()

    def recv(self, tensor: "torch.Tensor", src: int, tag: int):
        """Start receiving ``tensor`` from rank ``src``; returns the work to ``wait()`` on (bounded by
        the group's timeout)."""
        return self._pg.recv([tensor], src, tag)

    def close(self) -> None:
        """Drop the group without waiting for any peer.

        NCCL's ``shutdown()`` is not local: on one rank it waits until every peer closes too
        (measured on 2 H200s: 20 s when the peer held its side open for 20 s, 0.5 s with
        ``abort()``). Members close at different times (the trainer rebuilds its side before the
        engines are told), so NCCL groups are aborted; gloo's close is local.
        """
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            end = getattr(pg, "abort", None) if self.backend == "nccl" else getattr(pg, "shutdown", None)
            if end is not None:
                try:
                    end()
                except Exception:  # closing a broken group must not turn an error into a hang
                    pass
        self._store = None
