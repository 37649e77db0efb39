"""Rollout engines as Ray actors. Construction lives in :func:`create_engine_actor` only, so the
placement layer's options (``RayPlacement.engine_options(i)``) plug in at one place."""

from __future__ import annotations

from typing import Any

# vLLM's engine core runs in its own process where CUDA is (as in production); VllmRolloutEngine
# keeps it in-process on CPU only, where a separate process costs ~35 s of start-up per engine.
DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def create_engine_actor(index: int, model_dir: str, *, options: dict | None = None, **engine_kwargs: Any):
    """Start engine ``index`` as a Ray actor; ``options`` are ``.options(**options)`` from placement.

    Without placement options the actor takes no CPU reservation (tests on 2 cores start several).
    """
    import ray

    from rlplacement.engines.vllm_engine import VllmRolloutEngine

    opts = dict(options) if options else {"num_cpus": 0}
    runtime_env = dict(opts.get("runtime_env") or {})
    runtime_env["env_vars"] = {**DEFAULT_ENV, **runtime_env.get("env_vars", {})}
    opts["runtime_env"] = runtime_env
    actor_cls = ray.remote(VllmRolloutEngine)
    return actor_cls.options(**opts).remote(model_dir, engine_index=index, **engine_kwargs)
