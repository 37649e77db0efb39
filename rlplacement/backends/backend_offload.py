"""A trainer backend's weights and optimizer state moved to host memory and back (``--offload-train``), so
colocated engines can use the GPU between steps, and the host memory that takes, reserved at start.

Mixed into :class:`~.base.TrainerBackend`, whose parameters (``_parameters``), ``device``, ``optimizer`` and
``reference`` it reads. Invariants: the tensors keep their identity (an offload resizes their storages in
place, :class:`~.offload.HostOffload`), so views and the direct path's addresses survive a round trip;
gradients are dropped, not moved; a backend whose framework holds more state (megatron's DDP buffers and
main parameters) says so through :meth:`_resident_tensors`, :meth:`_dropped_tensors` and
:meth:`_torch_optimizers`.
"""

from __future__ import annotations

import time

import torch


class BackendHostOffload:
    """:meth:`offload_to_host`, :meth:`reload_from_host` and the host memory they need."""

    def offload_to_host(self) -> dict[str, float]:
        """Move weights and optimizer state to host memory and drop the gradients (``--offload-train``),
        so colocated engines can use the GPU; :meth:`reload_from_host` before the next step or gather.
        Works on any device (on CPU it only proves the round trip); the job calls it on GPUs only."""
        from rlplacement.backends.offload import HostOffload

        start = time.perf_counter()
        if getattr(self, "_host_offload", None) is None:
            self._host_offload = HostOffload()
        for p in self._parameters():
            p.grad = None  # the next step starts from None anyway
        tensors, drop = self._resident_tensors(), self._dropped_tensors()
        prepared = time.perf_counter() - start
        return {**self._host_offload.offload(tensors, drop, self._frozen_tensors()), "prepare_seconds": prepared}

    def _frozen_tensors(self) -> list[torch.Tensor]:
        """Tensors nothing writes during the run: parameters that train nothing (LoRA's base) and the KL
        reference. Those of them the offload moves (:meth:`_resident_tensors`) go to host once
        (``HostOffload.offload``'s ``frozen``)."""
        frozen = [p for p in self._parameters() if not p.requires_grad]
        return frozen + (list(self.reference.parameters()) if self.reference is not None else [])

    def reserve_host_memory(self) -> dict[str, float]:
        """Make and pin, now, the host buffer every later :meth:`offload_to_host` uses: sized for the
        weights and optimizer state as they will be after the first optimizer step
        (:meth:`host_state_bytes`), so no step pays for pinning. Returns its seconds and bytes."""
        from rlplacement.backends.offload import HostOffload

        if getattr(self, "_host_offload", None) is None:
            self._host_offload = HostOffload()
        return self._host_offload.reserve(self.host_state_bytes(), pin=self.device.type == "cuda")

    def host_state_bytes(self) -> int:
        """Bytes :meth:`offload_to_host` will move once the optimizer has its state: what is resident now,
        plus the state torch's AdamW (two moments like each parameter; three with amsgrad; its float32 step
        counter where it lives on the training device), SGD with momentum (one buffer) or the FusedAdam
        megatron uses on a GPU (TransformerEngine's: two moments in its ``exp_avg_dtype``s, plus master copies
        with ``master_weights``; apex's: two like the parameter) makes at its first step for each parameter
        that has none yet. Another optimizer's state is counted once it exists."""
        from rlplacement.backends.offload import unique_storages

        total = sum(s.nbytes() for s in unique_storages(self._resident_tensors()).values())
        for opt in self._torch_optimizers():
            total += self._state_to_come(opt)
        return total

    def _torch_optimizers(self) -> list:
        """The torch optimizers holding this backend's optimizer state (none before it is built)."""
        return [] if self.optimizer is None else [self.optimizer]

    def _state_to_come(self, opt) -> int:
        """Bytes of optimizer state ``opt`` will create at its first step (see :meth:`host_state_bytes`)."""
        from rlplacement.backends.offload import local_tensor

        total = 0
        for group in opt.param_groups:
            per_param, counter, fixed_bytes = 0, 0, None  # moments like the parameter, or bytes per element
            if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                per_param = 3 if group.get("amsgrad") else 2
                # the step counter is a CPU scalar unless fused or capturable: on the device where that is
                on_device = group.get("fused") or group.get("capturable") or self.device.type == "cpu"
                counter = 4 if on_device else 0
            elif isinstance(opt, torch.optim.SGD) and group.get("momentum", 0):
                per_param = 1
            elif type(opt).__name__ == "FusedAdam":  # megatron's Adam on a GPU: TransformerEngine's (or apex's)
                if hasattr(opt, "exp_avg_dtype"):  # TE: moments in their own dtypes, fp32 master copies if asked
                    fixed_bytes = opt.exp_avg_dtype.itemsize + opt.exp_avg_sq_dtype.itemsize + (
                        getattr(opt, "master_weight_dtype", torch.float32).itemsize if opt.master_weights else 0)
                else:
                    per_param = 2
            for p in group["params"]:
                local = local_tensor(p)
                if self._stepped_by(p) and not opt.state.get(p) and local.device == self.device:
                    element = local.element_size() * per_param if fixed_bytes is None else fixed_bytes
                    total += element * local.numel() + counter
        return total

    def _stepped_by(self, param) -> bool:
        """Whether the optimizer will make state for ``param`` (torch's: one that gets gradients)."""
        return param.requires_grad

    @property
    def offloaded_to_host(self) -> bool:
        host = getattr(self, "_host_offload", None)
        return host is not None and host.offloaded

    def reload_from_host(self) -> dict[str, float]:
        host = getattr(self, "_host_offload", None)
        return host.reload() if host is not None else {"seconds": 0.0, "bytes": 0.0}

    def _dropped_tensors(self) -> list[torch.Tensor]:
        """Device buffers an offload frees without copying (the next step rewrites them before reading)."""
        return []

    def _resident_tensors(self) -> list[torch.Tensor]:
        """Parameters and optimizer state on the training device (the optimizer's CPU step counters stay)."""
        from rlplacement.backends.offload import local_tensor

        tensors = list(self._parameters())
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
        device = self.device
        return [t for t in tensors if local_tensor(t).device == device]
