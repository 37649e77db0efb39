"""Rollout engines. What the job asks of one: ``base.RolloutEngine``; the kinds by name: ``registry``;
their Ray actors: ``ray_engines``.

The vLLM kind: the rollout engine that wraps ``vllm.LLM`` (``vllm_engine``), the worker extension vLLM
mixes into each of its workers, which the engine calls by name (``vllm_worker``), the native
weight-transfer backend hosting rlplacement's receivers (``vllm_backend``) registered by the
``vllm.general_plugins`` entry point (``vllm_plugin``), and the loader that puts staged tensors into
the model (``vllm_loader``)."""
