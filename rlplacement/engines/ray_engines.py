"""Rollout engines as Ray actors. Construction lives in :func:`create_engine_actor` only, so the
placement layer's options (``RayPlacement.engine_options(i)``) plug in at one place."""

from __future__ import annotations

import functools
from typing import Any

# vLLM's engine core runs in its own process where CUDA is (as in production); VllmRolloutEngine
# keeps it in-process on CPU only, where a separate process costs ~35 s of start-up per engine.
DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false"}
CONTROL_GROUP = "control"
CONTROL_THREADS = 4
"""Threads for the engine's control calls (``one_at_a_time.control_call``: poll, abort, current_call), so
a driver streaming two rollouts can still abort while the actor's main thread runs a blocking call."""


@functools.cache  # one actor class for the job: Ray exports a class once, not once per engine
def engine_actor_class():
    """``VllmRolloutEngine`` as a Ray actor class whose control calls run in their own concurrency group
    (Ray runs an actor's other calls one at a time, so a poll or an abort would otherwise wait behind
    a running generate or update)."""
    import ray

    from rlplacement.engines.vllm_engine import VllmRolloutEngine

    members = {}
    for name in dir(VllmRolloutEngine):
        fn = getattr(VllmRolloutEngine, name)
        if getattr(fn, "__control_call__", False):
            members[name] = ray.method(concurrency_group=CONTROL_GROUP)(_forward(fn))
    cls = type("VllmRolloutEngineActor", (VllmRolloutEngine,), members)
    return ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_THREADS})(cls)


def _forward(fn):
    """A new function calling ``fn``, to carry Ray's concurrency group. Not ``functools.wraps``: its
    ``__wrapped__`` sends Ray's method inspection to ``fn``, which has no group, and the group is lost."""
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    method.__name__, method.__qualname__, method.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return method


def create_engine_actor(index: int, model_dir: str, *, options: dict | None = None,
                        env: dict[str, str] | None = None, **engine_kwargs: Any):
    """Start engine ``index`` as a Ray actor; ``options`` are ``.options(**options)`` from placement,
    ``env`` environment variables for its process (e.g. vLLM's log level).

    Without placement options the actor takes no CPU reservation (tests on 2 cores start several).
    """
    opts = dict(options) if options else {"num_cpus": 0}
    runtime_env = dict(opts.get("runtime_env") or {})
    runtime_env["env_vars"] = {**DEFAULT_ENV, **(env or {}), **runtime_env.get("env_vars", {})}
    opts["runtime_env"] = runtime_env
    return engine_actor_class().options(**opts).remote(model_dir, engine_index=index, **engine_kwargs)
