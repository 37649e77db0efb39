"""Faults injected into a live engine worker (tests only), through ``collective_rpc``."""


def fail_receive_after_buckets(worker, n_buckets: int = 2) -> None:
    """Make this worker's receiver raise after ``n_buckets`` buckets of the next update (once)."""
    receiver = worker.weight_transfer_engine.receiver
    cls_recv = type(receiver)._recv_payload
    seen = {"n": 0}

    def failing(buf, manifest):
        if seen["n"] == n_buckets:
            del receiver._recv_payload  # back to normal for later updates
            raise RuntimeError(f"injected receiver fault after {n_buckets} buckets")
        seen["n"] += 1
        cls_recv(receiver, buf, manifest)

    receiver._recv_payload = failing
