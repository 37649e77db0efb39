"""The vLLM plugin at the module path an install made from an older ``setup.py`` still names in its
``vllm.general_plugins`` entry point. vLLM imports that path in every one of its processes; while the
installed metadata names it, the plugin must be found there, or no process registers our weight-transfer
backend. ``setup.py`` names :mod:`rlplacement.engines.vllm.vllm_plugin`; once the package is reinstalled
(``pip install -e .``) nothing imports this module."""

from rlplacement.engines.vllm.vllm_plugin import register  # noqa: F401
