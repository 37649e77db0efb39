"""The few CUDA driver calls that mode ``cuda_ipc``'s direct path needs, through ctypes on
``libcuda.so.1``: where an allocation starts and ends and its process-unique id, and legacy IPC
handles of whole allocations (export, open, close).

Why the driver and not torch's ``reduce_tensor``: torch exports storages, with a reference-count
file, an event and a "limbo" that keeps a shared block alive until every consumer let go. The
direct path maps whole allocations once per update and closes them before it acknowledges, so
none of that is needed, and at ~400 tensors per model its per-storage cost (~tens of µs each)
would be most of an update. The allocation's ``BUFFER_ID`` is never reused within a process,
so it names one allocation even when a freed and re-made one lands at the same address.

Every call raises :class:`TransferError` naming the call and the driver's error name.
"""

from __future__ import annotations

import ctypes
import dataclasses

from rlplacement.transfer.base import TransferError

# CUpointer_attribute (cuda.h)
_ATTR_BUFFER_ID = 7
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_BYTES = 64

_lib = None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _cuda():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(f"mode cuda_ipc's direct path needs the CUDA driver (libcuda.so.1): {exc}") from exc
        lib.cuPointerGetAttributes.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        opener = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        opener.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.rlp_open = opener
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(rc, ctypes.byref(name))
        raise TransferError(f"CUDA driver call {what} failed: {name.value.decode() if name.value else rc}")


def bind_context(device_index: int) -> None:
    """Make the device's primary context current on this thread (torch does so lazily, and a thread
    that has not touched CUDA yet, e.g. an RPC handler, may have none)."""
    lib = _cuda()
    _check(lib.cuInit(0), "cuInit")  # idempotent; a process that has not touched CUDA yet needs it first
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), int(device_index)), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One device allocation (a caching-allocator segment): ``[base, base + size)``."""

    base: int
    size: int
    buffer_id: int
    ipc_capable: bool


def allocation_of(ptr: int) -> Allocation:
    """The allocation holding device address ``ptr`` (one driver call)."""
    base, size, buffer_id, capable = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64(), ctypes.c_int()
    attrs = (ctypes.c_int * 4)(_ATTR_RANGE_START_ADDR, _ATTR_RANGE_SIZE, _ATTR_BUFFER_ID,
                               _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE)
    data = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (base, size, buffer_id, capable)))
    _check(_cuda().cuPointerGetAttributes(4, attrs, data, int(ptr)), "cuPointerGetAttributes")
    return Allocation(base.value, size.value, buffer_id.value, bool(capable.value))


def export_handle(base: int) -> bytes:
    """The legacy IPC handle of the allocation starting at ``base``."""
    handle = _IpcHandle()
    _check(_cuda().cuIpcGetMemHandle(ctypes.byref(handle), int(base)), "cuIpcGetMemHandle")
    return bytes(handle)  # all 64 bytes (the char array field would stop at the first zero byte)


def open_handle(handle: bytes) -> int:
    """Map another process's allocation; returns its address here. Close it with :func:`close_handle`
    before the exporter may free it (the driver leaves a freed-while-mapped allocation undefined)."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise TransferError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    ptr = ctypes.c_uint64()
    _check(_cuda().rlp_open(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle), _IPC_LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    return ptr.value


def close_handle(ptr: int) -> None:
    _check(_cuda().cuIpcCloseMemHandle(int(ptr)), "cuIpcCloseMemHandle")


class DeviceBytes:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at ``ptr``, so ``torch.as_tensor`` makes a uint8
    tensor over mapped memory without copying or owning it (version 2: no stream to wait on)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
                                         "version": 2, "strides": None}
