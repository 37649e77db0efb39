"""Receivers inside real engines. vLLM: a native weight-transfer backend (``vllm_backend``)
registered by the ``vllm.general_plugins`` entry point (``vllm_plugin``), the loader that puts
staged tensors into the model (``vllm_loader``), and the rollout engine that wraps ``vllm.LLM``
(``vllm_engine``; run as a Ray actor through ``ray_engines``)."""
