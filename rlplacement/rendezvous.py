"""Rendezvous stores for torch.distributed, bound without a race and only on the job's interface.

A port found free and then handed to ``init_process_group`` can be taken by another process in
between (vLLM engines, Ray workers and gloo all open ephemeral ports on the same host; CI saw
EADDRINUSE this way). A store that holds its port from the moment it exists avoids that, so the
host keeps that store and every other member joins it as a client.

``TCPStore`` has no authentication (any process that connects may read and write every key, and
the keys carry the peers' addresses and Mooncake session ids), and given a port it listens on every
interface whatever ``host`` says. So the host binds the listening socket itself, on ``host``'s
address only (127.0.0.1 on one machine: nothing off the machine can connect; the node IP across
nodes), and hands its descriptor to the store (``master_listen_fd``), which owns and closes it.
Both of torch's store servers (libuv and the legacy one) serve a descriptor handed to them; the
default process group (``init_process_group(store=...)``) and the transfer group both take it.
"""

from __future__ import annotations

import datetime
import os
import socket

LISTEN_BACKLOG = 512  # every trainer rank or engine worker of a job connects at once
LOOPBACK = "127.0.0.1"


def job_host() -> str:
    """The address a job's rendezvous listens on: loopback when the job is on one machine (no Ray, or a
    Ray cluster of one node), else this node's IP in the Ray cluster (the interface its peers reach).

    Loopback on one machine is what keeps the store (and Mooncake's peers, :mod:`..transfer.p2p`) off
    the network: a one-node job has no peer that needs more.
    """
    try:
        import ray
    except ImportError:
        return LOOPBACK
    if not ray.is_initialized() or sum(1 for n in ray.nodes() if n["Alive"]) <= 1:
        return LOOPBACK
    return ray.util.get_node_ip_address()


def bind_listener(host: str) -> socket.socket:
    """A TCP socket listening on ``host``'s address only, on a port the kernel picks.

    ``host`` may be a name; it must resolve to an address of this machine (else the bind fails
    naming it). Not 0.0.0.0 / :: by design: those are every interface.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"rendezvous host {host!r} does not resolve ({e}): give an address of this machine") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(addr[:2] if family == socket.AF_INET else addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"rendezvous: cannot listen on {host!r} ({e.strerror}): give an address of this "
                               f"machine's interface that the job's other processes reach") from e
    return sock


def host_store(host: str, world_size: int, timeout_s: float):
    """A store served from this process on ``host``'s interface only, on a port the kernel picks;
    returns (store, port)."""
    from torch.distributed import TCPStore

    sock = bind_listener(host)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here and closes it with itself
    try:
        store = TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # the store took it before failing
            pass
        raise
    return store, port


def join_store(host: str, port: int, world_size: int, timeout_s: float):
    """A client of the store at ``host:port``; retries the connection until ``timeout_s``."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
