"""A small RL-shaped loop of real computation whose time scales with GPU counts in a known way.

It stands in for the real loop when validating the advisor on a CPU machine where logical GPUs
add no compute. Two processes: this one is trainer rank 0 (and the telemetry driver), a spawned
one is the critical rollout engine; weights go from one to the other by a real gloo broadcast.

What one logical GPU count means here (the documented scaling):

* rollout: samples (lengths drawn per step from a seeded long-tailed distribution) are sorted
  and dealt round-robin to ``rollout_gpus / gpus_per_engine`` engines; the worker decodes
  engine 0's share, which holds the longest sample and the most tokens, so its time is the
  batch's wall time when engines run in parallel on their own GPUs. A decode step costs a fixed
  matmul (reading the weights) plus one proportional to the sequences still running: the tail
  is latency-bound, the bulk throughput-bound.
* train: a data-parallel rank's share, ``tokens / trainer_gpus`` rows of matmul (x3: forward
  and backward).
* sync: ``sync_mb`` megabytes broadcast over gloo, the same in every layout.
* loop: split layouts run one-step-off (rollout k+1 overlaps training k, then sync); colocated
  runs rollout, sync, train in sequence on all GPUs. Both processes use one thread each, so a
  split uses both cores of a 2-core machine at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import random
import time


@dataclasses.dataclass(frozen=True)
class StubConfig:
    trainer_gpus: int
    rollout_gpus: int
    gpus_per_engine: int = 2
    colocate: bool = False
    num_gpus_per_node: int = 8
    steps: int = 4
    samples: int = 64
    mean_len: float = 30.0
    max_len: int = 256
    sync_mb: int = 32
    seed: int = 0
    # work sizes: a decode step is (overhead_rows + rows_per_token x running sequences) rows of a
    # [rows, dim] @ [dim, dim] matmul; a trainer rank does train_rows_per_token x tokens / trainer_gpus
    dim: int = 256
    rows_per_token: int = 96
    overhead_rows: int = 768
    train_rows_per_token: int = 288
    # "cpu" (gloo), or CUDA devices for trainer and rollout (nccl), e.g. "cuda:0" and "cuda:1"
    trainer_device: str = "cpu"
    rollout_device: str = "cpu"

    @property
    def num_engines(self) -> int:
        return self.rollout_gpus // self.gpus_per_engine


def sample_lengths(cfg: StubConfig, step: int) -> list[int]:
    rng = random.Random(cfg.seed * 1000 + step)
    return [min(cfg.max_len, 8 + int(rng.expovariate(1 / cfg.mean_len))) for _ in range(cfg.samples)]


def engine_share(lengths: list[int], engines: int, engine: int = 0) -> list[int]:
    return sorted(lengths, reverse=True)[engine::engines]


def _matmul_rows(rows: int, w, chunk: int = 4096) -> None:
    """``rows`` rows of ``x @ w``, finished (synchronised) before returning."""
    import torch

    x = torch.ones(chunk, w.shape[0], device=w.device, dtype=w.dtype)
    while rows > 0:
        n = min(rows, chunk)
        x[:n] @ w
        rows -= n
    if w.is_cuda:
        torch.cuda.synchronize(w.device)


def decode(share: list[int], w, cfg: StubConfig) -> list[float]:
    """Decode the share; returns each sample's finish time in seconds after the start."""
    start = time.time()
    finish = [0.0] * len(share)
    for pos in range(max(share, default=0)):
        running = [i for i, n in enumerate(share) if n > pos]
        _matmul_rows(cfg.overhead_rows + cfg.rows_per_token * len(running), w)
        now = time.time() - start
        for i in running:
            if share[i] == pos + 1:
                finish[i] = now
    return finish


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(conn, port: int, cfg: StubConfig) -> None:
    import torch
    import torch.distributed as dist

    from rlplacement.rendezvous import join_store

    torch.set_num_threads(1)
    device = torch.device(cfg.rollout_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(cfg.rollout_device), store=join_store("127.0.0.1", port, 2, 120.0), rank=1,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    w = torch.randn(cfg.dim, cfg.dim, device=device)
    weights = torch.empty(cfg.sync_mb << 20, dtype=torch.uint8, device=device)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                return
            if cmd == "sync":
                dist.broadcast(weights, src=0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                conn.send(("synced", None))
            elif cmd == "rollout":
                share = arg
                start = time.time()
                finish = decode(share, w, cfg)
                conn.send(("rollout", (start, time.time(), finish, share)))
    finally:
        dist.destroy_process_group()


def _recv(conn, proc, timeout_s: float = 300.0):
    """The worker's reply; an error instead of a hang when the worker died or stalled."""
    deadline = time.time() + timeout_s
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the rollout worker exited with code {proc.exitcode}")
        if time.time() > deadline:
            raise TimeoutError(f"the rollout worker did not answer within {timeout_s} s")
    return conn.recv()


def run(cfg: StubConfig, telemetry: str | os.PathLike) -> list[dict]:
    """Run ``cfg.steps`` steps, write telemetry rows to ``telemetry`` and return them."""
    import torch
    import torch.distributed as dist

    from rlplacement.rendezvous import host_store
    from rlplacement.telemetry import StepRecorder

    torch.set_num_threads(1)
    device = torch.device(cfg.trainer_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu_devices = {role: [torch.device(d).index or 0] for role, d in
                   (("trainer", cfg.trainer_device), ("rollout", cfg.rollout_device)) if d.startswith("cuda")}
    tel = StepRecorder(telemetry, trainer_gpus=cfg.trainer_gpus, rollout_gpus=cfg.rollout_gpus,
                       rollout_gpus_per_engine=cfg.gpus_per_engine, colocate=cfg.colocate,
                       num_gpus_per_node=cfg.num_gpus_per_node, transfer_mode="broadcast", max_response_len=cfg.max_len,
                       gpu_devices=gpu_devices)
    sync_numel = cfg.sync_mb << 20
    store, port = host_store("127.0.0.1", 2, 120.0)  # bound before the worker starts: no port race
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, port, cfg), daemon=True)
    proc.start()
    rows = []
    try:
        dist.init_process_group(_backend(cfg.trainer_device), store=store, rank=0,
                                world_size=2, timeout=datetime.timedelta(seconds=120))
        weights = torch.randint(0, 255, (sync_numel,), dtype=torch.uint8, device=device)
        w = torch.randn(cfg.dim, cfg.dim, device=device)

        def dispatch(step: int) -> int:
            handle = tel.open("rollout")
            parent.send(("rollout", engine_share(sample_lengths(cfg, step), cfg.num_engines)))
            return handle

        def collect(handle: int) -> None:
            _, (start, end, finish, share) = _recv(parent, proc)
            tel.close(handle, end=end)
            tel.record_samples(share, finish)

        def sync() -> None:
            with tel.phase("sync"):
                parent.send(("sync", None))
                dist.broadcast(weights, src=0)
                _recv(parent, proc)  # the engine has the weights

        def train(step: int) -> None:
            tokens = sum(sample_lengths(cfg, step))
            with tel.phase("train"):
                _matmul_rows(cfg.train_rows_per_token * tokens // cfg.trainer_gpus, w)

        handle = dispatch(0)
        for step in range(cfg.steps):
            collect(handle)
            sync()
            if not cfg.colocate:
                # one-step-off: the next batch generates during training (also after the last
                # step, so every step sees the same overlap; that batch is drained unrecorded)
                handle = dispatch(step + 1)
            train(step)
            rows.append(tel.end_step(step))
            if cfg.colocate and step + 1 < cfg.steps:
                handle = dispatch(step + 1)
        if not cfg.colocate:
            _recv(parent, proc)
        parent.send(("stop", None))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows
