"""Stand-ins for the two kinds of verl worker a checkpoint-engine backend lives in, reduced to what verl 0.9.1
does with the engine (``verl/workers/engine_workers.py`` ActorRolloutRefWorker and
``verl/checkpoint_engine/base.py`` CheckpointEngineWorker): build it through verl's registry after
importing ``custom_backend_module``, run the manager's ``execute_checkpoint_engine`` calls, and per
update hand it the HF-named tensors (trainer) or consume its async generator (rollout)."""

from __future__ import annotations

CUSTOM_BACKEND_MODULE = "rlplacement.integrations.verl"


def _new_engine(backend: str, bucket_size: int, engine_kwargs: dict, **extra):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(CUSTOM_BACKEND_MODULE)
    return CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **extra, **engine_kwargs)


class StandInVerlTrainerRank:
    """One rank of verl's actor worker group; every rank holds the same full HF weights."""

    def __init__(self, rank: int, model_dir: str, backend: str, bucket_size: int, engine_kwargs: dict):
        import torch

        torch.set_num_threads(1)
        self.rank, self.model_dir = rank, model_dir
        self.use_backend(backend, bucket_size, engine_kwargs)

    def use_backend(self, backend: str, bucket_size: int, engine_kwargs: dict) -> None:
        """A new engine of ``backend`` on the weights as saved: the worker as freshly started, without
        a process start (each costs seconds of CI)."""
        from safetensors.torch import load_file

        self.weights = load_file(f"{self.model_dir}/model.safetensors")
        self.engine = _new_engine(backend, bucket_size, engine_kwargs, is_master=(self.rank == 0))
        self.yielded = 0

    def perturb(self, seed: int) -> None:
        """One optimizer step's worth of change, the same on every rank; half the tensors move."""
        import torch

        g = torch.Generator().manual_seed(seed)
        for i, name in enumerate(sorted(self.weights)):
            if (i + seed) % 2 == 0:
                t = self.weights[name]
                self.weights[name] = t + (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype)

    def state(self) -> dict:
        return self.weights

    def execute_checkpoint_engine(self, method: str, **kwargs):
        return getattr(self.engine, method)(**kwargs)

    async def update_weights(self, global_steps: int | None, fail_after: int | None = None) -> dict:
        """``fail_after``: the trainer's own gather raises after that many tensors (a source failure)."""
        def per_tensor_param():
            for name, tensor in self.weights.items():
                if fail_after is not None and self.yielded == fail_after:
                    raise RuntimeError(f"gather failed after {fail_after} tensors")
                self.yielded += 1
                yield name, tensor

        self.yielded = 0
        metrics = await self.engine.send_weights(per_tensor_param(), global_steps=global_steps)
        return {"metrics": metrics or {}, "yielded": self.yielded}


class StandInVerlRolloutWorker:
    """verl's CheckpointEngineWorker: the engine is built without ``is_master``."""

    def __init__(self, backend: str, bucket_size: int, engine_kwargs: dict):
        import torch

        torch.set_num_threads(1)
        self.use_backend(backend, bucket_size, engine_kwargs)

    def use_backend(self, backend: str, bucket_size: int, engine_kwargs: dict) -> None:
        """A new engine of ``backend``, in no group: the worker as freshly started."""
        self.engine = _new_engine(backend, bucket_size, engine_kwargs)

    def execute_checkpoint_engine(self, method: str, **kwargs):
        return getattr(self.engine, method)(**kwargs)

    async def update_weights(self, global_steps: int | None) -> dict:
        """What verl's vLLM adapter does: copy each yielded tensor out as it arrives."""
        received = {}
        async for name, tensor in self.engine.receive_weights(global_steps=global_steps):
            received[name] = tensor.clone()
        return received
