"""``rlplacement bench --mode MODE [--size-mb S] [--num-tensors T] [--json]``.

Real updates of a Qwen3-shaped model built from a config (random bf16 weights, HF names and
order) from this process to a receiver in a second process, over the mode's real transport,
next to the ceiling: the raw transfer of the same bytes on the same transport, measured in the
same run. One row per mode (docs/transfer/README.md, "Measuring a mode"):
``{"mode", "bytes", "num_tensors", "seconds", "gbps", "ceiling", "ceiling_gbps", "ratio"}``.

The receiver stages and commits into a no-op loader: this measures the wire and the staging,
not an engine's own load (which the vLLM tests time separately). Seconds are the median of
``--repeats`` timed updates after one warm-up, each from the first byte to the receiver's ack;
the ceiling and the modes take turns within each round so that other load hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

# each mode names its ceiling (``ModeSpec.bench``): one flat broadcast on the same transport, one raw
# copy of the same bytes on the sender's device (a colocated mode moves bytes by copying through shared
# memory), or one raw Mooncake batch write of the same bytes (same slices) between the same processes
CEILING_NAMES = {"broadcast": "flat broadcast", "copy": "raw in-memory copy", "mooncake": "raw Mooncake write"}


def bench_modes() -> tuple[str, ...]:
    """Every registered mode with a benchmark (its spec's ``bench``), in registration order."""
    from rlplacement.transfer import registry

    return tuple(name for name, s in registry.specs().items() if s.bench is not None)


def _bench_spec(mode: str):
    from rlplacement.transfer import registry

    return registry.spec(mode).bench


def qwen3_shaped_tensors(size_mb: float, num_tensors: int, *, seed: int = 0):
    """HF-named bf16 tensors of a Qwen3 model whose config is chosen to give about ``num_tensors``
    tensors (11 per layer + 3) and about ``size_mb`` MB."""
    import torch
    import transformers

    layers = max(1, round((num_tensors - 3) / 11))
    target = size_mb * 1e6

    def shape_for(hidden: int) -> dict:
        heads = max(1, hidden // 128)
        kv = max(1, heads // 4)
        vocab = 32000 if 2 * 32000 * hidden * 2 < target / 2 else 4096
        return dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                    num_key_value_heads=kv, head_dim=128, vocab_size=vocab, num_hidden_layers=layers)

    def nbytes(c: dict) -> int:
        h, q, kv = c["hidden_size"], c["num_attention_heads"] * 128, c["num_key_value_heads"] * 128
        per_layer = h * (2 * q + 2 * kv) + 3 * h * c["intermediate_size"] + 2 * h + 2 * 128
        return 2 * (layers * per_layer + 2 * c["vocab_size"] * h + h)

    hidden = min((128 * k for k in range(1, 129)), key=lambda h: abs(nbytes(shape_for(h)) - target))
    shape = shape_for(hidden)
    # then the MLP width, which moves the size in steps of 6 x hidden bytes per layer, to land on the size asked
    fixed = nbytes({**shape, "intermediate_size": 0})
    shape["intermediate_size"] = max(16, round((target - fixed) / (2 * layers * 3 * hidden)))
    cfg = transformers.Qwen3Config(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(p.shape, generator=g, dtype=torch.float32).to(torch.bfloat16))
            for name, p in meta_model.named_parameters()]


class _Served:
    """cuda_ipc's receiver commits into tensors of its own, as an engine loads its parameters: the
    direct path's one copy happens at commit, so a commit that copies nothing would time no bytes."""

    def __init__(self):
        self.tensors: list | None = None

    def load(self, staged) -> None:
        import torch

        if self.tensors is None:
            self.tensors = [torch.empty_like(t) for _, t in staged]
        torch._foreach_copy_(self.tensors, [t for _, t in staged])


def _receiver_main(conn, device: str, extra_specs: tuple = ()) -> None:
    """Child process: join groups on command, then do one transfer per "go" and ack it (after the
    device has finished it, for CUDA). ``extra_specs``: modes the parent registered beyond the built-in
    ones, registered here too."""
    import torch

    from rlplacement.rendezvous import join_store
    from rlplacement.transfer import group as groups
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import TransferEndpoint

    for extra in extra_specs:
        if extra.name not in registry.specs():
            registry.register_mode(extra)

    torch.set_num_threads(1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    joined: dict = {}
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            for kind, obj, _ in joined.values():
                obj.close()
            return
        if cmd[0] == "join":
            _, key, endpoint, nbytes = cmd
            if endpoint.get("mode") == "raw_mooncake":  # the p2p ceiling: a registered buffer, written to
                from rlplacement.transfer.p2p.mooncake import MooncakeEngine

                engine = MooncakeEngine("127.0.0.1", endpoint["protocol"])
                buf = torch.zeros(nbytes, dtype=torch.uint8)  # pre-faulted
                joined[key] = ("none", engine, buf)
                conn.send(("joined", engine.session, engine.register(buf)))
                continue
            e = TransferEndpoint.from_dict(endpoint)
            if e.mode == "raw":
                grp = groups.TransferGroup(join_store(e.host, e.port, 2, e.timeout_s), e.group_name, 1, 2,
                                           e.backend, device, e.timeout_s)
                buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # pre-faulted
                joined[key] = ("raw", grp, buf)
            else:
                receiver = registry.receiver_class(e.mode)(device)
                receiver.connect(e, 1)
                joined[key] = ("mode", receiver, _Served() if registry.spec(e.mode).bench.copies_at_commit else None)
            conn.send("joined")
        elif cmd[0] == "go":
            _, key, version = cmd
            kind, obj, buf = joined[key]
            if kind == "none":
                pass  # the sender's write is synchronous: nothing to do here
            elif kind == "raw":
                obj.broadcast(buf)
            else:
                obj.begin(version)
                obj.receive()
                obj.commit(buf.load if buf is not None else (lambda staged: None))
            sync()
            conn.send("ok")


class Bench:
    """A receiver process holding one group per contender; contenders take turns each repeat, so
    a busy machine slows them alike."""

    def __init__(self, timeout_s: float = 60.0, device: str = "cpu", *, same_device: bool = False,
                 extra_specs: tuple = ()):
        """``device``: where the sender's tensors live (cpu: gloo; cuda: NCCL, receiver on the
        next GPU when there is one, or on the same GPU with ``same_device``, as for cuda_ipc)."""
        import multiprocessing as mp

        import torch

        self.device = device
        recv_device = device
        if device.startswith("cuda"):
            self.device = "cuda:0"
            recv_device = "cuda:0" if same_device else f"cuda:{1 % torch.cuda.device_count()}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, recv_device, extra_specs), daemon=True)
        self.proc.start()
        self.timeout_s = timeout_s
        self._send: dict[str, Callable[[int], None]] = {}
        self._closers: list[Callable[[], None]] = []
        self._local: set[str] = set()  # contenders timed in this process alone (no receiver involved)
        self.paths: dict[str, str] = {}  # each mode's last update: "buckets" or "direct"
        self.fallbacks: dict[str, str] = {}  # each mode's last update: why it did not go in place ("" if it did)
        self.senders: dict = {}

    def _ack(self) -> None:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"receiver process gave no answer within {self.timeout_s}s")
        msg = self.conn.recv()
        if msg not in ("ok", "joined"):
            raise RuntimeError(f"receiver: {msg}")

    def add_mode(self, mode: str, named, bucket_bytes: int) -> None:
        from rlplacement.transfer import registry

        sender = registry.sender_class(mode)(bucket_bytes, timeout_s=self.timeout_s, device=self.device)
        sender.keep_mapped_between_updates()  # as a trainer actor runs it: engines keep the mappings
        endpoint = sender.listen(2, host="127.0.0.1")
        self.conn.send(("join", mode, endpoint.to_dict(), 0))
        sender.connect()
        self._ack()
        # the bench's tensors are its own, unchanged while a transfer runs: resident, as a trainer's parameters
        resident = _bench_spec(mode).resident

        def send(version: int) -> None:
            report = sender.update(version, named, resident=resident)
            self.paths[mode] = report.path
            self.fallbacks[mode] = report.fallback

        self._send[mode] = send
        self.senders[mode] = sender
        self._closers.append(sender.close)

    def add_ceiling(self, key: str, nbytes: int) -> None:
        """The ceiling: one broadcast of one flat buffer of ``nbytes`` on the same transport."""
        import uuid

        import torch

        from rlplacement.rendezvous import host_store
        from rlplacement.transfer import group as groups

        backend = groups.backend_for(self.device)
        store, port = host_store("127.0.0.1", 2, self.timeout_s)
        name = uuid.uuid4().hex[:12]
        self.conn.send(("join", key, {"mode": "raw", "host": "127.0.0.1", "port": port, "world_size": 2,
                                      "backend": backend, "group_name": name, "timeout_s": self.timeout_s}, nbytes))
        grp = groups.TransferGroup(store, name, 0, 2, backend, self.device, self.timeout_s)
        self._ack()
        buf = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        self._send[key] = lambda _: grp.broadcast(buf)
        self._closers.append(grp.close)

    def add_mooncake_ceiling(self, key: str, nbytes: int, protocol: str = "tcp") -> None:
        """The ceiling of p2p: one raw Mooncake batch write of ``nbytes`` (in the mode's slices) from a
        registered buffer here into a registered buffer in the receiver process."""
        import torch

        from rlplacement.transfer.p2p.mooncake import SLICE_BYTES, MooncakeEngine

        self.conn.send(("join", key, {"mode": "raw_mooncake", "protocol": protocol}, nbytes))
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"receiver process gave no answer within {self.timeout_s}s")
        _, session, dst = self.conn.recv()
        engine = MooncakeEngine("127.0.0.1", protocol)
        src = torch.ones(nbytes, dtype=torch.uint8)
        ptr = engine.register(src)
        offsets = list(range(0, nbytes, SLICE_BYTES))
        lens = [min(SLICE_BYTES, nbytes - o) for o in offsets]

        def write(_, src=src):  # holds the registered buffer for as long as the contender lives
            rc = engine.te.batch_transfer_sync_write(session, [ptr + o for o in offsets], [dst + o for o in offsets], lens)
            if rc != 0:
                raise RuntimeError(f"raw Mooncake write returned {rc}")

        self._send[key] = write
        self._closers.append(engine.close)

    def add_copy_ceiling(self, key: str, nbytes: int) -> None:
        """The ceiling of the colocated path: one raw copy of ``nbytes`` between two buffers on the
        sender's device (numpy's single-threaded memcpy on CPU, as packing uses; a device copy on CUDA)."""
        import torch

        src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)  # pre-faulted
        if src.device.type == "cpu":
            import numpy as np

            src_np, dst_np = src.numpy(), dst.numpy()
            self._send[key] = lambda _: np.copyto(dst_np, src_np)
        else:
            self._send[key] = lambda _: (dst.copy_(src), torch.cuda.synchronize(src.device))
        self._local.add(key)

    def time_all(self, repeats: int) -> dict[str, list[float]]:
        """Seconds per contender and round (first byte to the receiver's ack), ``repeats`` rounds after
        one warm-up round (allocations, page faults); every round runs each contender once, in turn."""
        times: dict[str, list[float]] = {key: [] for key in self._send}
        for version in range(1, repeats + 2):
            for key, send in self._send.items():
                start = time.perf_counter()
                if key in self._local:
                    send(version)
                else:
                    self.conn.send(("go", key, version))  # first: the receiver must be listening
                    send(version)
                    self._ack()
                times[key].append(time.perf_counter() - start)
        return {key: t[1:] for key, t in times.items()}

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        for close in self._closers:
            close()


def resolve_device(device: str) -> tuple[str, str]:
    """(device of the broadcast modes, device of cuda_ipc) for ``--device auto|cpu|cuda``.

    ``auto`` measures the GPU path where there is one: NCCL GPU 0 -> GPU 1 needs two GPUs (NCCL
    refuses two ranks on one GPU), so with one GPU the broadcast modes stay on gloo while
    cuda_ipc runs on the GPU; every row says which transport it measured.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return ("cuda" if gpus >= 2 else "cpu"), ("cuda" if gpus >= 1 else "cpu")
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible here; use --device cpu or auto")
    return device, device


def run(modes: list[str], *, size_mb: float, num_tensors: int, bucket_bytes: int, repeats: int,
        device: str = "cpu") -> list[dict]:
    """One row per mode, in ``modes`` order. The colocated mode runs in its own receiver process on
    the sender's device (NCCL refuses two ranks on one GPU), next to its own ceiling."""
    named = qwen3_shaped_tensors(size_mb, num_tensors)
    wire_device, same_device = resolve_device(device)
    rows: dict[str, dict] = {}
    # each mode's spec says where its tensors live: the broadcast device, its own (colocated) device, or the
    # host (p2p: the Mooncake build installed here is the CPU one, mooncake tcp)
    for where, dev in (("wire", wire_device), ("same", same_device), ("cpu", "cpu")):
        group = [m for m in modes if _bench_spec(m).device == where]
        if group:
            rows.update(_run_group(group, named, bucket_bytes=bucket_bytes, repeats=repeats, device=dev,
                                   same_device=where == "same"))
    return [rows[m] for m in modes]


def _run_group(modes: list[str], named, *, bucket_bytes: int, repeats: int, device: str,
               same_device: bool) -> dict[str, dict]:
    from rlplacement.transfer import registry

    extra = tuple(registry.spec(m) for m in modes if registry.spec(m).sender.partition(":")[0].rpartition(".")[0]
                  not in registry.BUILTIN_PACKAGES)
    bench = Bench(device=device, same_device=same_device, extra_specs=extra)
    named = [(n, t.to(bench.device)) for n, t in named]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    try:
        for key in dict.fromkeys(_bench_spec(m).ceiling for m in modes):
            {"broadcast": bench.add_ceiling, "copy": bench.add_copy_ceiling,
             "mooncake": bench.add_mooncake_ceiling}[key](key, nbytes)
        for mode in modes:
            bench.add_mode(mode, named, bucket_bytes)
        rounds = bench.time_all(repeats)
        rows = {}
        for mode in modes:
            ceiling = rounds[_bench_spec(mode).ceiling]
            seconds, ceiling_seconds = statistics.median(rounds[mode]), statistics.median(ceiling)
            # each round's run over its own ceiling run, moments apart: the spread says how far one number
            # can be trusted on a shared machine (the ceiling alone varies from round to round there)
            paired = sorted(c / m for c, m in zip(ceiling, rounds[mode]))
            rows[mode] = {"mode": mode, "bytes": nbytes, "num_tensors": len(named), "seconds": seconds,
                          "gbps": nbytes / seconds / 1e9, "ceiling": ceiling_name(mode, bench.device),
                          "ceiling_gbps": nbytes / ceiling_seconds / 1e9, "ratio": ceiling_seconds / seconds,
                          "ratio_per_round_quartiles": [paired[len(paired) // 4], statistics.median(paired),
                                                        paired[(3 * len(paired)) // 4]],
                          "buffer_size": bucket_bytes, "transport": transport_of(mode, bench.device)}
            if _bench_spec(mode).resident:  # it may read them in place: which path it took (cuda_ipc: buckets or direct)
                rows[mode].update(path=bench.paths[mode], direct_refusal=bench.fallbacks[mode])
        return rows
    finally:
        bench.close()


def transport_of(mode: str, device: str) -> str:
    """What a row measured, by the sender's device type (the mode's spec: gloo or nccl for the broadcast
    modes, shared memory or cuda ipc for cuda_ipc, mooncake tcp for p2p)."""
    return _bench_spec(mode).transport["cuda" if device.startswith("cuda") else "cpu"]


def ceiling_name(mode: str, device: str) -> str:
    ceiling = _bench_spec(mode).ceiling
    if ceiling == "copy" and device.startswith("cuda"):
        return "raw in-GPU copy"
    return CEILING_NAMES[ceiling]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="time weight-transfer modes against the raw transport")
    p.add_argument("--mode", default="all", help="a mode with a benchmark (broadcast, broadcast_packed, cuda_ipc, "
                                                 "p2p, or one registered with a bench), or all (default)")
    p.add_argument("--size-mb", type=float, default=400.0, help="model size in MB (bf16)")
    p.add_argument("--num-tensors", type=int, default=311, help="about this many tensors (11 per layer + 3)")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="bucket size in MB (--update-weight-buffer-size for the packed mode)")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per mode, after one warm-up")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): the GPU path where there are GPUs (NCCL GPU 0 -> GPU 1 with two, "
                        "cuda_ipc on GPU 0), else cpu (gloo; cuda_ipc over /dev/shm); each row names its transport")
    p.add_argument("--json", action="store_true", help="one JSON object per mode")


def main(args: argparse.Namespace) -> int:
    from rlplacement.errors import CliError

    known = bench_modes()
    modes = list(known) if args.mode == "all" else [args.mode]
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise CliError(f"--mode {unknown[0]!r} has no benchmark: use one of {', '.join(known)} or all")
    for flag, value in (("--size-mb", args.size_mb), ("--num-tensors", args.num_tensors),
                        ("--bucket-mb", args.bucket_mb), ("--repeats", args.repeats)):
        if value <= 0:
            raise CliError(f"{flag} must be positive, got {value}")
    try:
        rows = run(modes, size_mb=args.size_mb, num_tensors=args.num_tensors,
                   bucket_bytes=int(args.bucket_mb * 1e6), repeats=args.repeats, device=args.device)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['mode']:>17}: {row['bytes'] / 1e6:.1f} MB (asked {args.size_mb:g}) in {row['num_tensors']} tensors, "
                  f"{row['seconds']:.3f} s, {row['gbps']:.2f} GB/s = {row['ratio']:.0%} of {row['ceiling']} "
                  f"({row['ceiling_gbps']:.2f} GB/s) over {row['transport']}")
    return 0
