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


def flip_first_byte_of_next_update(worker) -> None:
    """Flip one byte of the first tensor as it lands in this worker's staging buffer (once): the wire
    corrupted it, and --check-weight-update-equal must catch it by name."""
    receiver = worker.weight_transfer_engine.receiver
    cls_recv = type(receiver)._recv_payload

    def corrupting(buf, manifest):
        del receiver._recv_payload  # back to normal for later updates
        cls_recv(receiver, buf, manifest)
        buf[manifest.tensors[0].offset] ^= 0xFF

    receiver._recv_payload = corrupting


def stall_next_receive(worker, seconds: float) -> None:
    """Make this worker stop answering for ``seconds`` at the first bucket of the next update (once)."""
    import time

    receiver = worker.weight_transfer_engine.receiver
    cls_recv = type(receiver)._recv_payload

    def stalling(buf, manifest):
        del receiver._recv_payload
        time.sleep(seconds)
        cls_recv(receiver, buf, manifest)

    receiver._recv_payload = stalling
