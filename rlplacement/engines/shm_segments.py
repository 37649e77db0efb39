"""The shared-memory segments an engine's processes use on its host, so that an engine that was killed
does not leave them behind.

A vLLM engine of several workers on one host (its multiprocess executor) keeps its message queues and
tensors in ``/dev/shm`` (``psm_*`` from torch's multiprocessing, ``vllm_*`` from vLLM's CPU collectives,
``sem.mp-*`` semaphores): about 0.7 GB for a TP=2 engine of the tests' tiny model. A clean shutdown
removes them; a SIGKILL (a crashed or hung engine that fault tolerance kills) cannot, and each restart
would leak them until ``/dev/shm`` is full. So each engine records, once started, the segments its
process and every process under it map, and the job removes a replaced engine's ones on that engine's
node. Only names of those prefixes are ever recorded or removed (never Ray's own object store).
"""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
OWN_PREFIXES = ("psm_", "vllm_", "sem.mp-")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return out


def mapped_by_tree(root_pid: int | None = None) -> list[str]:
    """Names under ``/dev/shm`` of the engine prefixes that ``root_pid`` (default: this process) or any
    process under it maps, sorted."""
    pids, seen, names = [root_pid or os.getpid()], set(), set()
    while pids:
        pid = pids.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                    if path.startswith(SHM_DIR + "/") and not path.endswith(" (deleted)"):  # unlinked: nothing left
                        name = path[len(SHM_DIR) + 1:]
                        if name.startswith(OWN_PREFIXES) and "/" not in name:
                            names.add(name)
        except OSError:
            continue
        pids.extend(_children(pid))
    return sorted(names)


def remove(names: list[str]) -> list[str]:
    """Unlink each of ``names`` (segments an engine recorded) still in ``/dev/shm``; returns those removed.
    A name that is not a plain engine segment name is ignored. Memory a live process still maps stays
    until it unmaps: only the name goes."""
    removed = []
    for name in names:
        if "/" in name or not name.startswith(OWN_PREFIXES):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
