"""Rollout engines. What the job asks of one: ``base.RolloutEngine``; the kinds by name: ``registry``;
their Ray actors: ``ray_engines``. Engine-neutral parts an engine kind may use: the recorded copy plan
that commits an update with plain copies (``copy_plan``, ``copy_kernel``), the engine settings a model
folder resolves (``engine_settings``), the shared-memory segments a killed engine leaves (``shm_segments``).

Each kind is a package of its own: the vLLM kind is ``engines.vllm``."""
