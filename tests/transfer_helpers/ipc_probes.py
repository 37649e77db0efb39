"""Read-only probes run inside engine workers and actors (tests of mode ``cuda_ipc``)."""

from rlplacement.transfer.cuda_ipc.buckets import SHM_PREFIX


def receiver_stats(worker) -> dict:
    """On a worker (``worker_hooks``): how often its receiver opened handles and grew staging."""
    r = worker.weight_transfer_engine.receiver
    return {"handles_opened": r.handles_opened, "staging_allocations": r.buffers.allocations,
            "open_keys": sorted(o.key for o in r._opened.values())}


def shm_mappings(_actor=None) -> list[str]:
    """Lines of this process's /proc/self/maps that map one of our shared buckets."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if SHM_PREFIX in line]
