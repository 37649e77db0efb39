"""Rollout engines as Ray actors. Construction lives in :func:`create_engine_actor` only, so the
placement layer's options (``RayPlacement.engine_options(i)``) plug in at one place."""

from __future__ import annotations

import functools
from typing import Any

from rlplacement.engines.registry import DEFAULT_ENGINE_KIND, engine_class

DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false"}
CONTROL_GROUP = "control"
CONTROL_THREADS = 4
"""Threads for the engine's control calls (``engines.base.CONTROL_CALLS`` and ``current_call``), so
a driver streaming two rollouts can still abort while the actor's main thread runs a blocking call."""


@functools.cache  # one actor class per kind for the job: Ray exports a class once, not once per engine
def engine_actor_class(kind: str = DEFAULT_ENGINE_KIND):
    """The engine class of ``kind`` (``registry``) as a Ray actor class whose control calls run in their own
    concurrency group (Ray runs an actor's other calls one at a time, so a poll, an abort or a pause would
    otherwise wait behind a running generate or update)."""
    import ray

    engine_cls = engine_class(kind)
    members = {}
    for name in dir(engine_cls):
        fn = getattr(engine_cls, name)
        if getattr(fn, "__control_call__", False):
            members[name] = ray.method(concurrency_group=CONTROL_GROUP)(_forward(fn))
    cls = type(f"{engine_cls.__name__}Actor", (engine_cls,), members)
    return ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_THREADS})(cls)


def _forward(fn):
    """A new function calling ``fn``, to carry Ray's concurrency group. Not ``functools.wraps``: its
    ``__wrapped__`` sends Ray's method inspection to ``fn``, which has no group, and the group is lost."""
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    method.__name__, method.__qualname__, method.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return method


def create_engine_actor(index: int, model_dir: str, *, kind: str = DEFAULT_ENGINE_KIND, options: dict | None = None,
                        env: dict[str, str] | None = None, **engine_kwargs: Any):
    """Start engine ``index`` of ``kind`` as a Ray actor; ``options`` are ``.options(**options)`` from
    placement, ``env`` environment variables for its process (the job gives the kind's
    ``RolloutEngine.process_env``: its log levels); ``engine_kwargs`` go to the engine class.

    Without placement options the actor takes no CPU reservation (tests on 2 cores start several).
    """
    opts = dict(options) if options else {"num_cpus": 0}
    runtime_env = dict(opts.get("runtime_env") or {})
    runtime_env["env_vars"] = {**DEFAULT_ENV, **(env or {}), **runtime_env.get("env_vars", {})}
    opts["runtime_env"] = runtime_env
    return engine_actor_class(kind).options(**opts).remote(model_dir, engine_index=index, **engine_kwargs)
