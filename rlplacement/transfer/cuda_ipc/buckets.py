"""Bucket buffers that another process on the same host/GPU can open: the memory of mode ``cuda_ipc``.

One buffer per slot, kept across updates (a slot grows only when a bucket needs more room), and
one handle per buffer, never per tensor: a receiver opens a handle once and keeps it open until
the slot grows or the group closes, so steady-state updates open nothing.

* CUDA tensors: a plain ``torch.empty`` on the sender's device from the default caching
  allocator, exported with ``torch.multiprocessing.reductions.reduce_tensor`` (a legacy
  ``cudaIpcMemHandle``). Memory from a custom allocator pool (``torch.cuda.MemPool``) or from
  expandable segments cannot be exported that way; the export error is turned into a message
  saying so.
* CPU tensors: a file in ``/dev/shm`` of the buffer's size, mapped by both sides. The sender
  unlinks the file as soon as every receiver has acknowledged a bucket in it (``release``): the
  mappings stay valid, and nothing is left in ``/dev/shm`` even if the trainer is killed later.
  ``close`` unlinks whatever is still linked.
  A file is named after its owner (``rlplacement-ipc-<pid namespace>.<pid>.<start time>.<tag>-...``):
  a trainer killed between creating a file and the receivers' acknowledgement leaves it linked, and
  the next sender on the host (:class:`SharedSlots`) removes every file whose owner process is gone
  (:func:`sweep_orphans`). A file is swept only when its owner is provably gone: same pid namespace
  as the sweeper (a pid from another namespace cannot be checked) and no process with that pid and
  that start time (a reused pid has another start time). /dev/shm is a tmpfs, emptied at boot, so
  the boot needs no part in the name.

Descriptors are plain dicts (``kind``, ``key``, ``nbytes`` and ``path`` or ``handle``) carried in a
bucket's JSON manifest.
"""

from __future__ import annotations

import base64
import logging
import mmap
import os
import pickle
import socket
import tempfile
import uuid
from typing import TYPE_CHECKING

from rlplacement.transfer.base import TransferError
from rlplacement.transfer.group import gpu_identity

if TYPE_CHECKING:
    import torch

SHM_PREFIX = "rlplacement-ipc-"

log = logging.getLogger(__name__)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_namespace() -> str:
    """This process's pid namespace id (the inode in ``/proc/self/ns/pid``); "" where /proc lacks it."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]")
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); None when
    no such process is visible."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields after the command name start at field 3


def owner_tag(pid: int | None = None) -> str:
    """``<pid namespace>.<pid>.<start time>`` of this process: what names its shared files' owner."""
    pid = os.getpid() if pid is None else pid
    return f"{_pid_namespace()}.{pid}.{_start_time(pid) or 0}"


def _owner_gone(name: str, namespace: str) -> bool:
    """Whether the owner named in shared file ``name`` is provably gone (see the module docstring)."""
    parts = name[len(SHM_PREFIX):].split(".", 3)
    if len(parts) < 4 or not namespace or parts[0] != namespace or not parts[1].isdigit():
        return False  # another namespace, or not named with an owner: cannot tell, so kept
    return _start_time(int(parts[1])) != parts[2]


def orphaned_shm_files() -> list[str]:
    """This module's /dev/shm files whose owner process is provably gone, sorted."""
    namespace = _pid_namespace()
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(SHM_PREFIX) and _owner_gone(n, namespace))


def sweep_orphans() -> list[str]:
    """Unlink :func:`orphaned_shm_files`; returns their names. A live process's files, and files whose
    owner cannot be checked, are kept."""
    swept = []
    for name in orphaned_shm_files():
        try:
            os.unlink(os.path.join(shm_dir(), name))
        except FileNotFoundError:  # another sender swept it first
            continue
        except OSError as exc:  # another user's file: theirs to remove
            log.warning("cannot remove %s, left by a process that is gone: %s", name, exc)
            continue
        swept.append(name)
    if swept:
        log.info("removed %d shared bucket file(s) left by processes that are gone: %s", len(swept), ", ".join(swept))
    return swept


def leftover_shm_files(tag: str = "") -> list[str]:
    """Files this module created and nobody unlinked yet (``tag``: one sender's only)."""
    prefix = SHM_PREFIX + tag
    return sorted(f for f in os.listdir(shm_dir()) if f.startswith(prefix))


class _ShmBuffer:
    """A /dev/shm file mapped read-write; ``tensor`` is a uint8 view of the whole mapping."""

    def __init__(self, path: str, nbytes: int):
        import torch

        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self.linked = True
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class SharedSlots:
    """The sender's exportable bucket buffers, one per slot (the sender double-buffers: slots 0, 1)."""

    def __init__(self, device: "torch.device | str", tag: str | None = None, *, min_nbytes: int = 1):
        """``min_nbytes``: the size a slot starts at (the bucket size), so only a bucket holding one
        oversized group makes it grow. Files left by senders that are gone are swept first
        (:func:`sweep_orphans`); this sender's files are named with its owner (``owner_tag``) and ``tag``."""
        import torch

        self.device = torch.device(device)
        self.min_nbytes = max(1, int(min_nbytes))
        self.swept = sweep_orphans()
        self.tag = f"{owner_tag()}.{tag or uuid.uuid4().hex[:12]}"
        self._slots: dict[int, tuple[object, dict]] = {}  # slot -> (buffer, descriptor)
        self.allocations = 0

    def get(self, slot: int, nbytes: int) -> tuple["torch.Tensor", dict]:
        """The slot's uint8 buffer (at least ``nbytes``) and its descriptor; grows if needed."""
        entry = self._slots.get(slot)
        if entry is not None and entry[1]["nbytes"] >= nbytes:
            buf, desc = entry
            return (buf.tensor if isinstance(buf, _ShmBuffer) else buf), desc
        if entry is not None:
            self._drop(slot)
        size = max(nbytes, self.min_nbytes)
        key = f"{self.tag}-{slot}-{self.allocations}"
        if self.device.type == "cpu":
            buf = _ShmBuffer(os.path.join(shm_dir(), SHM_PREFIX + key), size)
            desc = {"kind": "shm", "key": key, "nbytes": size, "path": buf.path}
            tensor = buf.tensor
        else:
            tensor = buf = _exportable_cuda_buffer(size, self.device)
            desc = {"kind": "cuda", "key": key, "nbytes": size, "handle": _export_cuda(tensor)}
        desc["host"], desc["gpu"] = socket.gethostname(), gpu_identity(self.device)
        self._slots[slot] = (buf, desc)
        self.allocations += 1
        return tensor, desc

    def release(self, slot: int) -> None:
        """Every receiver has the slot open: drop its name (CPU: unlink the /dev/shm file)."""
        entry = self._slots.get(slot)
        if entry is not None and isinstance(entry[0], _ShmBuffer):
            entry[0].unlink()

    def _drop(self, slot: int) -> None:
        buf, _ = self._slots.pop(slot)
        if isinstance(buf, _ShmBuffer):
            buf.close()

    def close(self) -> None:
        for slot in list(self._slots):
            self._drop(slot)

    @property
    def nbytes(self) -> int:
        return sum(desc["nbytes"] for _, desc in self._slots.values())


def _local_index_of(gpu_uuid: str, fallback: int) -> int:
    """This process's index of the GPU with ``gpu_uuid`` (processes may see different CUDA_VISIBLE_DEVICES)."""
    import torch

    if gpu_uuid:
        for i in range(torch.cuda.device_count()):
            if gpu_identity(torch.device("cuda", i)) == gpu_uuid:
                return i
    return fallback


def _expandable_segments_on() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _exportable_cuda_buffer(nbytes: int, device: "torch.device") -> "torch.Tensor":
    """A plain caching-allocator block. Expandable segments (a common trainer setting) are switched
    off around this one allocation, so the block is a classic cudaMalloc segment that a legacy
    IPC handle can export; the trainer's setting is restored right after."""
    import torch

    toggle = _expandable_segments_on() and hasattr(torch.cuda.memory, "_set_allocator_settings")
    if toggle:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        if toggle:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _export_cuda(tensor: "torch.Tensor") -> str:
    from torch.multiprocessing.reductions import reduce_tensor

    try:
        _, args = reduce_tensor(tensor)
    except RuntimeError as exc:
        raise TransferError(
            f"cannot export the weight bucket buffer as a CUDA IPC handle ({exc}): bucket buffers must come from "
            f"the default CUDA caching allocator, not a torch.cuda.MemPool or expandable segments (remove "
            f"expandable_segments from PYTORCH_CUDA_ALLOC_CONF for the trainer process)") from exc
    return base64.b64encode(pickle.dumps(args)).decode()


class OpenedBuffer:
    """A receiver's view of one sender buffer; ``copy_to(dst, nbytes)`` copies its first bytes."""

    def __init__(self, desc: dict, device: "torch.device"):
        self.key, self.nbytes, self.kind = desc["key"], int(desc["nbytes"]), desc["kind"]
        self._map = None
        here = socket.gethostname()
        if desc.get("host", here) != here:
            raise TransferError(f"mode cuda_ipc shares memory within one host: the trainer's buckets are on host "
                                f"{desc['host']!r}, this engine worker runs on {here!r}; place every engine on its "
                                f"trainer rank's node, or drop --colocate and use broadcast_packed")
        if self.kind == "shm":
            import numpy as np

            try:
                fd = os.open(desc["path"], os.O_RDONLY)
            except FileNotFoundError as exc:
                raise TransferError(f"shared bucket {desc['path']} is gone: the trainer unlinked it before this "
                                    f"receiver opened it (a receiver joined late or the trainer restarted)") from exc
            try:
                self._map = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self.view = np.frombuffer(self._map, dtype=np.uint8)
        elif self.kind == "cuda":
            import torch
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = list(pickle.loads(base64.b64decode(desc["handle"])))
            # index 6 of reduce_tensor's args is the device index, which is the sender's numbering: map the
            # sender's GPU by UUID into this process's numbering (else: this worker's own device)
            own = device.index if device.index is not None else torch.cuda.current_device()
            args[6] = _local_index_of(desc.get("gpu", ""), own)
            self.view = rebuild_cuda_tensor(*args)
        else:
            raise TransferError(f"unknown shared buffer kind {self.kind!r} in a bucket manifest")

    def copy_to(self, dst: "torch.Tensor", nbytes: int) -> None:
        if nbytes > self.nbytes:
            raise TransferError(f"bucket of {nbytes} bytes does not fit shared buffer {self.key} of {self.nbytes}")
        if self.kind == "shm" and dst.device.type == "cpu":
            import numpy as np

            np.copyto(dst.numpy()[:nbytes], self.view[:nbytes])
        elif self.kind == "shm":
            import torch

            dst[:nbytes].copy_(torch.from_numpy(self.view[:nbytes].copy()))
        else:
            import torch

            dst[:nbytes].copy_(self.view[:nbytes])
            torch.cuda.current_stream(dst.device).synchronize()  # the sender may refill it after our ack

    def close(self) -> None:
        self.view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
