"""Rendezvous stores for torch.distributed, bound without a race.

A port found free and then handed to ``init_process_group`` can be taken by another process in
between (vLLM engines, Ray workers and gloo all open ephemeral ports on the same host; CI saw
EADDRINUSE this way). A ``TCPStore`` that binds port 0 itself holds its port from the moment it
exists, so the host keeps that store and every other member joins it as a client.
"""

from __future__ import annotations

import datetime


def host_store(host: str, world_size: int, timeout_s: float):
    """A store served from this process on a port the kernel picks; returns (store, port)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    return store, store.port


def join_store(host: str, port: int, world_size: int, timeout_s: float):
    """A client of the store at ``host:port``; retries the connection until ``timeout_s``."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
