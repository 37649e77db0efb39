"""The peers we are measured against, as Ray actors on the same GPUs and model as our own run.

* ``vllm_nccl``: vLLM 0.26's own NCCL weight-transfer backend. Trainer side: the static
  ``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights`` (0.26 has no trainer class);
  engine side: ``LLM(weight_transfer_config={"backend": "nccl"})`` with ``start_weight_update()``
  -> ``update_weights({"update_info": names, dtype_names, shapes, packed})`` ->
  ``finish_weight_update()`` (layerwise reload around a ``load_weights`` per tensor or per chunk).
* ``per_tensor_ipc``: the colocated baseline: one CUDA IPC handle per tensor, each rebuilt in the
  engine's worker and passed to ``model.load_weights`` (what a loop without packing does).
* ``vllm_ipc`` / ``vllm_ipc_packed``: vLLM 0.26's own IPC weight-transfer backend. Engine:
  ``LLM(weight_transfer_config={"backend": "ipc"})``, ``start_weight_update()`` -> one ``update_weights``
  per payload -> ``finish_weight_update()`` (layerwise reload around ``load_weights``); trainer: the static
  ``IPCWeightTransferEngine.trainer_send_weights(iterator, IPCTrainerSendWeightsArgs(send_mode="ray",
  llm_handle=engine actor, packed=...))``, which calls the engine actor's ``update_weights`` itself. Unpacked:
  one handle per tensor, all in one call; packed: tensors copied into one reused buffer, one call per
  buffer. Its handles carry torch classes and dtypes, which vLLM's engine-core messages pass only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM's own Ray IPC example sets it the same way).

The split run checks the NCCL peer on tensors vLLM keeps unfused (embedding, final norm, every
``down_proj``). The colocated run checks every served parameter: the trainer perturbs its weights and
builds what vLLM should serve from them (``served_views``: q/k/v and gate/up concatenated, experts
stacked), and each checksum must equal the engine's after the update.

The peer engine reaches its workers by method name (:class:`PeerWorkerExtension`, vLLM's
``worker_extension_cls``), as rlplacement's engine does: nothing is pickled into vLLM's engine core.
"""

from __future__ import annotations

import os
import time

from rlplacement.transfer.base import tensor_checksum

UNFUSED = ("model.embed_tokens.weight", "model.norm.weight")


def _unfused(name: str) -> bool:
    return name in UNFUSED or name.endswith("mlp.down_proj.weight")


class PeerTrainer:
    """Holds the model's HF tensors on its GPU, as a trainer would after a step."""

    def __init__(self, model_dir: str):
        import torch
        from safetensors.torch import load_file

        self.tensors = {n: t.to("cuda") for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        self.group = None
        torch.cuda.synchronize()

    def layout(self) -> dict:
        return {"names": list(self.tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in self.tensors.values()],
                "shapes": [list(t.shape) for t in self.tensors.values()],
                "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
                "max_tensor_bytes": max(t.numel() * t.element_size() for t in self.tensors.values())}

    def perturb(self) -> dict[str, str]:
        self._add_noise()
        return {n: tensor_checksum(t) for n, t in self.tensors.items() if _unfused(n)}

    def _add_noise(self) -> None:
        """A relative change of about 1% per element: above bf16's spacing (0.4% of a value), so norms near
        1.0 change too, where an absolute 1e-3 would round back to the same bytes and check nothing."""
        import torch

        with torch.no_grad():
            for t in self.tensors.values():
                t.mul_(1 + 0.01 * torch.randn_like(t))

    def nccl_init(self, host: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.group = NCCLWeightTransferEngine.trainer_init({"master_address": host, "master_port": port,
                                                            "world_size": world_size})

    def nccl_send(self, packed: bool) -> float:
        import torch
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        t0 = time.perf_counter()
        NCCLWeightTransferEngine.trainer_send_weights(iter(self.tensors.items()), {"group": self.group, "packed": packed})
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def perturb_served(self) -> dict[str, str]:
        """Perturb every tensor, then the checksums of what vLLM should serve from them (``served_views``),
        one fused parameter built at a time (a transient of one layer's experts at most)."""
        import torch

        import served_views

        self._add_noise()
        out = {}
        for served, (kind, members) in served_views.served_groups(list(self.tensors)).items():
            out[served] = tensor_checksum(served_views.build(kind, members, self.tensors))
        torch.cuda.empty_cache()
        return out

    def vllm_ipc_send(self, engine, packed: bool, buffer_bytes: int) -> float:
        """vLLM's trainer side, unchanged: it calls ``engine.update_weights`` (a Ray actor) per payload and
        returns once the engine loaded each. Seconds inside this call."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

        t0 = time.perf_counter()
        IPCWeightTransferEngine.trainer_send_weights(
            iter(self.tensors.items()),
            IPCTrainerSendWeightsArgs(send_mode="ray", llm_handle=engine, packed=packed,
                                      packed_buffer_size_bytes=buffer_bytes))
        return time.perf_counter() - t0

    def ipc_handles(self) -> list:
        """One (name, pickled CUDA IPC rebuild args) per tensor."""
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        return [(n, pickle.dumps(reduce_tensor(t))) for n, t in self.tensors.items()]


class PeerEngine:
    """A vLLM engine with vLLM's own transfer machinery (or none, for the IPC baseline)."""

    def __init__(self, model_dir: str, backend: str | None, **llm_kwargs):
        from vllm import LLM

        kwargs = dict(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                      worker_extension_cls=PEER_WORKER_EXTENSION, **llm_kwargs)
        if backend:
            kwargs["weight_transfer_config"] = {"backend": backend}
        if backend == "ipc":  # the engine-core process inherits it (see the module docstring)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.llm = LLM(**kwargs)

    def nccl_init(self, host: str, port: int, world_size: int) -> None:
        self.llm.init_weight_transfer_engine({"init_info": {"master_address": host, "master_port": port,
                                                            "rank_offset": 1, "world_size": world_size}})

    def nccl_update(self, layout: dict, packed: bool) -> dict:
        t0 = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"names": layout["names"], "dtype_names": layout["dtype_names"],
                                                 "shapes": layout["shapes"], "packed": packed}})
        t1 = time.perf_counter()
        self.llm.finish_weight_update()
        t2 = time.perf_counter()
        self.llm.reset_prefix_cache()
        return {"receive": t1 - t0, "load": t2 - t1}

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: dict) -> None:
        """What vLLM's ``trainer_send_weights(send_mode="ray")`` calls on the engine's actor."""
        self.llm.update_weights(request)

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()

    def ipc_update(self, handles: list) -> dict:
        t0 = time.perf_counter()
        self.llm.collective_rpc("peer_load_from_handles", args=(handles,))
        self.llm.reset_prefix_cache()
        return {"load": time.perf_counter() - t0}

    def unfused_checksums(self) -> dict[str, str]:
        return self.llm.collective_rpc("peer_unfused_checksums")[0]

    def served_checksums(self) -> dict[str, str]:
        return self.llm.collective_rpc("peer_served_checksums")[0]

    def shutdown(self) -> None:
        """vLLM's engine core ended before the actor is killed, so its process frees the GPU before the next
        engine starts on it (killing the actor alone can leave the core's process holding memory a while)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


PEER_WORKER_EXTENSION = f"{__name__}.PeerWorkerExtension"
"""Importable in vLLM's processes: common.py puts this folder on their PYTHONPATH."""


class PeerWorkerExtension:
    """The peers' worker calls; vLLM mixes this into each worker, so ``self`` is the worker."""

    def peer_load_from_handles(self, handles: list) -> None:
        """Each (name, pickled CUDA IPC rebuild args) -> ``model.load_weights``, one tensor at a time (the
        baseline's own data: the trainer pickled the handles for it)."""
        import pickle

        import torch

        model = self.model_runner.get_model()
        for name, blob in handles:
            rebuild, args = pickle.loads(blob)
            model.load_weights([(name, rebuild(*args))])
        torch.cuda.synchronize()

    def peer_unfused_checksums(self) -> dict[str, str]:
        model = self.model_runner.get_model()
        return {n: tensor_checksum(p) for n, p in model.named_parameters() if _unfused(n)}

    def peer_served_checksums(self) -> dict[str, str]:
        """Every served parameter (vLLM's names), as the colocated check compares them."""
        return {n: tensor_checksum(p) for n, p in self.model_runner.get_model().named_parameters()}
