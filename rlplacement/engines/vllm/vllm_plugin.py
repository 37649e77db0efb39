"""vLLM general plugin: registers rlplacement's weight-transfer backend in every vLLM process.

Runs at start-up of each vLLM process (engine core and every worker), so it must stay cheap and
idempotent: it registers a lazy loader (module path + class name), imports nothing of ours, and
does nothing when the name is already registered or when this vLLM has no weight-transfer API.

vLLM versions: the engine-side ``WeightTransferEngineFactory`` exists from 0.16, custom backend
names are accepted from 0.22 (both builds setup.py pins have it). Older
vLLM has no such API, and rlplacement's engine does not run on it. The engine's own calls into each
worker go through its worker extension (``vllm_worker``), which vLLM loads by name without a plugin.
"""

BACKEND_NAME = "rlplacement"
BACKEND_MODULE = "rlplacement.engines.vllm.vllm_backend"
BACKEND_CLASS = "RlplacementWeightTransferEngine"


def register() -> bool:
    """Register the ``rlplacement`` backend; True when it is (now or already) available."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # vLLM < 0.16: no native weight-transfer API
        return False
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError:  # registered already (this process ran the plugin before): vLLM refuses a second time
        pass
    return True
